"""What operators and users read: tasks, runs, runners, periodic tasks and counts, as plain
typed records (JSON decoded, datetimes aware UTC).

One module of read queries feeds the `TaskQueue` facade, the CLI's ``--json`` output, and
later the dashboard and the metrics; none of them queries the tables on its own. These
functions only read.
"""
import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

import peewee as pw

from .errors import InputError, TaskNotFound
from .models import FAILED, RUN_STATUSES, RUNNING, SCHEDULED, run_status_is

TASK_FILTERS = RUN_STATUSES + ("given-up",)


def aware(value: Optional[datetime]) -> Optional[datetime]:
    """A stored naive UTC datetime as an aware one."""
    return value.replace(tzinfo=timezone.utc) if value is not None else None


def _decoded(text: Optional[str]) -> Any:
    return json.loads(text) if text else None


class _Record:
    """What every record can do: turn into JSON-ready data (ISO 8601 datetimes)."""

    def to_json(self) -> Dict[str, Any]:
        return {key: value.isoformat() if isinstance(value, datetime) else value
                for key, value in dataclasses.asdict(self).items()}  # type: ignore[call-overload]


@dataclass(frozen=True)
class TaskInfo(_Record):
    """A task: its definition, where it stands, and its last error."""
    id: int
    handler: str
    data: Any
    status: str                 # the status of its latest run, or cancelled
    given_up: bool              # failed max_retries times in a row: no further run
    priority: int
    queued_on: datetime
    queued_by: Optional[str]
    scheduled_on: datetime
    next_run_on: Optional[datetime]    # when its next run will be created (waiting to retry)
    finished_on: Optional[datetime]
    runs: int
    runs_failed: int
    max_retries: int
    run_timeout: float
    max_runtime: Optional[float]
    unique_key: Optional[str]
    periodic_task_id: Optional[int]
    last_error_code: Optional[str]
    last_error_message: Optional[str]
    queue: str


@dataclass(frozen=True)
class RunInfo(_Record):
    """One attempt at a task."""
    id: int
    task_id: int
    attempt: int
    status: str
    runner_id: Optional[int]
    percent_completed: int
    created_on: datetime
    started_on: Optional[datetime]
    updated_on: datetime
    finished_on: Optional[datetime]
    duration: Optional[float]          # seconds, once finished
    results: Any
    error_code: Optional[str]
    error_message: Optional[str]


@dataclass(frozen=True)
class RunnerInfo(_Record):
    """A runner or overseer process, with the run it is executing."""
    id: int
    kind: str
    host: str
    pid: int
    state: str
    slot: Optional[int]
    parent_id: Optional[int]
    run_id: Optional[int]
    task_id: Optional[int]
    progress: Optional[int]
    rss_mb: Optional[float]
    runs_done: int
    started_on: datetime
    heartbeat_on: datetime


@dataclass(frozen=True)
class QueueInfo(_Record):
    """A queue: paused or not, its host limit, what waits in it and for how long."""
    name: str
    paused: bool
    limit: Optional[int]        # [queues.NAME] limit; None: served by the default runners
    scheduled: int              # runs waiting to be claimed
    running: int
    runners: int                # runners serving it now, on every host
    lag: Optional[float]        # seconds the oldest waiting run has been due; None: none waits


@dataclass(frozen=True)
class PeriodicTaskInfo(_Record):
    """A timer that submits tasks, with its counters."""
    name: str
    enabled: bool
    handler: str
    data: Any
    timer: str
    nextrun: Optional[datetime]
    last_due: Optional[datetime]
    last_run: Optional[datetime]
    last_task_id: Optional[int]
    last_status: Optional[str]
    consecutive_failures: int
    submitted: int
    skipped: int
    priority: int
    catch_up: str
    max_runtime: Optional[float]
    min_spacing: Optional[float]
    owner: Optional[str]
    source: str
    worker: Optional[str]
    marked: Optional[datetime]
    queue: str


def task_info(row: Any) -> TaskInfo:
    return TaskInfo(
        id=row.id, handler=row.handler, data=_decoded(row.data), status=row.last_status,
        given_up=row.given_up, priority=row.priority, queued_on=aware(row.queued_on),
        queued_by=row.queued_by, scheduled_on=aware(row.scheduled_on),
        next_run_on=aware(row.next_run_on), finished_on=aware(row.finished_on),
        runs=row.run_count, runs_failed=row.runs_failed, max_retries=row.max_retries,
        run_timeout=row.run_timeout, max_runtime=row.max_runtime, unique_key=row.unique_key,
        periodic_task_id=row.periodic_task_id, last_error_code=row.last_error_code,
        last_error_message=row.last_error_message, queue=row.queue)


def run_info(row: Any) -> RunInfo:
    duration = (row.finished_on - row.started_on).total_seconds() \
        if row.finished_on and row.started_on else None
    return RunInfo(
        id=row.id, task_id=row.task_id, attempt=row.attempt, status=row.status,
        runner_id=row.runner_id, percent_completed=row.percent_completed,
        created_on=aware(row.created_on), started_on=aware(row.started_on),
        updated_on=aware(row.updated_on), finished_on=aware(row.finished_on),
        duration=duration, results=_decoded(row.results), error_code=row.error_code,
        error_message=row.error_message)


