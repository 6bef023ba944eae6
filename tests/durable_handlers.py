"""Handlers of the durable-execution tests (tests/test_durable*.py). Each execution of a
step's body is appended to a file outside the database (O_APPEND, one line each), so a test
counts executions independently of what the database recorded."""
import os
import time

from taskrunner import TaskError, TaskHandler
from sample_handlers import record
from taskrunner.verify import history


def lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [line.split() for line in fh if line.strip()]


def param(connection):
    """The DB-API paramstyle's placeholder of `connection` (sqlite3: ?, the others %s)."""
    return "?" if type(connection).__module__.startswith("sqlite3") else "%s"


def insert_app_row(connection, table, task_id, step):
    """An application's write, inside the step's transaction."""
    cursor = connection.cursor()
    mark = param(connection)
    cursor.execute("INSERT INTO %s (task_id, step) VALUES (%s, %s)" % (table, mark, mark),
                   (task_id, step))
    cursor.close()
    return {"task": task_id, "step": step}


class CheckpointThenFail(TaskHandler):
    """Attempt 1 checkpoints and fails; every attempt records what it resumed from."""

    def handle(self, run):
        record(run.data["log"], "%d %s" % (run.attempt, run.resumed_from))
        if run.attempt == 1:
            run.checkpoint({"done": 3}, progress=30)
            raise TaskError("first attempt fails", code="Planned")
        run.results = {"resumed_from": run.resumed_from}


class StepsThenFail(TaskHandler):
    """Two steps (one plain, one in a transaction writing an app row), a failure on the first
    attempt after them, and the idempotency key of a step in the results."""

    def handle(self, run):
        log, table = run.data["log"], run.data["table"]

        def charge(amount):
            record(log, "charge %d" % run.attempt)
            return {"charged": amount}
        first = run.step("charge", charge, 42)

        def write(connection):
            record(log, "write %d" % run.attempt)
            return insert_app_row(connection, table, run.task_id, "write")
        second = run.transaction_step("write", write)
        if run.attempt == 1:
            raise TaskError("fails after the steps", code="Planned")
        run.results = {"first": first, "second": second,
                       "key": run.idempotency_key("charge")}


class FailingTransactionStep(TaskHandler):
    """A transaction step whose function writes, then raises: nothing is kept of it."""

    def handle(self, run):
        def write(connection):
            insert_app_row(connection, run.data["table"], run.task_id, "broken")
            raise TaskError("after the write", code="Planned")
        run.transaction_step("broken", write)


class SleepBetweenSteps(TaskHandler):
    """A step, a durable sleep of data["seconds"], another step."""

    def handle(self, run):
        log = run.data["log"]
        run.step("before", lambda: record(log, "before %d" % run.attempt))
        run.sleep(run.data["seconds"])
        run.step("after", lambda: record(log, "after %d" % run.attempt))
        run.results = {"attempt": run.attempt}


class WaitForApproval(TaskHandler):
    """Waits for the event "approved" (data["timeout"] seconds, or for ever)."""

    def handle(self, run):
        record(run.data["log"], "start %d" % run.attempt)
        payload = run.wait_for("approved", timeout=run.data.get("timeout"))
        run.results = {"approved": payload}


class WaitTwice(TaskHandler):
    """Waits for the event "shipped" twice (data["timeout"] seconds each, or for ever) and
    logs each wait's return; with data["fail_first"], attempt 1 fails after both. Its hooks
    are logged too."""

    def handle(self, run):
        log, timeout = run.data["log"], run.data.get("timeout")
        first = run.wait_for("shipped", timeout=timeout)
        record(log, "first %d %s" % (run.attempt, first))
        second = run.wait_for("shipped", timeout=timeout)
        record(log, "second %d %s" % (run.attempt, second))
        if run.data.get("fail_first") and run.attempt == 1:
            raise TaskError("fails after both waits", code="Planned")
        run.results = {"shipped": [first, second]}

    def on_failure(self, run, exc):
        record(run.data["log"], "on_failure %d %s" % (run.attempt, type(exc).__name__))

    def on_give_up(self, task):
        record(task.data["log"], "on_give_up %s %d" % (task.last_error_code, task.runs_failed))


class Steps(TaskHandler):
    """data["steps"] steps with a checkpoint after each (the 600-step task of the issue):
    each step's execution is logged outside the database; the handler returns (and so is
    handed back) when asked to stop between steps, having recorded why and by when."""

    def handle(self, run):
        start = run.resumed_from or 0
        for i in range(start, run.data["steps"]):
            if run.should_stop():
                record(run.data["log"] + ".stops", "%s %s" % (
                    run.stop_reason, run.stop_deadline.isoformat()
                    if run.stop_deadline else None))
                raise TaskError("asked to stop at step %d" % i, code="Stopped")
            time.sleep(run.data.get("sleep", 0.01))
            record(run.data["log"], "%d %d" % (run.task_id, i))
            run.checkpoint(i + 1, progress=100 * (i + 1) // run.data["steps"])


class WaitUntilStopped(TaskHandler):
    """Runs until asked to stop; records why and by when, and gives up the run."""

    def handle(self, run):
        record(run.data["log"] + ".started", "%d" % os.getpid())
        while not run.should_stop():
            time.sleep(0.02)
        record(run.data["log"], "%s %s" % (run.stop_reason, run.stop_deadline.isoformat()))
        raise TaskError("stopped: %s" % run.stop_reason, code="Stopped")


class Chaos(TaskHandler):
    """The chaos test's task: data["steps"] steps, each a transaction step that writes an app
    row (and logs its execution in the step's own transaction, to the table ``executions``)
    and records its execution and its commit outside the database, in the verify history
    in the directory data["log"]; a checkpoint after each; one durable sleep half-way."""

    def handle(self, run):
        log, steps = run.data["log"], run.data["steps"]
        start = run.resumed_from or 0
        history.record(log, "start", task=run.task_id, run=run.id, attempt=run.attempt)
        for i in range(start, steps):
            name = "s%d" % i

            def body(connection, i=i, name=name):
                history.record(log, "exec", task=run.task_id, run=run.id, step=name)
                cursor = connection.cursor()
                mark = param(connection)
                cursor.execute("INSERT INTO executions (task_id, step) VALUES (%s, %s)"
                               % (mark, mark), (run.task_id, name))
                cursor.close()
                return insert_app_row(connection, "app_rows", run.task_id, name)
            run.transaction_step(name, body)
            history.record(log, "step", task=run.task_id, run=run.id, step=name)
            if i == steps // 2:
                run.sleep(run.data.get("sleep", 0.5))
            run.checkpoint(i + 1)
            time.sleep(run.data.get("pause", 0.005))
        history.record(log, "done", task=run.task_id, run=run.id)
        run.results = {"steps": steps}


class BigStep(TaskHandler):
    """A step whose result is data["size"] characters of JSON text (and a small one first)."""

    def handle(self, run):
        run.step("small", lambda: "ok")
        run.step("big", lambda: "x" * run.data["size"])
