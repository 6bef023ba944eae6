"""Handlers of the workflow tests (tests/test_workflows.py)."""
import os
import time

from taskrunner import TaskError, TaskHandler
from taskrunner.verify import history


def _record(path, line):
    """One line appended (O_APPEND: lines of concurrent processes never interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class Step(TaskHandler):
    """Records "start TASK RUN" in data["log"] (if given) and its start in the verify
    history in data["history"] (if given), sleeps data["sleep"], records "end TASK RUN" and
    its return,
    and returns data["value"] (or its task id) as its results — {"parents": N} with
    data["count_parents"], N its parents' results read —; fails with data["fail"]."""

    def handle(self, run):
        data = run.data or {}
        if data.get("log"):
            _record(data["log"], "start %d %d" % (run.task_id, run.id))
        if data.get("history"):
            history.record(data["history"], "start", task=run.task_id, run=run.id,
                           attempt=run.attempt)
        if data.get("sleep"):
            time.sleep(data["sleep"])
        if data.get("fail"):
            raise TaskError("planned failure", code="Planned")
        results = data.get("value", run.task_id)
        if data.get("count_parents"):
            results = {"parents": sum(1 for _ in run.parent_results.items())}
            if data.get("history"):
                history.record(data["history"], "fanin", task=run.task_id, run=run.id,
                               parents=results["parents"])
        if data.get("log"):
            _record(data["log"], "end %d %d" % (run.task_id, run.id))
        if data.get("history"):
            history.record(data["history"], "done", task=run.task_id, run=run.id)
        run.results = results


class Sum(TaskHandler):
    """Fan-in: the sum of its parents' results, read page by page."""

    def handle(self, run):
        total = count = 0
        for _, value in run.parent_results.items():
            total += value or 0
            count += 1
        run.results = {"sum": total, "parents": count}
