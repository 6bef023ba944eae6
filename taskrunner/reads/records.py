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
from typing import Any, Dict, List, Optional, Tuple

import peewee as pw

from ..errors import InputError, TaskNotFound, check_text
from ..store.models import (CANCELLED, CRASHED, ERROR, FAILED, LARGEST_ID, RUNNING,
                            SCHEDULED, STOPPING_PREFIX, SUCCESS, TIMEOUT, WAITING, run_status_is,
                            state_word, utcnow)
from ..runs import flow, queues
from ..runs.sql import claim_order_of
from . import data_search
from .blockers import blocked_by

# A task's status, the one word every face shows for it (API, CLI table and --json, the
# dashboard, the metrics): its latest run's status (``waiting`` too while it waits for its
# parents, with no run yet), a failure shown as retrying (a run will come) or given-up
# (failed max_retries times in a row, or by an error not to retry). docs/index.md, "Words".
TASK_STATES = (SCHEDULED, RUNNING, WAITING, "retrying", "given-up", SUCCESS, CANCELLED)
# The words a task list is filtered by, everywhere: every status, and three views of
# failure by the failed run's status (error, timeout) or both (failed).
TASK_STATUSES = TASK_STATES + (ERROR, TIMEOUT, "failed")
STOPPING = "stopping"       # the state of a running runner that is winding down its run
MAX_LIMIT = 10000   # tasks in one listing


def aware(value: Optional[datetime]) -> Optional[datetime]:
    """A stored naive UTC datetime as an aware one."""
    return value.replace(tzinfo=timezone.utc) if value is not None else None


def _decoded(text: Optional[str]) -> Any:
    return json.loads(text) if text else None


def _json_ready(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_ready(item) for item in value]
    return value


class Record:
    """What every record can do: turn into JSON-ready data (ISO 8601 datetimes)."""

    def to_json(self) -> Dict[str, Any]:
        return {key: _json_ready(value)
                for key, value in dataclasses.asdict(self).items()}  # type: ignore[call-overload]


_Record = Record


@dataclass(frozen=True)
class TaskInfo(_Record):
    """A task: its definition, where it stands, and its last error."""
    id: int
    handler: str
    data: Any
    # One of TASK_STATES: `waiting` while it sleeps, waits for an event, or waits for its
    # parents (no run yet: `waiting_parents`); a failure is `retrying` or `given-up`.
    status: str
    given_up: bool              # failed max_retries times in a row, or by an error not to
                                # retry (TaskError retry=False): no further run
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
    subject: Optional[str]      # carried from its periodic task
    group: Optional[str]
    queue: str
    results: Any = None                # of its latest run that has results (live or final)
    last_traceback: Optional[str] = None   # of its latest run that failed with one
    crash_count: int = 0        # runs ended by a dead runner, in all
    runs_crashed: int = 0       # of those, in a row up to now: the crash backoff
    # Durable execution: the last run.checkpoint() value and when it was stored; while the
    # task is ``waiting``, the event it waits for and until when (its next_run_on).
    checkpoint: Any = None
    checkpoint_on: Optional[datetime] = None
    waiting_for: Optional[str] = None
    waiting_until: Optional[datetime] = None
    # Its steps (`get_task` only; None in listings).
    steps: Optional[List["StepInfo"]] = None
    workflow_id: Optional[int] = None     # the workflow it was added in (graph.py)
    # The tasks it runs after that have not succeeded yet, while it waits for them (no run).
    waiting_parents: Optional[int] = None
    # The status of its latest run as stored (a failure: ``error`` or ``timeout``).
    last_run_status: Optional[str] = None
    # Why it is not running while it has not ended (blockers.py: dicts of reason, text and
    # the facts named); None once it runs or has ended.
    blocked_by: Optional[List[Dict[str, Any]]] = None
    # Its re-runs from a step, oldest first (`get_task` only; None in listings).
    reruns: Optional[List["RerunInfo"]] = None
    # The debounce key it was added with (runs/debounce.py) and how many enqueues of it landed
    # in this task; None for a task added without a debounce.
    debounce_key: Optional[str] = None
    debounce_enqueues: Optional[int] = None
    # The version of the code it started under, recorded with its first durable record
    # (runs/durable.py); None for a task that recorded none.
    code_version: Optional[str] = None


@dataclass(frozen=True)
class StepInfo(_Record):
    """A step a task recorded: ``step`` (run.step, run.transaction_step), ``sleep``,
    ``event`` (consumed by run.wait_for, or its timeout), ``deadline`` (of a wait),
    ``patch`` (run.patched's answer)."""
    name: str
    kind: str
    # done; a sleep or a deadline still to come: waiting; an event that timed out: timeout
    status: str
    run_id: Optional[int]
    attempt: Optional[int]
    started_on: Optional[datetime]
    finished_on: datetime
    duration: Optional[float]          # seconds the step took (its function, its record)
    result: Any