def periodic_info(row: Any) -> PeriodicTaskInfo:
    return PeriodicTaskInfo(
        name=row.name, enabled=row.enabled, handler=row.handler, data=_decoded(row.data),
        timer=row.timer, nextrun=aware(row.nextrun), last_due=aware(row.last_due),
        last_run=aware(row.last_run), last_task_id=row.last_task_id,
        last_status=row.last_status, consecutive_failures=row.consecutive_failures,
        submitted=row.submitted_count, skipped=row.skipped_count, priority=row.priority,
        catch_up=row.catch_up, max_runtime=row.max_runtime, min_spacing=row.min_spacing,
        owner=row.owner, source=row.source, worker=row.worker, marked=aware(row.marked),
        queue=row.queue)


# -- queries ------------------------------------------------------------------------------------

def get_task(store: Any, task_id: int) -> TaskInfo:
    Task = store.Task
    row = Task.get_or_none(Task.id == task_id)
    if row is None:
        raise TaskNotFound("no task with id %s" % task_id)
    return task_info(row)


def runs_of(store: Any, task_id: int) -> List[RunInfo]:
    """Every run of a task, oldest first; TaskNotFound for an unknown id."""
    Run = store.Run
    get_task(store, task_id)
    return [run_info(r) for r in Run.select().where(Run.task_id == task_id).order_by(Run.id)]


def list_tasks(store: Any, status: Optional[str] = None, limit: int = 100) -> List[TaskInfo]:
    """Most recent first. `status`: a run status, or ``given-up``."""
    Task = store.Task
    if status is not None and status not in TASK_FILTERS:
        raise InputError("unknown task status %r: expected one of %s"
                         % (status, ", ".join(TASK_FILTERS)))
    query = Task.select().order_by(Task.id.desc()).limit(limit)
    if status == "given-up":
        query = query.where(Task.last_status.in_(FAILED) & Task.next_run_on.is_null()
                            & (Task.runs_failed >= Task.max_retries))
    elif status is not None:
        query = query.where(Task.last_status == status)
    return [task_info(row) for row in query]


def task_counts(store: Any) -> Dict[str, int]:
    """Tasks by their status."""
    Task = store.Task
    return {s: c for s, c in Task.select(Task.last_status, pw.fn.COUNT(Task.id).alias("n"))
            .group_by(Task.last_status).tuples()}


def running_runners(store: Any) -> List[RunnerInfo]:
    """Every runner and overseer registered ``running``, with its current run."""
    Runner, Run = store.Runner, store.Run
    rows = list(Runner.select().where(Runner.status == RUNNING).order_by(Runner.id))
    current = {r.runner_id: r for r in Run.select().where(run_status_is(Run, RUNNING))}
    result = []
    for r in rows:
        run = current.get(r.id)
        result.append(RunnerInfo(
            id=r.id, kind=r.kind, host=r.host, pid=r.pid, state=r.status, slot=r.slot,
            parent_id=r.parent_id, run_id=run.id if run else None,
            task_id=run.task_id if run else None,
            progress=run.percent_completed if run else None,
            rss_mb=round(r.rss / 1048576, 1) if r.rss else None, runs_done=r.runs_done,
            started_on=aware(r.started_on), heartbeat_on=aware(r.heartbeat_on)))
    return result


def queue_stats(store: Any, now: Optional[datetime] = None) -> List[QueueInfo]:
    """Every queue used or configured: paused, limit, runs scheduled and running, runners
    serving it, lag. Live runs are read from the partial indexes, never the history."""
    Run, Queue, RunnerQueue = store.Run, store.Queue, store.RunnerQueue
    now = now or datetime.now(timezone.utc).replace(tzinfo=None)
    waiting = {q: (n, oldest) for q, n, oldest in Run.select(
        Run.queue, pw.fn.COUNT(Run.id), pw.fn.MIN(Run.scheduled_on)).where(
        run_status_is(Run, SCHEDULED)).group_by(Run.queue).tuples()}
    running = dict(Run.select(Run.queue, pw.fn.COUNT(Run.id)).where(
        run_status_is(Run, RUNNING)).group_by(Run.queue).tuples())
    runners = dict(RunnerQueue.select(RunnerQueue.queue, pw.fn.COUNT(RunnerQueue.id))
                   .group_by(RunnerQueue.queue).tuples())
    paused = dict(Queue.select(Queue.name, Queue.paused).tuples())
    configured = store.config.queues
    result = []
    for name in sorted(set(paused) | set(configured) | set(waiting) | set(running)):
        count, oldest = waiting.get(name, (0, None))
        if isinstance(oldest, str):      # SQLite returns MIN() of a datetime as text
            oldest = datetime.fromisoformat(oldest)
        result.append(QueueInfo(
            name=name, paused=bool(paused.get(name, False)),
            limit=configured[name].limit if name in configured else None,
            scheduled=count, running=running.get(name, 0), runners=runners.get(name, 0),
            lag=round(max(0.0, (now - oldest).total_seconds()), 3) if oldest else None))
    return result


def health(store: Any) -> Dict[str, int]:
    """The figures of ``taskrunner check``: runners running, runs waiting, tasks retrying."""
    Runner, Run, Task = store.Runner, store.Run, store.Task
    return {
        "runners_running": Runner.select().where(Runner.status == RUNNING).count(),
        "runs_waiting": Run.select().where(run_status_is(Run, SCHEDULED)).count(),
        "tasks_retrying": Task.select().where(
            Task.last_status.in_(FAILED) & Task.finished_on.is_null()).count(),
    }


def list_periodic(store: Any, owner: Optional[str] = None) -> List[PeriodicTaskInfo]:
    PeriodicTask = store.PeriodicTask
    query = PeriodicTask.select().order_by(PeriodicTask.name)
    if owner is not None:
        query = query.where(PeriodicTask.owner == owner)
    return [periodic_info(row) for row in query]
