"""The suite's machine lock (tests/machine_lock.py): under pytest-xdist, a heavy test runs
beside no other heavy test and no timing test, and waiting for the lock is not counted in
a test's timeout. Checked on an inner run of four workers: each test marks its presence
while it runs and watches for the others' (without the lock, all four see each other).
That timing tests share the lock is not checked here: when two of them overlap is up to
the workers."""
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

INNER = '''
import os
import time

import pytest

HERE = os.environ["MACHINE_LOCK_TEST_DIR"]


def _watch(me):
    """Present for 2.5 s; the names of the other tests seen present meanwhile."""
    mine = os.path.join(HERE, "present-" + me)
    open(mine, "w").close()
    seen, deadline = set(), time.monotonic() + 2.5
    while time.monotonic() < deadline:
        seen |= {n[len("present-"):] for n in os.listdir(HERE) if n.startswith("present-")}
        time.sleep(0.02)
    os.unlink(mine)
    with open(os.path.join(HERE, "seen-" + me), "w") as out:
        out.write(" ".join(sorted(seen - {me})))


@pytest.mark.heavy
def test_heavy_1():
    _watch("heavy_1")


@pytest.mark.heavy
def test_heavy_2():
    _watch("heavy_2")


@pytest.mark.timing
def test_timing_1():
    _watch("timing_1")


def test_plain():
    _watch("plain")
'''

INI = '''[pytest]
markers =
    heavy: as in the suite
    timing: as in the suite
timeout = 4
'''


@pytest.mark.timing     # its inner tests' timeout: a bound on time
def test_heavy_tests_run_alone_among_heavy_and_timing_tests_and_wait_outside_the_timeout(
        tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pytest.ini").write_text(INI)
    (inner / "test_inner.py").write_text(INNER)
    env = dict(os.environ, MACHINE_LOCK_TEST_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    # Four tests, four workers: each worker starts one at once (worksteal splits evenly).
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "machine_lock",
         "-n", "4", "--dist", "worksteal", "--basetemp", str(tmp_path / "base"), str(inner)],
        cwd=str(inner), env=env, capture_output=True, text=True, timeout=120)
    # Timeout 4 s, each test 2.5 s: the heavy test that waited 2.5 s for the other one, and
    # the timing test that waited for both, were not timed out.
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {name: (tmp_path / ("seen-" + name)).read_text().split()
            for name in ("heavy_1", "heavy_2", "timing_1", "plain")}
    assert seen["heavy_1"] in ([], ["plain"]), seen
    assert seen["heavy_2"] in ([], ["plain"]), seen
    assert not any(name.startswith("heavy") for name in seen["timing_1"]), seen
    log = (tmp_path / "base" / "machine.log").read_text().splitlines()
    assert sorted(line.split()[1] for line in log) == ["heavy", "heavy", "timing"], log