@dataclass(frozen=True)
class TaskOutcome(_Record):
    """A task that reached a final state (`TaskQueue.wait`): ``success``, ``given-up``
    (failed max_retries times in a row, or by an error not to retry) or ``cancelled``,
    with its results, or its last error and traceback."""
    task_id: int
    status: str
    results: Any
    error_code: Optional[str]
    error_message: Optional[str]
    traceback: Optional[str]
    finished_on: datetime

    @property
    def ok(self) -> bool:
        return self.status == SUCCESS


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
    traceback: Optional[str]
    cancel_requested_on: Optional[datetime] = None    # cancelled while running: stopping
    # Being stopped (TimescaleDB's TERMINATING: cancelled, or timed out and its handler not
    # returned yet): why, and since when; None otherwise.
    stopping_reason: Optional[str] = None
    stopping_since: Optional[datetime] = None
    steps: List[StepInfo] = dataclasses.field(default_factory=list)   # recorded by this run


@dataclass(frozen=True)
class RerunInfo(_Record):
    """An operator's re-run of the task from one of its steps (``taskrunner rerun``)."""
    from_step: str
    steps_dropped: int                 # that step and those recorded after it
    requested_by: Optional[str]
    reason: Optional[str]
    requested_on: datetime
    run_id: Optional[int]              # the run it created


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
    # Runs it holds ``running``: 1 while it executes one; with [runner] batch > 1 also the
    # runs claimed with it and not started yet, and successes not written yet (batches.py).
    claimed: int = 0
    # Winding down its run (TimescaleDB's TERMINATING): why, and since when; None otherwise.
    stopping_reason: Optional[str] = None
    stopping_since: Optional[datetime] = None
    # The version of the handler code it runs (runner/versions.py); None for an overseer.
    code_version: Optional[str] = None


@dataclass(frozen=True)
class RunStats(_Record):
    """The runs of one handler or of one periodic task's tasks: how many ended how, when,
    and how long the last STATS_WINDOW of them took. Crashes (the runner process died) are
    counted apart from errors and timeouts."""
    runs: int                          # started runs, whatever became of them
    successes: int
    errors: int                        # error or timeout, crashes not included
    crashes: int
    last_start: Optional[datetime]
    last_finish: Optional[datetime]
    last_success: Optional[datetime]
    avg_duration: Optional[float]      # seconds, of the last STATS_WINDOW finished runs
    p95_duration: Optional[float]


@dataclass(frozen=True)
class QueueInfo(_Record):
    """A queue: paused or not, its host limit, what waits in it and for how long."""
    name: str
    paused: bool
    # Runners serving it at once on one host: the limit in force; None: served by the
    # default runners. limit_source: "stored" (``queue limit``, on every host) or "config"
    # ([queues.NAME] limit); None with no limit.
    limit: Optional[int]
    # Its tasks by status, as ``tasks --status S --queue NAME`` counts them (TASK_STATES but
    # success: that count reads the whole history); `scheduled` and `running` of those.
    scheduled: int
    running: int
    runners: int                # runners serving it now, on every host
    # Seconds the oldest waiting run has been due; None: none waits, or the queue is paused
    # (a queue paused on purpose is not late: its pause is `paused_for`).
    lag: Optional[float]
    paused_for: Optional[float] = None   # seconds since it was paused; None: not paused
    # Flow control (runs/flow.py): the queue's rate limit as written and its bucket's
    # tokens now (None: no rate); runs held back by an empty bucket (the queue's, or their
    # key's); fair_by and how many tenants have a run waiting; the aging interval.
    rate: Optional[str] = None
    allowance: Optional[float] = None
    throttled: int = 0
    fair_by: Optional[str] = None
    tenants_waiting: Optional[int] = None
    aging: Optional[float] = None
    tasks: Dict[str, int] = dataclasses.field(default_factory=dict)
    due: int = 0                # runs waiting to be claimed (of its scheduled tasks)
    limit_source: Optional[str] = None


@dataclass(frozen=True)
class PeriodicTaskInfo(_Record):
    """A timer that submits tasks, with its counters (lifetime: submitted, skipped, dropped
    and the *_count fields)."""
    name: str
    enabled: bool
    handler: str
    data: Any
    timer: str
    # The zone `timer` is evaluated in when it names none (fixed when it was defined).
    timezone: Optional[str]
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
    subject: Optional[str]
    group: Optional[str]
    timebox: Optional[str]
    tolerance: Optional[float]
    dropped: int
    queue: str
    anchor: str
    # Over the runs task_runs still holds (rotation deletes old ones): the last times and
    # durations; the lifetime counts are the *_count fields.
    stats: Optional[RunStats] = None
    crash_count: int = 0            # runs of its tasks ended by a dead runner, in all
    consecutive_crashes: int = 0    # of those, in a row up to now
    # Lifetime: runs of its tasks that ended success, error or timeout; successes; errors
    # and timeouts that were not crashes.
    run_count: int = 0
    success_count: int = 0
    error_count: int = 0
    resume: bool = False            # its next task starts from an unsuccessful one's checkpoint
    max_retries: Optional[int] = None   # of its tasks; None: [task] max_retries
    # Seconds each instance's due time (nextrun) is spread after its calendar time (Temporal's
    # jitter); None: none, and nextrun is the calendar time.
    jitter: Optional[float] = None


