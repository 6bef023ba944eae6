"""Function tasks of the children chaos test (tests/test_children_chaos.py): roots that add
their children from inside the handler — a group of `n` children and its fan-in in one
enqueue (`fan`), or `n` children enqueued one by one and waited for together (`fan_loop`) —
and record where they are in a log file, so that the test can kill -9 a root's runner
mid-add and show what each attempt did.

Log lines (`_record`, appended with O_APPEND: lines of concurrent processes never
interleave), each ``KIND ROOT ATTEMPT PID INDEX TIME``: ``start`` (INDEX -1), ``adding``
(before the group's enqueue, -1), ``added`` (after the enqueue of child INDEX, or of the
whole group: -1), ``joined`` (the children's results read, -1); TIME from time.time().

Given a `history` directory, every task also records what `taskrunner verify`'s checker reads
(taskrunner/verify/history.py): each run's start and return, and the fan-in's reading of its
parents' results."""
import os
import time
from typing import Any, Dict, List, NamedTuple, Tuple

from taskrunner import RunContext, group, results_of, task
from taskrunner.verify import history as verify_history

# Retries enough for any number of kills; no backoff, so a killed attempt comes back at once.
OPTIONS = {"max_retries": 100, "retry_backoff": 0}


def _record(path: str, kind: str, me: Tuple[int, int, int], index: int = -1) -> None:
    line = "%s %d %d %d %d %.6f\n" % ((kind,) + me + (index, time.time()))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class LogLine(NamedTuple):
    kind: str
    root: int
    attempt: int
    pid: int
    index: int
    at: float


def read_log(path: str, offset: int = 0) -> Tuple[List[LogLine], int]:
    """The complete lines of the log from byte `offset` on, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read()
    except FileNotFoundError:
        return [], offset
    complete = text[:text.rfind(b"\n") + 1]
    lines = []
    for raw in complete.decode().splitlines():
        kind, root, attempt, pid, index, at = raw.split()
        lines.append(LogLine(kind, int(root), int(attempt), int(pid), int(index), float(at)))
    return lines, offset + len(complete)


def _event(history: str, run: RunContext, kind: str, **fields: Any) -> None:
    if history:
        verify_history.record(history, kind, task=run.task_id, run=run.id, **fields)


@task(**OPTIONS)
def child(run: RunContext, index: int, tag: str, base: int, sleep: float = 0.0,
          history: str = "") -> int:
    """One child: ``base + index`` (the base from its root's step), after `sleep` seconds
    (so that kills find children running too)."""
    _event(history, run, "start", attempt=run.attempt)
    if sleep:
        time.sleep(sleep)
    _event(history, run, "done")
    return base + index


@task(**OPTIONS)
def collect(run: RunContext, results: List[int], tag: str, history: str = "") -> Dict[str, Any]:
    """The fan-in: every result of the group, in the group's order."""
    _event(history, run, "start", attempt=run.attempt)
    _event(history, run, "fanin", parents=len(results))
    _event(history, run, "done")
    return {"tag": tag, "count": len(results), "sum": sum(results), "results": results}


@task(**OPTIONS)
def fan(run: RunContext, n: int, log: str, sleep: float = 0.0,
        history: str = "") -> Dict[str, Any]:
    """1 -> n -> 1 from inside the handler: a step, then the group of `n` children and its
    fan-in in one enqueue; returns the fan-in's result (a durable wait)."""
    me = (run.task_id, run.attempt, os.getpid())
    _record(log, "start", me)
    _event(history, run, "start", attempt=run.attempt)
    base = run.step("base", lambda: 1000)
    _record(log, "adding", me)
    workflow = group(child.s(i, "group", base, sleep, history) for i in range(n)).then(
        collect.s("group", history)).enqueue(name="fan-%d" % run.task_id)
    _record(log, "added", me)
    result = workflow.result()
    _record(log, "joined", me)
    _event(history, run, "done")
    return result


@task(**OPTIONS)
def fan_loop(run: RunContext, n: int, log: str, sleep: float = 0.0,
             pause: float = 0.0, history: str = "") -> Dict[str, Any]:
    """n children enqueued one by one (each its own exactly-once add), `pause` seconds
    apart, then one durable wait for all of their results; returns their count and sum."""
    me = (run.task_id, run.attempt, os.getpid())
    _record(log, "start", me)
    _event(history, run, "start", attempt=run.attempt)
    base = run.step("base", lambda: 5000)
    handles = []
    for i in range(n):
        handles.append(child.enqueue(i, "loop", base, sleep, history))
        _record(log, "added", me, i)
        if pause:
            time.sleep(pause)
    values = results_of(handles)
    _record(log, "joined", me)
    _event(history, run, "done")
    return {"count": len(values), "sum": sum(values), "first": values[0], "last": values[-1]}
