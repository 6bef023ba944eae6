"""The bench's own instruments: CPU accounting of a process tree (bench/cpu.py), the
taskrunner options and variants passed into the configs it writes, and its command line's
refusals. (The bench itself runs in CI as `bench/run.py --quick`.)"""
import os
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from bench.cpu import tree_seconds  # noqa: E402
from taskrunner.config import Config  # noqa: E402

# A parent with two children that each burn 0.3 s of CPU: one it has reaped, one still alive.
TREE = """
import os, sys, time

def child(then_exit):
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    if not then_exit:
        sys.stdin.read()
    os._exit(0)

reaped = os.fork()
if reaped == 0:
    child(True)
os.waitpid(reaped, 0)
if os.fork() == 0:
    child(False)
print("ready", flush=True)
sys.stdin.read()
"""


def test_cpu_of_a_tree_counts_live_and_reaped_children():
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        live = psutil.Process(proc.pid).children()[0]
        deadline = time.monotonic() + 60
        while sum(live.cpu_times()[:2]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        # 0.6 s burnt; /proc counts in clock ticks, so a little less may show. Without the
        # reaped child it would be about 0.3.
        assert tree_seconds([proc.pid]) >= 0.5
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_options_and_variants_reach_the_written_config(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "_workdir", str(tmp_path))
    monkeypatch.setattr(common, "TASKRUNNER_OPTIONS", {"runner": {"poll_interval": 0.5,
                                                                  "limit": 99}})
    url = "sqlite:///" + str(tmp_path / "q.db")
    path = common.write_config(url, 3, "variant", log={"level": "warning"},
                               runner={"heartbeat_interval": 2.0})
    config = Config.load(path)
    assert (config.runner.limit, config.runner.poll_interval, config.runner.heartbeat_interval,
            config.log.level) == (3, 0.5, 2.0, "warning")


@pytest.mark.parametrize("argv, message", [
    (["--taskrunner-option", "runner.batch"], "is not SECTION.KEY=VALUE"),
    (["--variants", "default,batch=16"], "is not SECTION.KEY=VALUE"),
    (["--workers", "1,x"], "--workers: '1,x' is not a list of positive integers"),
    (["--log-level", "warning,loud"], "is not warning, info or both"),
    (["--db", "sqlite,oracle"], "is not sqlite, postgresql, mysql, all or a list of them"),
])
def test_bench_refuses_bad_options_without_a_traceback(argv, message):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py")] + argv,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_the_bench_imports_no_test_module_and_its_server_harness_needs_no_pytest():
    """bench/ runs where only the bench extra is installed: the throwaway servers it borrows
    (tests/servers.py) import without pytest, and no bench module imports a test module
    (a test module imports pytest and conftest)."""
    import ast
    for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "bench", name)) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for module in modules:
                assert not module.startswith(("test_", "conftest")), \
                    "bench/%s:%d imports %s" % (name, node.lineno, module)
    code = ("import sys; sys.modules['pytest'] = None\n"
            "sys.path.insert(0, %r)\n"
            "from servers import MariaDBInstance, PgBouncer, PostgresCluster, ServerMissing\n"
            % os.path.join(ROOT, "tests"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
