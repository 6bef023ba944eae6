"""taskrunner's side of the bench's workloads beyond the no-op (`common.NOOP`).

``bench.handlers.Sleep`` with data ``{"ms": 5}``: sleeps 5 ms and nothing else (the
built-in ``taskrunner.handlers.Sleep`` also reports progress, which the peers' tasks do not).
"""
import time

from taskrunner import TaskHandler


class Sleep(TaskHandler):
    def handle(self, run):
        time.sleep(run.data["ms"] / 1000.0)