def task_info(row: Any, results: Any = None, last_traceback: Optional[str] = None,
              steps: Optional[List[StepInfo]] = None,
              blockers: Optional[List[Dict[str, Any]]] = None, running: bool = False
              ) -> TaskInfo:
    """The record of the task `row`; `running`: a run of it is running (`running_of`)."""
    # A task that succeeded has no current error: the error columns (and the traceback) of
    # an earlier failed attempt stay with that run, in `runs_of`, not on the task.
    current = row.last_status != SUCCESS
    return TaskInfo(
        id=row.id, handler=row.handler, data=_decoded(row.data),
        status=state_word(row.last_status, row.finished_on, running),
        given_up=row.given_up, priority=row.priority, queued_on=aware(row.queued_on),
        queued_by=row.queued_by, scheduled_on=aware(row.scheduled_on),
        next_run_on=aware(row.next_run_on), finished_on=aware(row.finished_on),
        runs=row.run_count, runs_failed=row.runs_failed, max_retries=row.max_retries,
        run_timeout=row.run_timeout, max_runtime=row.max_runtime, unique_key=row.unique_key,
        periodic_task_id=row.periodic_task_id,
        last_error_code=row.last_error_code if current else None,
        last_error_message=row.last_error_message if current else None, subject=row.subject,
        group=row.group_name, queue=row.queue, results=results,
        last_traceback=last_traceback if current else None,
        crash_count=row.crash_count, runs_crashed=row.runs_crashed,
        checkpoint=_decoded(row.checkpoint), checkpoint_on=aware(row.checkpoint_on),
        waiting_for=row.waiting_for if row.last_status == WAITING else None,
        waiting_until=aware(row.next_run_on) if row.last_status == WAITING else None,
        steps=steps, workflow_id=row.workflow_id,
        waiting_parents=row.waiting_parents if row.finished_on is None else None,
        last_run_status=RUNNING if running else row.last_status, blocked_by=blockers,
        debounce_key=row.debounce_key, debounce_enqueues=row.debounce_count,
        code_version=row.code_version)


def parents_text(count: int) -> str:
    """What a task waiting for its parents waits for, as the CLI and the dashboard say it."""
    return "%d parent%s" % (count, "" if count == 1 else "s")


def step_info(row: Any, now: datetime) -> StepInfo:
    result = _decoded(row.result)
    status = "done"
    if row.kind in ("sleep", "deadline") and isinstance(result, dict) and "until" in result:
        if datetime.fromisoformat(result["until"]).replace(tzinfo=None) > now:
            status = WAITING
    elif row.kind == "event" and isinstance(result, dict) and result.get("timeout"):
        status = TIMEOUT
    duration = (row.finished_on - row.started_on).total_seconds() \
        if row.started_on is not None else None
    return StepInfo(name=row.name, kind=row.kind, status=status, run_id=row.run_id,
                    attempt=row.attempt, started_on=aware(row.started_on),
                    finished_on=aware(row.finished_on), duration=duration, result=result)


def steps_of(store: Any, task_id: int, known: bool = False) -> List[StepInfo]:
    """The steps of a task in the order they were recorded (`known`: the task exists);
    TaskNotFound for an unknown id."""
    Step = store.Step
    if not known:
        get_task(store, task_id)
    now = store.database_time(utcnow())
    return [step_info(row, now) for row in Step.select().where(
        Step.task_id == task_id).order_by(Step.id)]


def run_info(row: Any, stopping: Any = (None, None),
             steps: Optional[List[StepInfo]] = None) -> RunInfo:
    duration = (row.finished_on - row.started_on).total_seconds() \
        if row.finished_on and row.started_on else None
    return RunInfo(
        id=row.id, task_id=row.task_id, attempt=row.attempt, status=row.status,
        runner_id=row.runner_id, percent_completed=row.percent_completed,
        created_on=aware(row.created_on), started_on=aware(row.started_on),
        updated_on=aware(row.updated_on), finished_on=aware(row.finished_on),
        duration=duration, results=_decoded(row.results), error_code=row.error_code,
        error_message=row.error_message, traceback=row.traceback,
        cancel_requested_on=aware(row.cancel_requested_on), stopping_reason=stopping[0],
        stopping_since=stopping[1], steps=steps or [])


def periodic_info(row: Any, stats: Optional[RunStats] = None) -> PeriodicTaskInfo:
    return PeriodicTaskInfo(
        name=row.name, enabled=row.enabled, handler=row.handler, data=_decoded(row.data),
        timer=row.timer, timezone=row.timezone, nextrun=aware(row.nextrun),
        last_due=aware(row.last_due),
        last_run=aware(row.last_run), last_task_id=row.last_task_id,
        last_status=row.last_status, consecutive_failures=row.consecutive_failures,
        submitted=row.submitted_count, skipped=row.skipped_count, priority=row.priority,
        catch_up=row.catch_up, max_runtime=row.max_runtime, min_spacing=row.min_spacing,
        owner=row.owner, source=row.source, worker=row.worker, marked=aware(row.marked),
        subject=row.subject, group=row.group_name, timebox=row.timebox, tolerance=row.tolerance,
        dropped=row.dropped_count, queue=row.queue, anchor=row.anchor, stats=stats,
        crash_count=row.crash_count, consecutive_crashes=row.consecutive_crashes,
        run_count=row.run_count, success_count=row.success_count, error_count=row.error_count,
        resume=bool(row.resume), max_retries=row.max_retries, jitter=row.jitter)


