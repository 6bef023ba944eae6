"""The work of bench/sqlite_contention.py's tasks: taskrunner's handler and Huey's task,
each sleeping the seconds in its data (nothing else: no progress reports)."""
import time

from taskrunner.handler import TaskHandler


class Sleep(TaskHandler):
    def handle(self, run):
        time.sleep(run.data)
