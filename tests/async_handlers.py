"""Handlers of tests/test_async.py."""
from taskrunner import TaskHandler


class Sum(TaskHandler):
    def handle(self, run):
        run.results = {"sum": sum(run.data["numbers"])}