# -- queries ------------------------------------------------------------------------------------

def _latest(store: Any, ids: List[int], column: Any) -> Dict[int, Any]:
    """task id -> `column` of its latest run where that column is set."""
    Run = store.Run
    if not ids:
        return {}
    latest = (Run.select(pw.fn.MAX(Run.id)).where(Run.task_id.in_(ids) & column.is_null(False))
              .group_by(Run.task_id))
    return dict(Run.select(Run.task_id, column).where(Run.id.in_(latest)).tuples())


def _task_infos(store: Any, rows: List[Any], why: bool = True) -> List[TaskInfo]:
    """Tasks with their latest results and traceback (two queries for any number), and
    (`why`) what holds back those not running (blockers.py: a few more, for any number)."""
    ids = [row.id for row in rows]
    results = _latest(store, ids, store.Run.results)
    tracebacks = _latest(store, ids, store.Run.traceback)
    blockers = blocked_by(store, rows) if why else {}
    running = running_of(store, [row.id for row in rows if row.last_status == SCHEDULED])
    return [task_info(row, _decoded(results.get(row.id)), tracebacks.get(row.id),
                      blockers=blockers.get(row.id), running=row.id in running)
            for row in rows]


def counted_word(status: str, finished_on: Any) -> str:
    """`state_word` of tasks counted by their ``last_status``, the running ones being counted
    off their runs (`running_runs`): a row a runner of an earlier version marked ``running``
    counts as ``scheduled``, as a row a claim leaves now."""
    return state_word(SCHEDULED if status == RUNNING else status, finished_on)


def running_runs(store: Any) -> Any:
    """The task ids of the runs ``running`` (off the partial index of running runs: at most
    one per runner, however long the history). A claim writes the run alone, so a running
    task is one with a running run; its own row says ``scheduled`` (DESIGN: the task row
    changes only when its visible state must)."""
    Run = store.Run
    return Run.select(Run.task_id).where(run_status_is(Run, RUNNING))


def running_of(store: Any, ids: List[int]) -> set:
    """Those of the task ids `ids` that have a run running."""
    Run, found = store.Run, set()
    for start in range(0, len(ids), 500):      # within every database's bound parameters
        found.update(task_id for task_id, in Run.select(Run.active_task_id).where(
            Run.active_task_id.in_(ids[start:start + 500])
            & run_status_is(Run, RUNNING)).tuples())
    return found


def get_task(store: Any, task_id: int, with_steps: bool = False) -> TaskInfo:
    """The task (`with_steps`: and its steps); TaskNotFound for an unknown id."""
    Task = store.Task
    # An id no id column can hold names no task (the driver would raise OverflowError).
    row = Task.get_or_none(Task.id == task_id) if 0 < task_id <= LARGEST_ID else None
    if row is None:
        raise TaskNotFound("no task with id %s" % task_id)
    task = _task_infos(store, [row])[0]
    if with_steps:
        task = dataclasses.replace(task, steps=steps_of(store, task_id, known=True),
                                   reruns=reruns_of(store, task_id))
    return task


def status_of(store: Any, task_id: int) -> str:
    """The task's status word (`state_word`) from its row and its live run's, in one read;
    TaskNotFound for an unknown id."""
    Task, Run = store.Task, store.Run
    row = Task.select(Task.last_status, Task.finished_on, Run.status).join(
        Run, pw.JOIN.LEFT_OUTER, on=(Run.active_task_id == Task.id)).where(
        Task.id == task_id).tuples().first() if 0 < task_id <= LARGEST_ID else None
    if row is None:
        raise TaskNotFound("no task with id %s" % task_id)
    return state_word(row[0], row[1], row[2] == RUNNING)


def reruns_of(store: Any, task_id: int) -> List[RerunInfo]:
    """The re-runs of a task from a step, oldest first."""
    Rerun = store.Rerun
    return [RerunInfo(from_step=r.from_step, steps_dropped=r.steps_dropped,
                      requested_by=r.requested_by, reason=r.reason,
                      requested_on=aware(r.requested_on), run_id=r.run_id)
            for r in Rerun.select().where(Rerun.task_id == task_id).order_by(Rerun.id)]


def task_outcome(store: Any, task_id: int) -> Optional[TaskOutcome]:
    """The task's outcome once it is final (success, given up, cancelled), else None;
    TaskNotFound for an unknown id."""
    return _outcome(get_task(store, task_id))


