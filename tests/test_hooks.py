"""Hooks are wired where a process builds its store, never by an import kept only for its
side effect: such an import is one linter fix away from silently stopping what it wires
(the periodic tasks' last status and failure counts)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import process_env

PACKAGE = Path(__file__).resolve().parent.parent / "taskrunner"

FRESH_PROCESS = """
import json, sys
from taskrunner import TaskQueue
from taskrunner.periodic.scheduler import add_periodic, run_now

queue = TaskQueue(sys.argv[1], migrate=True)
add_periodic(queue.store, "tick", "taskrunner.handlers.Echo", "every 10s")
run_now(queue.store, "tick")
queue.run_pending()
row = queue.store.PeriodicTask.get(queue.store.PeriodicTask.name == "tick")
print(json.dumps(row.last_status))
"""


def test_a_fresh_process_that_opens_a_queue_keeps_periodic_bookkeeping(tmp_path):
    url = "sqlite:///%s" % (tmp_path / "q.db")
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, url], env=process_env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out) == "success"


def _module_of(path, node, alias):
    """The file or package a `from ... import name` binds, when `name` is a module of this
    package (None for a name inside a module)."""
    if node.level == 0:
        return None
    base = path.parent
    for _ in range(node.level - 1):
        base = base.parent
    target = base.joinpath(*(node.module or "").split("."), alias.name)
    return target if target.with_suffix(".py").exists() or target.is_dir() else None


def _unused_module_imports(path):
    tree = ast.parse(path.read_text(), str(path))
    bound = {}
    for node in tree.body:
        for alias in getattr(node, "names", ()) if isinstance(
                node, (ast.Import, ast.ImportFrom)) else ():
            if isinstance(node, ast.Import) or _module_of(path, node, alias):
                bound[alias.asname or alias.name.partition(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return ["%s:%d %s" % (path.relative_to(PACKAGE.parent), line, name)
            for name, line in bound.items() if name not in used]


def test_no_module_is_imported_for_its_side_effect():
    # Packages' __init__ files gather their modules; every other module uses what it imports.
    unused = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "__init__.py"
              for hit in _unused_module_imports(path)]
    assert unused == []
