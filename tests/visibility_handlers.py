"""Handlers for test_visibility.py: failures with a stack, hooks, live results, async."""
import asyncio
import json
import os
import time

from taskrunner import TaskError, TaskHandler

# Set to make `broken_handlers` fail on import (test_visibility).
BREAK_ENV = "TASKRUNNER_TEST_BREAK_IMPORT"


def _append(path, value):
    with open(path, "a") as fh:
        fh.write(json.dumps(value) + "\n")


def read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def lookup_amount(invoice):
    return invoice["amount"]        # the line the traceback must name


class KeyFails(TaskHandler):
    """Fails with a KeyError two calls deep; `size` makes the message that long."""

    def handle(self, run):
        if (run.data or {}).get("size"):
            raise ValueError("x" * run.data["size"] + " END")
        lookup_amount({})


class Hooked(TaskHandler):
    """Fails; records its hooks' calls in data["log"]. data["hooks_fail"]: the hooks raise;
    data["no_retry"]: fails with TaskError(..., retry=False)."""

    def handle(self, run):
        run.results = {"partial": 1}
        if run.data.get("no_retry"):
            raise TaskError("attempt %d refused" % run.attempt, code="Refused", retry=False)
        raise RuntimeError("attempt %d failed" % run.attempt)

    def on_failure(self, run, exc):
        _append(run.data["log"], ["on_failure", run.id, run.attempt, type(exc).__name__])
        if run.data.get("hooks_fail"):
            raise ValueError("the hook itself fails")

    def on_give_up(self, task):
        _append(task.data["log"], ["on_give_up", task.id, task.status, task.runs_failed])
        if task.data.get("hooks_fail"):
            raise ValueError("the hook itself fails")


class LiveResults(TaskHandler):
    """Sets run.results step by step, waiting for data["go"] (a file) between steps."""

    def handle(self, run):
        run.results = {"step": 1}
        deadline = time.monotonic() + 60
        while not os.path.exists(run.data["go"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        run.results["step"] = 2           # changed in place: stored too
        while not os.path.exists(run.data["go"] + ".2") and time.monotonic() < deadline:
            time.sleep(0.02)
        run.results = {"step": 3, "done": True}


class AsyncAdd(TaskHandler):
    async def handle(self, run):
        await asyncio.sleep(0.01)
        if run.data.get("fail"):
            raise KeyError("async-missing")
        run.results = {"sum": sum(run.data["numbers"])}


class AsyncSleeper(TaskHandler):
    """Sleeps in the event loop until it is stopped; records a cancellation in data["log"]."""

    async def handle(self, run):
        try:
            while not run.should_stop():
                await asyncio.sleep(0.05)
            _append(run.data["log"], "should_stop")
            if run.data.get("ignore_stop"):
                await asyncio.sleep(60)
        except asyncio.CancelledError:
            _append(run.data["log"], "cancelled")
            raise


class UntilStopped(TaskHandler):
    """Works until should_stop(); with data["stubborn"], ignores it (interrupted only)."""

    def handle(self, run):
        _append(run.data["log"], "started")
        run.results = {"done": 0}
        try:
            while run.data.get("stubborn") or not run.should_stop():
                run.results = {"done": run.results["done"] + 1}
                time.sleep(0.05)
        finally:
            _append(run.data["log"], "should_stop" if run.should_stop() else "left")


class Stubborn(TaskHandler):
    """Ignores SIGTERM and every interruption: runs on until the runner exits hard."""

    def handle(self, run):
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _append(run.data["log"], "started")
        while True:
            try:
                time.sleep(0.05)
            except BaseException:       # the interruption of a run past its max_runtime
                _append(run.data["log"], "interrupted")
