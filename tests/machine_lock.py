"""Heavy and timing tests never overlap (tests/conftest.py's docstring): a pytest plugin,
imported by conftest.py (and loaded alone with ``-p machine_lock`` by its own test).

Under pytest-xdist each worker runs a test marked ``heavy`` holding an exclusive flock(2)
on ``machine.lock`` in the run's temp directory (the parent of the workers'
``popen-gwN``), and a test marked ``timing`` holding a shared one, from before its set-up to
after its tear-down — outside pytest-timeout's timer, which starts inside this wrapper.
Each locked test appends ``worker kind asked= start= end= nodeid`` to ``machine.log``
beside the lock. Without xdist nothing is locked: tests run one at a time."""
import fcntl
import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    heavy, timing = item.get_closest_marker("heavy"), item.get_closest_marker("timing")
    worker = getattr(item.config, "workerinput", None)
    # xdist gives each worker the temp directory <the run's>/popen-gwN (unless pytest's
    # tmpdir plugin is off: then no lock).
    if worker is None or not (heavy or timing) or not item.config.option.basetemp:
        yield
        return
    run_dir = os.path.dirname(os.path.abspath(item.config.option.basetemp))
    mode, word = (fcntl.LOCK_EX, "heavy") if heavy else (fcntl.LOCK_SH, "timing")
    with open(os.path.join(run_dir, "machine.lock"), "a") as lock:
        asked = time.time()
        fcntl.flock(lock, mode)
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            fcntl.flock(lock, fcntl.LOCK_UN)
            with open(os.path.join(run_dir, "machine.log"), "a") as log:
                log.write("%s %s asked=%.3f start=%.3f end=%.3f %s\n" % (
                    worker["workerid"], word, asked, start, end, item.nodeid))
