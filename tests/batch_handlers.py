"""Handlers of test_batch: a run that holds its runner until the test opens a gate, so the
runs claimed with it wait, claimed and not started, for as long as the test needs."""
import os
import time

from sample_handlers import record
from taskrunner import TaskHandler


class Gate(TaskHandler):
    """Writes a start marker, waits (at most 120 s) until the file data["gate"] exists,
    then records its execution."""

    def handle(self, run):
        record(run.data["log"] + ".started", "%d %d %d" % (run.task_id, run.id, os.getpid()))
        deadline = time.monotonic() + 120
        while not os.path.exists(run.data["gate"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        record(run.data["log"], "%d %d %d" % (run.task_id, run.id, os.getpid()))