def task_outcomes(store: Any, task_ids: List[int]) -> Dict[int, Optional[TaskOutcome]]:
    """`task_outcome` of many tasks in one query: {id: its outcome, or None while it is not
    final}; an unknown id is left out."""
    Task = store.Task
    known = {row.id: row.finished_on for row in Task.select(Task.id, Task.finished_on).where(
        Task.id.in_(list(task_ids)))} if task_ids else {}
    # Only the tasks that ended are read whole: most of a waiter's reads find none.
    ended = [task_id for task_id, finished_on in known.items() if finished_on is not None]
    rows = list(Task.select().where(Task.id.in_(ended))) if ended else []
    outcomes: Dict[int, Optional[TaskOutcome]] = dict.fromkeys(known)
    outcomes.update((task.id, _outcome(task)) for task in _task_infos(store, rows, why=False))
    return outcomes


def _outcome(task: TaskInfo) -> Optional[TaskOutcome]:
    if task.finished_on is None:
        return None
    failed = task.status != SUCCESS
    return TaskOutcome(
        task_id=task.id, status=task.status, results=task.results,
        error_code=task.last_error_code if failed else None,
        error_message=task.last_error_message if failed else None,
        traceback=task.last_traceback if failed else None, finished_on=task.finished_on)


def runs_of(store: Any, task_id: int) -> List[RunInfo]:
    """Every run of a task, oldest first; TaskNotFound for an unknown id."""
    Run = store.Run
    get_task(store, task_id)
    rows = list(Run.select().where(Run.task_id == task_id).order_by(Run.id))
    stopping = _stopped_runs(store, [r.id for r in rows if r.runner_id is not None])
    for r in rows:
        if r.id not in stopping and r.status == RUNNING and r.cancel_requested_on is not None:
            # Cancelled; its runner says so at its next heartbeat.
            stopping[r.id] = ("cancelled by an operator", aware(r.cancel_requested_on))
    steps: Dict[Any, List[StepInfo]] = {}
    for step in steps_of(store, task_id, known=True):
        steps.setdefault(step.run_id, []).append(step)
    return [run_info(r, stopping.get(r.id, (None, None)), steps.get(r.id)) for r in rows]


def _stopped_runs(store: Any, run_ids: List[int]) -> Dict[int, Any]:
    """run id -> (why, since when) of those of `run_ids` that a running runner is winding
    down (its row says so until it has exited or the run has ended)."""
    Runner = store.Runner
    if not run_ids:
        return {}
    return {run_id: (reason[len(STOPPING_PREFIX):], aware(since))
            for run_id, reason, since in Runner.select(
                Runner.stopping_run_id, Runner.exit_reason, Runner.stopping_since).where(
                Runner.stopping_run_id.in_(run_ids) & (Runner.status == RUNNING)
                & Runner.exit_reason.startswith(STOPPING_PREFIX)).tuples()}


def failed_predicate() -> Any:
    """``last_status IN ('error', 'timeout')`` written out, not bound: SQLite and PostgreSQL
    use the partial index of failed tasks (migration 0010) only for a query that names its
    predicate. For queries of task_queue alone (the column is not qualified)."""
    return pw.SQL("last_status IN ('%s')" % "', '".join(FAILED))


def not_succeeded_predicate() -> Any:
    """``last_status <> 'success'`` written out: the predicate of the partial status index
    (migration 0010), named by every query that should read it."""
    return pw.SQL("last_status <> '%s'" % SUCCESS)


def status_condition(store: Any, status: str) -> Any:
    """The tasks a word of `TASK_STATUSES` names; InputError for another word."""
    Task = store.Task
    if status not in TASK_STATUSES:
        raise InputError("unknown task status %r: expected one of %s"
                         % (status, ", ".join(TASK_STATUSES)))
    if status == "retrying":
        return failed_predicate() & Task.finished_on.is_null()
    if status == "given-up":
        return failed_predicate() & Task.finished_on.is_null(False)
    if status == "failed":
        return failed_predicate()
    if status == SUCCESS:
        return Task.last_status == SUCCESS
    if status == RUNNING:
        return Task.id.in_(running_runs(store))
    if status == SCHEDULED:
        return (not_succeeded_predicate() & (Task.last_status == SCHEDULED)
                & Task.id.not_in(running_runs(store)))
    return not_succeeded_predicate() & (Task.last_status == status)


