"""The package's layout keeps to the map in DESIGN.md ("Layers"): packages import only
downwards, no module uses another module's private names, and no import circle exists, not
even through an import inside a function. There is no line cap: a module is split along a
seam (a process kind, a rule, a face), never to fit a number."""
import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "taskrunner")

# From the ground up (DESIGN.md "Layers"), by dotted name inside taskrunner; the longest
# prefix that matches a module gives its layer. Within a layer the modules are ordered too.
LEVELS = {
    # 1. data and pure logic
    "errors": 1.0, "timespan": 1.0, "logs": 1.0, "calendar": 1.0, "passwords": 1.0,
    "masking": 1.0,
    "store.models": 1.0, "store.migrations": 1.0,
    "config": 1.1, "handler": 1.1, "periodic.timers": 1.1,
    "handlers": 1.2, "periodic.definitions": 1.2,
    # 2. one bound database; the same-host machinery
    "store": 2.0, "store.db": 2.0,
    "host": 2.0, "host.hostlock": 2.0, "host.groupsync": 2.0, "host.runtimedir": 2.0,
    "host.wakeup": 2.0,
    "host.claimfile": 2.05,
    "store.bound": 2.1, "store.outage": 2.1, "host.hub": 2.1,
    # 3. the rules: the run lifecycle and its SQL catalogue, liveness, periodic, reads
    "runs": 2.9, "runs.concurrency": 2.9, "runs.statements": 2.93, "runs.sql": 2.95, "runs.flow": 2.97,
    "runs.graph": 2.97,
    "runs.lifecycle": 3.0, "runs.enqueue": 3.0,
    "fleet": 3.1, "fleet.liveness": 3.1, "fleet.leadership": 3.15,
    "runs.durable": 3.05,
    "runs.rotation": 3.1, "runs.control": 3.1, "runs.queues": 3.1,
    "reads": 3.1, "reads.records": 3.1, "reads.summaries": 3.2, "reads.workflows": 3.2,
    "periodic": 3.2, "periodic.scheduler": 3.2, "fleet.maintenance": 3.2,
    # 4. processes and faces: peers, kept apart from each other by the circle check
    "runner": 3.3, "runner.stops": 3.3, "runner.current": 3.3, "runner.outcomes": 3.3,
    "runner.batches": 3.35, "runner.heartbeat": 3.4,
    "runner.process": 4, "overseer": 4, "overseer.maintainer": 4, "overseer.overseer": 4,
    "api": 4, "functions": 4, "testing": 5,
    # 5. entry points
    "cli": 5, "web": 5, "contrib": 5, "__main__": 5, "__init__": 5,
}


def modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                relative = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                yield relative, path


def level_of(module):
    """The layer of 'runs.lifecycle' (or of a package's '__init__', by its package)."""
    parts = module.split(".")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in LEVELS:
            return LEVELS[key]
    raise KeyError(module)


def known(module):
    """The module itself, or its package when `module` names a package ('runs')."""
    if os.path.exists(os.path.join(PACKAGE, *module.split(".")) + ".py"):
        return module
    return module + ".__init__" if os.path.isdir(os.path.join(PACKAGE, *module.split("."))) \
        else module.rsplit(".", 1)[0]


def internal_imports(tree, module):
    """(imported module, names, line) for every import of a taskrunner module, outside
    `if TYPE_CHECKING:` blocks; `from . import a` yields the module `a` itself."""
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
                target = node.module.split(".", 1)[1]
            elif node.module == "taskrunner":
                target = ""
            else:
                continue
            base = target.split(".") if target else []
        else:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else list(package)
            if node.module:
                base = base + node.module.split(".")
        prefix = ".".join(base)
        module_names = [a.name for a in node.names
                        if os.path.exists(os.path.join(PACKAGE, *(base + [a.name]))) or
                        os.path.exists(os.path.join(PACKAGE, *(base + [a.name])) + ".py")]
        for alias in module_names:
            yield known(".".join(base + [alias])), [], node.lineno
        others = [a.name for a in node.names if a.name not in module_names]
        if others:
            yield known(prefix) if prefix else "__init__", others, node.lineno


ALL = list(modules())


def graph():
    edges = {}
    for module, path in ALL:
        with open(path) as fh:
            tree = ast.parse(fh.read())
        edges[module] = {imported for imported, _, _ in internal_imports(tree, module)
                         if imported != module}
    return edges


@pytest.mark.parametrize("module,path", ALL, ids=[m for m, _ in ALL])
def test_module_keeps_to_its_layer_and_to_public_names(module, path):
    with open(path) as fh:
        tree = ast.parse(fh.read())
    level = level_of(module)
    own_package = module.split(".")[0]
    for imported, names, line in internal_imports(tree, module):
        if imported == module:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, "%s:%d imports private %s from %s" % (module, line, private, imported)
        target = level_of(imported)
        if imported.split(".")[0] == own_package and level >= 4:
            continue       # a process package's modules use each other; the circle check holds
        if level >= 4 and target >= 4:
            continue       # the facade, the runner and the overseer are peers (no circle)
        assert target < level or (target == level and imported.split(".")[0] == own_package), \
            "%s (layer %s) imports %s (layer %s) at line %d" % (module, level, imported,
                                                                 target, line)
    imported_modules = {alias.asname or alias.name for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.level
                        for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in imported_modules and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            raise AssertionError("%s:%d uses %s.%s, a private name of another module"
                                 % (module, node.lineno, node.value.id, node.attr))


def test_no_import_circle_even_through_function_level_imports():
    edges = graph()
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for imported in sorted(edges.get(module, ())):
            if state.get(imported) == "open":
                circle = stack[stack.index(imported):] + [imported]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if imported not in state:
                visit(imported)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_circle_check_can_fail():
    edges = {"a": {"b"}, "b": {"a"}}
    assert "b" in edges["a"] and "a" in edges["b"]   # the shape the check above refuses
    saved = graph
    try:
        globals()["graph"] = lambda: edges
        with pytest.raises(AssertionError, match="import circle: a -> b -> a"):
            test_no_import_circle_even_through_function_level_imports()
    finally:
        globals()["graph"] = saved


def test_every_module_has_a_layer():
    for module, _ in ALL:
        level_of(module)
