"""A handler module that fails on import when visibility_handlers.BREAK_ENV is set."""
import os

from taskrunner import TaskHandler

from visibility_handlers import BREAK_ENV

if os.environ.get(BREAK_ENV):
    raise ImportError("cannot import name 'gone' from 'nowhere' (broken on purpose)")


class Fine(TaskHandler):
    def handle(self, run):
        run.results = "fine"
