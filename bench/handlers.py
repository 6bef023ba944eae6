"""taskrunner's side of the bench's workloads beyond the no-op (`common.NOOP`).

``bench.handlers.Sleep`` with data ``{"ms": 5}``: sleeps 5 ms and nothing else (the
built-in ``taskrunner.handlers.Sleep`` also reports progress, which the peers' tasks do not).

``bench.handlers.Mark`` with data ``{"marks": PATH}``: appends "TIME PID" to PATH when it
runs (bench/compare.py's pickup: when the handler ran, as the peers' no-ops mark it).

``bench.handlers.TenSteps`` with data ``{"sleep": S}`` (bench/durable.py): 10 no-op steps
(``run.step``), with a durable sleep of S seconds between the 5th and the 6th when S > 0
(``run.sleep``: the run ends waiting; the attempt that resumes finds the sleep and its first
five steps recorded and goes on from there). It needs the durable-handler API.
"""
import os
import time

from taskrunner import TaskHandler


class Sleep(TaskHandler):
    def handle(self, run):
        time.sleep(run.data["ms"] / 1000.0)


class Mark(TaskHandler):
    def handle(self, run):
        fd = os.open(run.data["marks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%.6f %d\n" % (time.time(), os.getpid()))
        finally:
            os.close(fd)


def _nothing():
    return None


class TenSteps(TaskHandler):
    def handle(self, run):
        sleep = (run.data or {}).get("sleep", 0)
        for i in range(10):
            if i == 5 and sleep:
                run.sleep(sleep)
            run.step("s%d" % i, _nothing)
