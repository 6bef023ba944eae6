"""The package's layout keeps to the map in DESIGN.md ("Layers"): packages import only from
their own layer and those below it, no module uses another module's private names, and no
import circle exists, not even through an import inside a function or one made for types
alone (`if TYPE_CHECKING:`). There is no line cap: a module is split along a seam (a process
kind, a rule, a face), never to fit a number."""
import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "taskrunner")

# The five layers of DESIGN.md ("Layers") and the README's table, from the ground up, by
# dotted name inside taskrunner: each package is declared once, in its layer; a module named
# on its own (store.models) sits below the rest of its package. The longest name that matches
# a module gives its layer. A module imports only from its own layer or those below it.
LAYERS = {
    1: ("errors", "timespan", "logs", "passwords", "masking", "tracing", "config", "handler",
        "handlers", "chunks",
        "calendar", "store.models", "store.migrations", "periodic.timers",
        "periodic.definitions", "verify.checker", "verify.history"),                          # data and pure logic
    2: ("store", "host"),                                 # one bound database; the same host
    3: ("runs", "fleet", "periodic", "reads"),            # the rules
    4: ("runner", "overseer", "api", "functions", "verify"),        # processes and faces
    5: ("cli", "web", "contrib", "testing", "__main__", "__init__"),     # entry points
}
LEVELS = {name: layer for layer, names in LAYERS.items() for name in names}


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


def type_only(tree):
    """The ids of the nodes inside `if TYPE_CHECKING:` blocks of `tree`."""
    checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            checking.update(id(n) for n in ast.walk(node))
    return checking


def internal_imports(tree, module, with_types=False):
    """(imported module, names, line) for every import of a taskrunner module, those inside
    functions too, and with `with_types` those of `if TYPE_CHECKING:` blocks (a type named
    upwards is no layer's use, but a circle through it is still one for a reader);
    `from . import a` yields the module `a` itself."""
    checking = set() if with_types else type_only(tree)
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
        edges[module] = {imported for imported, _, _ in internal_imports(tree, module, True)
                         if imported != module}
    return edges


@pytest.mark.parametrize("module,path", ALL, ids=[m for m, _ in ALL])
def test_module_keeps_to_its_layer_and_to_public_names(module, path):
    with open(path) as fh:
        tree = ast.parse(fh.read())
    level = level_of(module)
    for imported, names, line in internal_imports(tree, module):
        if imported == module:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, "%s:%d imports private %s from %s" % (module, line, private, imported)
        target = level_of(imported)
        assert target <= level, "%s (layer %d) imports %s (layer %d) at line %d" % (
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


def test_no_import_circle_even_through_function_level_or_type_only_imports():
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
            test_no_import_circle_even_through_function_level_or_type_only_imports()
    finally:
        globals()["graph"] = saved


def test_type_only_imports_close_circles_too():
    """A handler names the queue it is handed by handler.Queue, not api.TaskQueue: through
    that type-only import ran a circle of six modules (handler, api, runner.loop,
    periodic.scheduler, periodic.definitions, runs.enqueue) the circle check did not see."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from .api import TaskQueue\n")
    assert [m for m, _, _ in internal_imports(tree, "handler", with_types=True)] == ["api"]
    assert list(internal_imports(tree, "handler")) == []


def test_task_queue_is_the_queue_a_handler_is_handed():
    """handler.Queue lists what a run may ask of its queue, with TaskQueue's own signatures
    (so TaskQueue satisfies it for a type checker)."""
    import inspect

    from taskrunner.api import TaskQueue
    from taskrunner.handler import Queue

    asked = [name for name in vars(Queue) if not name.startswith("_")]
    assert "add_task" in asked and "parent_results" in asked
    for name in asked:
        ours, theirs = (inspect.signature(getattr(cls, name)) for cls in (Queue, TaskQueue))
        assert list(ours.parameters.values()) == list(theirs.parameters.values()), name


def test_every_module_has_a_layer():
    for module, _ in ALL:
        level_of(module)