def tasks_query(store: Any, status: Optional[str] = None, handler: Optional[str] = None,
                since: Optional[datetime] = None, until: Optional[datetime] = None,
                periodic: Optional[str] = None, queue: Optional[str] = None,
                error_code: Optional[str] = None, data: Optional[Tuple[str, str]] = None,
                code_version: Optional[str] = None) -> Any:
    """Tasks matching every filter given: `status` a word of `TASK_STATUSES`, `handler`
    its dotted path, `since` / `until` (aware) bounds of its queued_on, `periodic` the name
    of the periodic task that submitted it, `queue` its queue, `error_code` the code of its
    last error, `data` a ``(key, value)`` of its data (data_search.parse; a key without an
    index is searched in the data_search.WINDOW most recent tasks only), `code_version` the
    version it started under. InputError for an unknown status or name."""
    Task, PeriodicTask = store.Task, store.PeriodicTask
    query = Task.select()
    if status is not None:
        query = query.where(status_condition(store, status))
    if check_text("handler", handler) is not None:
        query = query.where(Task.handler == handler)
    for bound, compare in ((since, Task.queued_on.__ge__), (until, Task.queued_on.__lt__)):
        if bound is not None:
            if bound.tzinfo is None:
                raise InputError("task filters take aware datetimes")
            query = query.where(compare(bound.astimezone(timezone.utc).replace(tzinfo=None)))
    if check_text("periodic", periodic) is not None:
        row = PeriodicTask.get_or_none(PeriodicTask.name == periodic)
        if row is None:
            raise InputError("no periodic task named %r" % periodic)
        query = query.where(Task.periodic_task_id == row.id)
    if check_text("queue", queue) is not None:
        query = query.where(Task.queue == queue)
    if check_text("error_code", error_code) is not None:
        query = query.where(Task.last_error_code == error_code)
    if data is not None:
        by_index = data_search.indexed(store, data[0])
        query = query.where(data_search.condition(store, *data, by_index=by_index))
        if not by_index:
            query = query.where(Task.id > data_search.newest_id(store) - data_search.WINDOW)
    if check_text("code_version", code_version) is not None:
        query = query.where(Task.code_version == code_version)
    return query


