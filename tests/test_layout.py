"""The package's layout keeps to the map in DESIGN.md: layers import only downwards, no
module uses another module's private names, and no module grows past ~500 lines."""
import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "taskrunner")
MAX_LINES = 500

# From the ground up (DESIGN.md "Layers"). Within layer 3 the rule modules are ordered too:
# the run lifecycle and adding tasks at the bottom, then what builds on them.
LEVELS = {
    "errors": 1.0, "timespan": 1.0, "models": 1.0, "migrations": 1.0, "calendar": 1.0,
    "config": 1.1, "handler": 1.1, "handlers": 1.2, "timers": 1.1, "logs": 1.0,
    "periodic_definitions": 1.2,
    "db": 2.0, "hostlock": 2.0, "groupsync": 2.0, "wakeup": 2.0, "claimfile": 2.05,
    "store": 2.1, "outage": 2.1, "hub": 2.1,
    "concurrency": 2.9,        # concurrency-key slots: a rule the run lifecycle builds on
    "lifecycle": 3.0, "enqueue": 3.0,
    "leadership": 3.15, "liveness": 3.1, "rotation": 3.1, "reads": 3.1, "control": 3.1, "queues": 3.1, "summaries": 3.2,
    "periodic": 3.2, "maintenance": 3.2, "outcomes": 3.3, "batches": 3.35, "heartbeat": 3.4,
    "queue": 4, "runner": 4, "overseer": 4,
    "cli": 5, "cli_args": 5, "cli_runs": 5, "cli_calendar": 5, "cli_periodic": 5, "cli_queues": 5,
    "__main__": 5,
    "__init__": 5, "web": 5,
}


def modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                relative = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                yield relative, path


def top(name):
    """'calendar.parse' -> 'calendar'; 'migrations.0001_initial' -> 'migrations'."""
    return name.split(".")[0]


def internal_imports(tree, module):
    """(imported module, names, line) for every import of a taskrunner module, outside
    `if TYPE_CHECKING:` blocks."""
    checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            checking.update(id(n) for n in ast.walk(node))
    package = module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in checking or not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if node.module and node.module.startswith("taskrunner."):
                yield node.module.split(".")[1], [a.name for a in node.names], node.lineno
            continue
        base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
        if node.module:
            yield top(".".join(base + node.module.split("."))), [a.name for a in node.names], node.lineno
        else:   # from . import a, b
            for alias in node.names:
                yield top(".".join(base + [alias.name])), [], node.lineno


@pytest.mark.parametrize("module,path", list(modules()), ids=[m for m, _ in modules()])
def test_module_keeps_to_its_layer_and_to_public_names(module, path):
    with open(path) as fh:
        source = fh.read()
    assert source.count("\n") <= MAX_LINES, "%s has %d lines" % (module, source.count("\n"))
    tree = ast.parse(source)
    own = top(module)
    level = LEVELS[own]
    for imported, names, line in internal_imports(tree, module):
        if imported == own:
            continue
        private = [n for n in names if n.startswith("_")]
        assert not private, "%s:%d imports private %s from %s" % (module, line, private, imported)
        target = LEVELS[imported]
        if level >= 4 and target >= 4:
            continue       # the facade, the runner and the overseer are peers
        assert target < level, "%s (layer %s) imports %s (layer %s) at line %d" % (
            module, level, imported, target, line)
    imported_modules = {alias.asname or alias.name for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.level
                        for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in imported_modules and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            raise AssertionError("%s:%d uses %s.%s, a private name of another module"
                                 % (module, node.lineno, node.value.id, node.attr))


def test_every_module_has_a_layer():
    assert {top(m) for m, _ in modules()} <= set(LEVELS)
