"""Built-in handlers: small, safe ones for trying taskrunner out and for housekeeping."""
import time

from .errors import TaskError
from .handler import TaskHandler


class Echo(TaskHandler):
    """Stores its data as its results: ``taskrunner add taskrunner.handlers.Echo --data '{"hi": 1}'``."""

    def handle(self, run):
        run.results = run.data


class Sleep(TaskHandler):
    """Sleeps ``{"seconds": N}`` (default 1), reporting progress, and stops early when asked."""

    def handle(self, run):
        seconds = float((run.data or {}).get("seconds", 1))
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            run.progress(100 * elapsed / seconds)
            if run.should_stop():
                raise TaskError("stopped after %.1fs of %.1fs" % (elapsed, seconds), code="Stopped")
            time.sleep(min(0.1, seconds - elapsed))
        run.results = {"slept": seconds}


class Fail(TaskHandler):
    """Always fails with ``{"code": ..., "message": ...}``; for trying retries out."""

    def handle(self, run):
        data = run.data or {}
        raise TaskError(data.get("message", "failed on purpose"), code=data.get("code", "Fail"))


class Rotate(TaskHandler):
    """Rotation as a task: the built-in periodic task ``taskrunner.rotate`` runs it."""

    def handle(self, run):
        run.results = run.queue.rotate()