def list_tasks(store: Any, status: Optional[str] = None, limit: Optional[int] = 100,
               offset: int = 0, **filters: Any) -> List[TaskInfo]:
    """Most recent first, `offset` skipped, at most `limit` (None: all); the filters are
    those of `tasks_query`."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_LIMIT):
        raise InputError("limit must be a whole number from 1 to %d, not %r" % (MAX_LIMIT, limit))
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InputError("offset must be a whole number of at least 0, not %r" % (offset,))
    query = tasks_query(store, status=status, **filters).order_by(store.Task.id.desc())
    if limit is not None or offset:
        query = query.limit(limit).offset(offset)
    return _task_infos(store, list(query))


def count_tasks(store: Any, status: Optional[str] = None, **filters: Any) -> int:
    """How many tasks match the filters of `tasks_query`."""
    return int(tasks_query(store, status=status, **filters).count())


def task_ids(store: Any, status: Optional[str] = None, **filters: Any) -> List[int]:
    """The ids of the tasks matching the filters, oldest first (for the bulk verbs)."""
    Task = store.Task
    query = tasks_query(store, status=status, **filters).select(Task.id).order_by(Task.id)
    return [row.id for row in query]


def existing_task_ids(store: Any, ids: List[int]) -> List[int]:
    """Those of `ids` that name a task (the others never existed, or rotation deleted them)."""
    Task = store.Task
    found: set = set()
    for start in range(0, len(ids), 500):      # within every database's bound parameters
        found.update(row.id for row in Task.select(Task.id).where(
            Task.id.in_(ids[start:start + 500])))
    return [i for i in ids if i in found]


def running_runners(store: Any) -> List[RunnerInfo]:
    """Every runner and overseer registered ``running``, with its current run: of the runs
    it holds (several with a batch), the first in the claim order."""
    Runner, Run = store.Runner, store.Run
    rows = list(Runner.select().where(Runner.status == RUNNING).order_by(Runner.id))
    current, held = {}, {}
    for run in Run.select().where(run_status_is(Run, RUNNING)).order_by(
            *claim_order_of(Run)):
        current.setdefault(run.runner_id, run)
        held[run.runner_id] = held.get(run.runner_id, 0) + 1
    stopped = [r.stopping_run_id for r in rows if r.id not in current and r.stopping_run_id
               and r.exit_reason and r.exit_reason.startswith(STOPPING_PREFIX)]
    if stopped:       # its run ended (timed out) while its handler runs on: that run
        for run in Run.select(Run.id, Run.task_id, Run.percent_completed).where(
                Run.id.in_(stopped)):
            current[next(r.id for r in rows if r.stopping_run_id == run.id)] = run
    result = []
    for r in rows:
        run = current.get(r.id)
        # A runner winding down its run (told to stop, its run cancelled or taken away) said
        # so, or whoever took its run away said it for it (lifecycle.timeout_overdue_runs).
        stopping = r.exit_reason[len(STOPPING_PREFIX):] \
            if r.exit_reason and r.exit_reason.startswith(STOPPING_PREFIX) else None
        state = STOPPING if stopping is not None else r.status
        result.append(RunnerInfo(
            id=r.id, kind=r.kind, host=r.host, pid=r.pid, state=state, slot=r.slot,
            parent_id=r.parent_id, run_id=run.id if run else None,
            task_id=run.task_id if run else None,
            progress=run.percent_completed if run else None,
            rss_mb=round(r.rss / 1048576, 1) if r.rss else None, runs_done=r.runs_done,
            started_on=aware(r.started_on), heartbeat_on=aware(r.heartbeat_on),
            claimed=held.get(r.id, 0), stopping_reason=stopping,
            stopping_since=aware(r.stopping_since) if stopping is not None else None,
            code_version=r.code_version))
    return result


def queue_stats(store: Any, now: Optional[datetime] = None) -> List[QueueInfo]:
    """Every queue used or configured (or named by a task that has not succeeded): paused,
    limit, its tasks by status (as the task filters count them), runs due, runners serving
    it, lag. Read from the partial indexes, never the history."""
    Run, Queue, RunnerQueue = store.Run, store.Queue, store.RunnerQueue
    now = now or datetime.now(timezone.utc).replace(tzinfo=None)
    waiting = {q: (n, oldest) for q, n, oldest in Run.select(
        Run.queue, pw.fn.COUNT(Run.id), pw.fn.MIN(Run.scheduled_on)).where(
        run_status_is(Run, SCHEDULED)).group_by(Run.queue).tuples()}
    tasks = queue_task_counts(store)
    runners = dict(RunnerQueue.select(RunnerQueue.queue, pw.fn.COUNT(RunnerQueue.id))
                   .group_by(RunnerQueue.queue).tuples())
    paused, stored = {}, {}
    for name, flag, since, host_limit in Queue.select(
            Queue.name, Queue.paused, Queue.paused_on, Queue.host_limit).tuples():
        paused[name] = (bool(flag), since)
        if host_limit is not None and name in store.config.queues:
            stored[name] = host_limit
    configured = store.config.queues
    buckets = flow.buckets(store, now)
    by_queue = {b["name"]: b for b in buckets if b["kind"] == flow.QUEUE}
    held = flow.held_by_keys(store, [b["name"] for b in buckets
                                     if b["kind"] == flow.KEY and b["throttled"]])
    result = []
    for name in sorted(set(paused) | set(configured) | set(waiting) | set(tasks)):
        count, oldest = waiting.get(name, (0, None))
        if isinstance(oldest, str):      # SQLite returns MIN() of a datetime as text
            oldest = datetime.fromisoformat(oldest)
        is_paused, since = paused.get(name, (False, None))
        counts = tasks.get(name, dict.fromkeys(OPEN_STATES, 0))
        result.append(QueueInfo(
            name=name, paused=is_paused,
            limit=queues.limit_in_force(configured.get(name), stored.get(name)),
            limit_source="stored" if name in stored else "config" if name in configured
            else None,
            scheduled=counts[SCHEDULED], running=counts[RUNNING], tasks=counts, due=count,
            runners=runners.get(name, 0),
            lag=_seconds_since(oldest, now) if oldest and not is_paused else None,
            paused_for=_seconds_since(since or now, now) if is_paused else None,
            **_flow_of(store, name, configured.get(name), by_queue.get(name), held)))
    return result


# The states a queue's tasks are counted by: every one but success (see QueueInfo.tasks).
OPEN_STATES = tuple(s for s in TASK_STATES if s != SUCCESS)


def queue_task_counts(store: Any) -> Dict[str, Dict[str, int]]:
    """{queue: {state: tasks}} over OPEN_STATES, by the conditions of `status_condition`
    (one query, on the partial index of the tasks that have not succeeded)."""
    Task = store.Task
    ended = Task.finished_on.is_null(False)
    counts: Dict[str, Dict[str, int]] = {}
    for queue, status, final, n in (Task.select(Task.queue, Task.last_status, ended,
                                                pw.fn.COUNT(pw.SQL("*")))
                                    .where(not_succeeded_predicate())
                                    .group_by(Task.queue, Task.last_status, ended).tuples()):
        word = counted_word(status, final)
        by_state = counts.setdefault(queue, dict.fromkeys(OPEN_STATES, 0))
        if word in by_state:
            by_state[word] += n
    # Running: the running runs, counted off their partial index; their tasks' rows say
    # scheduled (`running_runs`).
    Run = store.Run
    for queue, n in Run.select(Run.queue, pw.fn.COUNT(pw.SQL("*"))).where(
            run_status_is(Run, RUNNING)).group_by(Run.queue).tuples():
        by_state = counts.setdefault(queue, dict.fromkeys(OPEN_STATES, 0))
        by_state[RUNNING] += n
        by_state[SCHEDULED] -= n
    return counts


def _flow_of(store: Any, name: str, configured: Any, bucket: Any,
             held: Dict[str, int]) -> Dict[str, Any]:
    """QueueInfo's flow-control fields of the queue `name`."""
    fair = configured is not None and configured.fair_by or None
    return {"rate": bucket["limit"] if bucket else None,
            "allowance": bucket["allowance"] if bucket else None,
            "throttled": bucket["throttled"] if bucket and bucket["throttled"]
            else held.get(name, 0),
            "fair_by": fair,
            "tenants_waiting": flow.tenants_waiting(store, name) if fair else None,
            "aging": configured.aging or None if configured is not None else None}


def rate_limits(store: Any, now: Optional[datetime] = None) -> Dict[str, Any]:
    """The key limits in force and every bucket (queue and key: limit, allowance now, runs
    throttled): ``taskrunner rate list``, ``status``, the dashboard and /metrics."""
    return {"limits": flow.limits(store), "buckets": flow.buckets(store, now)}


def _seconds_since(then: datetime, now: datetime) -> float:
    return round(max(0.0, (now - then).total_seconds()), 3)


def health(store: Any) -> Dict[str, int]:
    """The figures of ``taskrunner check`` and ``status``: runners running, runs waiting,
    failed tasks waiting to retry and failed tasks given up."""
    Runner, Run, Task = store.Runner, store.Run, store.Task
    return {
        "runners_running": Runner.select().where(Runner.status == RUNNING).count(),
        "runs_waiting": Run.select().where(run_status_is(Run, SCHEDULED)).count(),
        "tasks_retrying": Task.select().where(
            Task.last_status.in_(FAILED) & Task.finished_on.is_null()).count(),
        "tasks_given_up": Task.select().where(
            Task.last_status.in_(FAILED) & Task.finished_on.is_null(False)).count(),
    }


def list_periodic(store: Any, owner: Optional[str] = None, group: Optional[str] = None,
                  with_stats: bool = True) -> List[PeriodicTaskInfo]:
    """Periodic tasks by name, each with the statistics of its tasks' runs (`with_stats`
    false: without them, stats None, for readers that show no statistics)."""
    PeriodicTask = store.PeriodicTask
    query = PeriodicTask.select().order_by(PeriodicTask.name)
    if check_text("owner", owner) is not None:
        query = query.where(PeriodicTask.owner == owner)
    if group is not None:
        query = query.where(PeriodicTask.group_name == group)
    rows = list(query)
    if not with_stats:
        return [periodic_info(row) for row in rows]
    stats = run_stats(store, by="periodic") if rows else {}
    return [periodic_info(row, stats.get(row.id, EMPTY_STATS)) for row in rows]


# -- statistics ---------------------------------------------------------------------------------

STATS_WINDOW = 100      # runs per handler / periodic task that the durations are taken from
EMPTY_STATS = RunStats(0, 0, 0, 0, None, None, None, None, None)


def _when(value: Any) -> Optional[datetime]:
    """A datetime read back from an aggregate or a subquery: SQLite returns its text."""
    if value is None or isinstance(value, datetime):
        return aware(value)
    return aware(datetime.fromisoformat(str(value)))


def run_stats(store: Any, by: str = "handler",
              window: int = STATS_WINDOW) -> Dict[Any, RunStats]:
    """Statistics of the runs in task_runs (rotation deletes old ones), keyed by handler
    path (`by` = "handler") or by periodic task id ("periodic"). Two queries: the counts
    and last times as one aggregate, the durations of the last `window` finished runs of
    each key through a window function (SQLite 3.25+, PostgreSQL, MariaDB 10.2+)."""
    Task, Run = store.Task, store.Run
    key = Task.handler if by == "handler" else Task.periodic_task_id
    crashed = Run.error_code == CRASHED
    failed = Run.status.in_(FAILED) & (Run.error_code.is_null() | (Run.error_code != CRASHED))

    def count(condition: Any) -> Any:
        return pw.fn.SUM(pw.Case(None, [(condition, 1)], 0))
    totals = (Run.select(key.alias("key"), pw.fn.COUNT(Run.started_on),
                         count(Run.status == SUCCESS), count(failed), count(crashed),
                         pw.fn.MAX(Run.started_on), pw.fn.MAX(Run.finished_on),
                         pw.fn.MAX(pw.Case(None, [(Run.status == SUCCESS, Run.finished_on)])))
              .join(Task, on=(Run.task_id == Task.id)).where(key.is_null(False))
              .group_by(key).tuples())
    rank = pw.fn.ROW_NUMBER().over(partition_by=[key], order_by=[Run.id.desc()])
    recent = (Run.select(key.alias("key"), Run.started_on.alias("started"),
                         Run.finished_on.alias("finished"), rank.alias("rank"))
              .join(Task, on=(Run.task_id == Task.id))
              .where(key.is_null(False) & Run.status.in_((SUCCESS,) + FAILED)
                     & Run.started_on.is_null(False) & Run.finished_on.is_null(False)
                     & (Run.error_code.is_null() | (Run.error_code != CRASHED))))
    durations: Dict[Any, List[float]] = {}
    for k, started, finished in (Run.select(recent.c.key, recent.c.started, recent.c.finished)
                                 .from_(recent).where(recent.c.rank <= window).tuples()):
        begin, end = _when(started), _when(finished)
        durations.setdefault(k, []).append((end - begin).total_seconds())  # type: ignore
    result = {}
    for k, runs, successes, errors, crashes, start, finish, success in totals:
        taken = sorted(durations.get(k, []))
        result[k] = RunStats(
            runs=int(runs or 0), successes=int(successes or 0), errors=int(errors or 0),
            crashes=int(crashes or 0), last_start=_when(start), last_finish=_when(finish),
            last_success=_when(success),
            avg_duration=round(sum(taken) / len(taken), 6) if taken else None,
            p95_duration=round(taken[max(0, -(-95 * len(taken) // 100) - 1)], 6)
            if taken else None)
    return result
