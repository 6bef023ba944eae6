"""Read queries of the dashboard and the metrics: filtered task lists, counts, runs finished
per minute, queue lag, failures grouped by handler and error code, and the per-handler
figures of the Prometheus collector.

Like `reads`, these functions only read, return plain typed records with aware UTC
datetimes, and are the only SQL behind the web pages and ``/metrics``. Each is written to
stay fast on a history of a million runs (bench/dashboard.py times them): lists are
newest first by id with keyset paging (``before``), and aggregates go through the indexes
of migration 0010.
"""
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import peewee as pw

from ..errors import InputError
from ..store.models import (ERROR, FAILED, RUNNING, SCHEDULED, SUCCESS,
                            as_utc, run_status_is, utcnow)
from . import data_search as searching
from .blockers import blocked_by
from .records import (TASK_STATES, TASK_STATUSES, TaskInfo, aware, counted_word,
                      failed_predicate, not_succeeded_predicate, running_of, status_condition,
                      task_info)

# What the dashboard's status filter offers: the words of every task filter.
STATUS_FILTERS = TASK_STATUSES
# Seconds; the buckets of the run duration histogram, from 1 ms (most handlers of a busy
# queue take a few milliseconds) to an hour.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0, 1800.0, 3600.0)
# The name under which the metrics sum the queues and periodic tasks they do not name (no
# queue can be called so: config.QUEUE_NAME).
OTHER = "(other)"
# Task ids a page of a search by an unindexed data key reads at most (data_search.WINDOW).
DATA_WINDOW = searching.WINDOW


@dataclass(frozen=True)
class TaskFilter:
    """A filtered view of the tasks; every field optional. `since`/`until` bound the time
    the task was queued; `periodic_task_id` selects the tasks a periodic task submitted;
    `error_code` the tasks whose last error has that code; `queue` the tasks of one queue;
    `data` the tasks whose data has that top-level key with that scalar value (as text:
    ``("order_id", "44")`` finds 44 and "44"; see `data_search.condition`)."""
    status: Optional[str] = None
    handler: Optional[str] = None
    since: Optional[datetime] = None
    until: Optional[datetime] = None
    periodic_task_id: Optional[int] = None
    error_code: Optional[str] = None
    queue: Optional[str] = None
    data: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in STATUS_FILTERS:
            raise InputError("unknown task status %r: expected one of %s"
                             % (self.status, ", ".join(STATUS_FILTERS)))
        for value in (self.since, self.until):
            if value is not None and value.tzinfo is None:
                raise InputError("task filter times must be aware datetimes")


@dataclass(frozen=True)
class TaskPage:
    """One page of a task list: `tasks` newest first; `next_before` pages on (None at the end).
    A search by an unindexed data key reads the ids from `searched_from` up only
    (DATA_WINDOW): `next_before` then goes on below them, even when this page has fewer
    tasks than asked for; by an indexed key (`taskrunner index add`), `searched_from` is None."""
    tasks: List[TaskInfo]
    next_before: Optional[int]
    searched_from: Optional[int] = None


@dataclass(frozen=True)
class MinuteCount:
    """Runs that ended in one minute (`minute` is its start)."""
    minute: datetime
    succeeded: int
    failed: int


@dataclass(frozen=True)
class FailureGroup:
    """Failed tasks of one handler and error code: how many are given up or retrying, and
    the latest one's error and traceback (of its latest run that has one)."""
    handler: str
    error_code: Optional[str]
    given_up: int
    retrying: int
    latest_task_id: int
    latest_error_message: Optional[str]
    latest_on: Optional[datetime]
    latest_traceback: Optional[str] = None


@dataclass(frozen=True)
class DurationHistogram:
    """Finished runs of one handler: cumulative counts at `DURATION_BUCKETS`, their total."""
    handler: str
    buckets: Tuple[int, ...]
    count: int
    total_seconds: float


def _task_conditions(store: Any, view: TaskFilter, by_index: bool = False) -> List[Any]:
    Task = store.Task
    conditions = []
    if view.status is not None:
        conditions.append(status_condition(store, view.status))
    if view.handler:
        conditions.append(Task.handler == view.handler)
    if view.since is not None:
        conditions.append(Task.queued_on >= as_utc(view.since))
    if view.until is not None:
        conditions.append(Task.queued_on < as_utc(view.until))
    if view.periodic_task_id is not None:
        conditions.append(Task.periodic_task_id == view.periodic_task_id)
    if view.error_code:
        conditions.append(Task.last_error_code == view.error_code)
    if view.queue:
        conditions.append(Task.queue == view.queue)
    if view.data is not None:
        # Unless `by_index`, no index serves it: it is evaluated on the rows the other
        # conditions leave, newest first. `find_tasks` reads DATA_WINDOW ids a page;
        # `matching_task_ids` (bulk actions) reads until it has its count, every row the
        # other filters leave when fewer match.
        conditions.append(searching.condition(store, *view.data, by_index=by_index))
    return conditions


def find_tasks(store: Any, view: TaskFilter = TaskFilter(), before: Optional[int] = None,
               limit: int = 50) -> TaskPage:
    """Tasks matching `view`, newest first, with ids below `before` (keyset paging: a page
    deep in a long history costs what the first one does)."""
    Task = store.Task
    by_index = view.data is not None and searching.indexed(store, view.data[0])
    query = Task.select().order_by(Task.id.desc()).limit(limit + 1)
    if view.since is not None or view.until is not None:
        # Newest first by the queued time the range bounds (its index, read in order): the
        # same order as by id, but read from the index instead of sorting the range.
        query = query.order_by(Task.queued_on.desc(), Task.id.desc())
    conditions = _task_conditions(store, view, by_index)
    if before is not None:
        conditions.append(Task.id < before)
    floor = None
    if view.data is not None and not by_index:
        # Each page of a data search evaluates the JSON of DATA_WINDOW ids at most, by the
        # primary key's range, whatever the history's length.
        top = before if before is not None else (
            Task.select(pw.fn.MAX(Task.id)).scalar() or 0) + 1
        floor = max(top - DATA_WINDOW, 0)
        conditions.append(Task.id >= floor)
    if conditions:
        query = query.where(*conditions)
    rows = list(query)
    blockers = blocked_by(store, rows[:limit])
    running = running_of(store, [row.id for row in rows[:limit] if row.last_status == SCHEDULED])
    tasks = [task_info(row, blockers=blockers.get(row.id), running=row.id in running)
             for row in rows[:limit]]
    if len(rows) > limit:
        return TaskPage(tasks, tasks[-1].id, floor)
    if floor and floor > (Task.select(pw.fn.MIN(Task.id)).scalar() or 0):
        return TaskPage(tasks, floor, floor)
    return TaskPage(tasks, None, floor)


def matching_task_ids(store: Any, view: TaskFilter, limit: int) -> List[int]:
    """Ids of up to `limit` tasks matching `view`, newest first (for bulk actions)."""
    Task = store.Task
    query = Task.select(Task.id).order_by(Task.id.desc()).limit(limit)
    conditions = _task_conditions(store, view, view.data is not None
                                  and searching.indexed(store, view.data[0]))
    if conditions:
        query = query.where(*conditions)
    return [task_id for (task_id,) in query.tuples()]


def periodic_task_id(store: Any, name: str) -> int:
    """The id of the periodic task `name` (its submitted tasks carry it)."""
    PeriodicTask = store.PeriodicTask
    row = PeriodicTask.select(PeriodicTask.id).where(PeriodicTask.name == name).first()
    if row is None:
        raise InputError("no periodic task named %r" % name)
    return int(row.id)


def succeeded_count(store: Any) -> int:
    """Tasks that succeeded: all tasks (the smallest index) less the others (the partial
    status index). Still the costly count on a long history: a long-lived reader keeps it
    a few seconds (`status_counts`)."""
    Task = store.Task
    total = Task.select(pw.fn.COUNT(pw.SQL("*"))).scalar() or 0
    others = Task.select(pw.fn.COUNT(pw.SQL("*"))).where(not_succeeded_predicate()).scalar() or 0
    return int(total) - int(others)


def debouncing(store: Any) -> int:
    """Tasks whose debounce window is open now (runs/debounce.py): a later enqueue of their key
    lands in them. Read off the partial index of the keys held (task_queue_debounce), which
    holds one entry per key used since its last window at most."""
    Task = store.Task
    return int(Task.select(pw.fn.COUNT(pw.SQL("*"))).where(
        Task.debounce_open.is_null(False) & (Task.run_count == 0) & Task.finished_on.is_null()
        & (Task.scheduled_on > store.database_time())).scalar() or 0)


def status_counts(store: Any, succeeded: Optional[int] = None) -> Dict[str, int]:
    """Tasks by where they stand: scheduled, running, waiting, retrying, given-up, success,
    cancelled (every status present, 0 when none). The statuses other than success are
    few index entries, read every time; `succeeded` is the caller's recent
    `succeeded_count`, or None to count them now."""
    Task = store.Task
    counts = dict.fromkeys(TASK_STATES, 0)
    for status, n in Task.select(Task.last_status, pw.fn.COUNT(pw.SQL("*"))).where(
            not_succeeded_predicate()).group_by(Task.last_status).tuples():
        key = counted_word(status, True)     # a failed task: retrying ones moved below
        counts[key] = counts.get(key, 0) + n
    # A running task's row says scheduled (the claim writes its run alone): the running runs
    # are counted off their partial index.
    Run = store.Run
    running = Run.select(pw.fn.COUNT(pw.SQL("*"))).where(run_status_is(Run, RUNNING)).scalar()
    counts[RUNNING] += running or 0
    counts[SCHEDULED] -= running or 0
    counts[SUCCESS] = succeeded_count(store) if succeeded is None else succeeded
    retrying = Task.select(pw.fn.COUNT(pw.SQL("*"))).where(
        failed_predicate() & Task.finished_on.is_null()).scalar() or 0
    counts["retrying"] += retrying
    counts["given-up"] -= retrying
    return counts


def _minute(store: Any, column: Any) -> Any:
    if store.backend == "postgresql":
        return pw.fn.to_char(pw.fn.date_trunc("minute", column), "YYYY-MM-DD HH24:MI")
    if store.backend == "mysql":
        return pw.fn.DATE_FORMAT(column, "%Y-%m-%d %H:%i")
    return pw.fn.strftime("%Y-%m-%d %H:%M", column)


def runs_per_minute(store: Any, minutes: int = 60, now: Optional[datetime] = None
                    ) -> List[MinuteCount]:
    """Runs that ended succeeded or failed in each of the last `minutes` minutes, oldest
    first, the current minute last (every minute present)."""
    Run = store.Run
    now = as_utc(now) if now else utcnow()
    current = now.replace(second=0, microsecond=0)
    first = current - timedelta(minutes=minutes - 1)
    bucket = _minute(store, Run.finished_on)
    counts: Dict[Tuple[str, str], int] = {}
    query = (Run.select(bucket.alias("m"), Run.status, pw.fn.COUNT(Run.id))
             .where((Run.finished_on >= first) & Run.status.in_((SUCCESS,) + FAILED))
             .group_by(pw.SQL("1"), pw.SQL("2")).tuples())   # the bucket's parameters
                                                             # are bound: name it by position
    for minute, status, n in query:
        if isinstance(minute, datetime):    # the column's converter may parse it back
            minute = minute.strftime("%Y-%m-%d %H:%M")
        key = (minute, SUCCESS if status == SUCCESS else ERROR)
        counts[key] = counts.get(key, 0) + n
    result = []
    for i in range(minutes):
        at = first + timedelta(minutes=i)
        label = at.strftime("%Y-%m-%d %H:%M")
        result.append(MinuteCount(aware(at), counts.get((label, SUCCESS), 0),
                                  counts.get((label, ERROR), 0)))
    return result


def queue_lag(store: Any, now: Optional[datetime] = None) -> float:
    """Seconds since the oldest due run of a queue that is not paused was due (0 when none
    waits): a queue paused on purpose must not trip a lag alert."""
    Run, Queue = store.Run, store.Queue
    now = as_utc(now) if now else utcnow()
    paused = Queue.select(Queue.name).where(Queue.paused == True)  # noqa: E712
    oldest = Run.select(pw.fn.MIN(Run.scheduled_on)).where(
        run_status_is(Run, SCHEDULED) & (Run.scheduled_on <= now)
        & Run.queue.not_in(paused)).scalar()
    if oldest is None:
        return 0.0
    if isinstance(oldest, str):       # SQLite returns an aggregate's datetime as text
        oldest = datetime.fromisoformat(oldest)
    return max(0.0, (now - oldest).total_seconds())


@dataclass(frozen=True)
class QueueFigures:
    """A queue's figures in the metrics, or (named OTHER) those of the queues not named:
    tasks scheduled (as ``tasks --status scheduled --queue NAME`` counts them) and runs
    running (their sum), seconds since the oldest scheduled run of a
    queue not paused was due (the oldest of all; a pause is no lag), how many of the queues
    are paused (0 or 1 for one) and for how long (the longest)."""
    name: str
    scheduled: int
    running: int
    lag: float
    paused: int
    paused_seconds: float = 0.0


@dataclass(frozen=True)
class PeriodicFigures:
    """A periodic task's figures in the metrics, or (named OTHER) those of the periodic tasks
    not named: how many are enabled (0 or 1 for one), the next due time (the soonest of the
    enabled ones), failures in a row (the most)."""
    name: str
    enabled: int
    nextrun: Optional[datetime]
    consecutive_failures: int


def _datetime(value: Any) -> Optional[datetime]:
    """An aggregate's datetime (SQLite returns text) as a naive UTC one."""
    return datetime.fromisoformat(value) if isinstance(value, str) else value


def queue_figures(store: Any, named: Sequence[str], limit: int,
                  now: Optional[datetime] = None) -> List[QueueFigures]:
    """The queues `named` (the configured ones) and up to `limit` more — the busiest by runs
    scheduled and running, then others by name — each by itself, by name, and the rest
    summed as OTHER (absent when there is no other queue). Whoever adds tasks picks queue
    names: these queries return at most `limit` groups whatever their number."""
    Run, Queue = store.Run, store.Queue
    now = as_utc(now) if now else utcnow()
    count = pw.fn.COUNT(Run.id)
    busiest: Dict[str, int] = {}
    for status in (SCHEDULED, RUNNING):
        for queue, n in Run.select(Run.queue, count).where(run_status_is(Run, status)).group_by(
                Run.queue).order_by(count.desc(), Run.queue).limit(limit).tuples():
            busiest[queue] = busiest.get(queue, 0) + n
    chosen = set(named) | set(sorted(busiest, key=lambda q: (-busiest[q], q))[:limit])
    if len(chosen) < len(named) + limit:
        chosen.update(name for name, in Queue.select(Queue.name).where(
            Queue.name.not_in(sorted(chosen))).order_by(Queue.name).limit(
            len(named) + limit - len(chosen)).tuples())
    names = sorted(chosen)

    def since(then: Any) -> float:
        then = _datetime(then)
        return round(max(0.0, (now - then).total_seconds()), 3) if then else 0.0
    Task = store.Task
    is_scheduled = not_succeeded_predicate() & (Task.last_status == SCHEDULED)
    scheduled_tasks = dict(Task.select(Task.queue, pw.fn.COUNT(pw.SQL("*"))).where(
        is_scheduled & Task.queue.in_(names)).group_by(Task.queue).tuples())
    oldest_due = dict(Run.select(Run.queue, pw.fn.MIN(Run.scheduled_on)).where(
        run_status_is(Run, SCHEDULED) & Run.queue.in_(names)).group_by(Run.queue).tuples())
    running = dict(Run.select(Run.queue, count).where(
        run_status_is(Run, RUNNING) & Run.queue.in_(names)).group_by(Run.queue).tuples())
    # A running task's row says scheduled (the claim writes its run alone).
    scheduled_tasks = {name: n - running.get(name, 0) for name, n in scheduled_tasks.items()}
    paused = dict(Queue.select(Queue.name, Queue.paused_on).where(
        (Queue.paused == True) & Queue.name.in_(names)).tuples())  # noqa: E712
    result = [QueueFigures(name, scheduled_tasks.get(name, 0), running.get(name, 0),
                           0.0 if name in paused else since(oldest_due.get(name)),
                           int(name in paused), since(paused[name]) if name in paused else 0.0)
              for name in names]
    is_paused = Queue.paused == True  # noqa: E712
    others, others_paused, longest = Queue.select(
        pw.fn.COUNT(Queue.name), pw.fn.SUM(pw.Case(None, [(is_paused, 1)], 0)),
        pw.fn.MIN(pw.Case(None, [(is_paused, Queue.paused_on)], None))).where(
        Queue.name.not_in(names)).tuples().get()
    scheduled = Task.select(pw.fn.COUNT(pw.SQL("*"))).where(
        is_scheduled & Task.queue.not_in(names)).scalar()
    oldest = Run.select(pw.fn.MIN(Run.scheduled_on)).where(
        run_status_is(Run, SCHEDULED) & Run.queue.not_in(names)
        & Run.queue.not_in(Queue.select(Queue.name).where(is_paused))).scalar()
    busy = Run.select(count).where(run_status_is(Run, RUNNING) & Run.queue.not_in(names)).scalar()
    scheduled = (scheduled or 0) - (busy or 0)
    if others or scheduled or busy:
        result.append(QueueFigures(OTHER, int(scheduled or 0), int(busy or 0), since(oldest),
                                   int(others_paused or 0), since(longest)))
    return result


def periodic_figures(store: Any, limit: int) -> List[PeriodicFigures]:
    """The periodic tasks of the config and up to `limit` more — those failing most in a
    row, then the soonest due — each by itself, by name, and the rest as OTHER (absent when
    there is none). At most `limit` rows read beyond the config's, whatever their number."""
    P = store.PeriodicTask
    columns = (P.name, P.enabled, P.nextrun, P.consecutive_failures)
    rows = list(P.select(*columns).where(P.source == "config").tuples())
    rows.extend(P.select(*columns).where(P.source != "config").order_by(
        P.consecutive_failures.desc(), P.nextrun.is_null(), P.nextrun, P.name).limit(
        limit).tuples())
    result = [PeriodicFigures(name, int(bool(enabled)), aware(nextrun), failures or 0)
              for name, enabled, nextrun, failures in sorted(rows)]
    names = [row[0] for row in rows]
    others, enabled, soonest, most = P.select(
        pw.fn.COUNT(P.id), pw.fn.SUM(pw.Case(None, [(P.enabled == True, 1)], 0)),  # noqa: E712
        pw.fn.MIN(pw.Case(None, [(P.enabled == True, P.nextrun)], None)),  # noqa: E712
        pw.fn.MAX(P.consecutive_failures)).where(P.name.not_in(names)).tuples().get()
    if others:
        result.append(PeriodicFigures(OTHER, int(enabled or 0), aware(_datetime(soonest)),
                                      int(most or 0)))
    return result


def failure_groups(store: Any, handler: Optional[str] = None) -> List[FailureGroup]:
    """Failed tasks (given up or retrying) grouped by handler and error code, the largest
    group first. Three queries whatever the history: the groups, their latest tasks, and
    the traceback of each latest task's latest run that has one (the runs of those few
    tasks only, by the task_id index)."""
    Task = store.Task
    retrying = pw.fn.SUM(pw.Case(None, [(Task.finished_on.is_null(), 1)], 0))
    query = (Task.select(Task.handler, Task.last_error_code, pw.fn.COUNT(pw.SQL("*")),
                         retrying, pw.fn.MAX(Task.id))
             .where(failed_predicate())
             .group_by(Task.handler, Task.last_error_code))
    if handler:
        query = query.where(Task.handler == handler)
    groups = list(query.tuples())
    latest = {row.id: row for row in Task.select(
        Task.id, Task.last_error_message, Task.updated_on).where(
        Task.id.in_([g[4] for g in groups]))} if groups else {}
    tracebacks = _latest_tracebacks(store, list(latest))
    result = []
    for name, code, n, n_retrying, latest_id in groups:
        row = latest[latest_id]
        result.append(FailureGroup(name, code, int(n) - int(n_retrying), int(n_retrying),
                                   latest_id, row.last_error_message, aware(row.updated_on),
                                   tracebacks.get(latest_id)))
    result.sort(key=lambda g: (-(g.given_up + g.retrying), g.handler, g.error_code or ""))
    return result


def _latest_tracebacks(store: Any, task_ids: List[int]) -> Dict[int, str]:
    """task id -> the traceback of its latest run that has one (one query)."""
    Run = store.Run
    if not task_ids:
        return {}
    last = (Run.select(pw.fn.MAX(Run.id))
            .where(Run.task_id.in_(task_ids) & Run.traceback.is_null(False))
            .group_by(Run.task_id))
    return dict(Run.select(Run.task_id, Run.traceback).where(Run.id.in_(last)).tuples())


def runner_queues(store: Any) -> Dict[int, List[str]]:
    """runner id -> the queues it serves (task_runner_queues: the rows of running runners
    that serve named queues), each list sorted."""
    RunnerQueue = store.RunnerQueue
    result: Dict[int, List[str]] = {}
    for runner_id, name in RunnerQueue.select(RunnerQueue.runner_id, RunnerQueue.queue).order_by(
            RunnerQueue.runner_id, RunnerQueue.queue).tuples():
        result.setdefault(runner_id, []).append(name)
    return result


def _finished_between(Run: Any, since: Optional[datetime], until: Optional[datetime]) -> Any:
    condition = Run.finished_on.is_null(False)
    if since is not None:
        condition &= Run.finished_on >= since
    if until is not None:
        condition &= Run.finished_on < until
    return condition


def runs_ended_by_handler(store: Any, since: Optional[datetime] = None,
                          until: Optional[datetime] = None) -> List[Tuple[str, str, int]]:
    """(handler, final run status, runs) over the runs in the database that finished in
    [since, until) (naive UTC; None: unbounded)."""
    Task, Run = store.Task, store.Run
    query = (Run.select(Task.handler, Run.status, pw.fn.COUNT(Run.id))
             .join(Task, on=(Run.task_id == Task.id))
             .where(_finished_between(Run, since, until))
             .group_by(Task.handler, Run.status).tuples())
    return [(h, s, int(n)) for h, s, n in query]


def _seconds_between(store: Any, start: Any, end: Any) -> Any:
    if store.backend == "postgresql":
        return pw.fn.date_part("epoch", end - start)
    if store.backend == "mysql":
        return pw.fn.TIMESTAMPDIFF(pw.SQL("MICROSECOND"), start, end) / 1e6
    return (pw.fn.julianday(end) - pw.fn.julianday(start)) * 86400.0


def duration_histograms(store: Any, buckets: Sequence[float] = DURATION_BUCKETS,
                        since: Optional[datetime] = None, until: Optional[datetime] = None
                        ) -> List[DurationHistogram]:
    """Per handler, the durations of the runs that started and finished in [since, until),
    as a cumulative histogram (one pass over the runs, counted by the database)."""
    Task, Run = store.Task, store.Run
    seconds = _seconds_between(store, Run.started_on, Run.finished_on)
    columns = [pw.fn.SUM(pw.Case(None, [(seconds <= bound, 1)], 0)) for bound in buckets]
    query = (Run.select(Task.handler, pw.fn.COUNT(Run.id), pw.fn.SUM(seconds), *columns)
             .join(Task, on=(Run.task_id == Task.id))
             .where(_finished_between(Run, since, until) & Run.started_on.is_null(False))
             .group_by(Task.handler).tuples())
    return [DurationHistogram(row[0], tuple(int(n or 0) for n in row[3:]), int(row[1]),
                              float(row[2] or 0.0)) for row in query]


class RunTotals:
    """`runs_ended_by_handler` and `duration_histograms` over the whole history, kept by a
    long-lived process (the dashboard) and brought up to date from the runs that finished
    since its last look: the first `refresh` reads every run, later ones only the new
    ones (the finished_on index). Runs are counted once they have been finished for
    `margin` seconds, so that one committed a little after its finished_on is not missed."""

    def __init__(self, margin: float = 10.0) -> None:
        self.margin = timedelta(seconds=margin)
        self.until: Optional[datetime] = None
        self.ended: Dict[Tuple[str, str], int] = {}
        self.durations: Dict[str, DurationHistogram] = {}
        self.lock = threading.Lock()

    def refresh(self, store: Any, now: Optional[datetime] = None
                ) -> Tuple[List[Tuple[str, str, int]], List[DurationHistogram]]:
        with self.lock:
            until = (as_utc(now) if now else utcnow()) - self.margin
            since = self.until
            for handler, status, n in runs_ended_by_handler(store, since, until):
                self.ended[(handler, status)] = self.ended.get((handler, status), 0) + n
            for h in duration_histograms(store, since=since, until=until):
                old = self.durations.get(h.handler)
                if old is not None:
                    h = DurationHistogram(h.handler, tuple(
                        a + b for a, b in zip(old.buckets, h.buckets)), old.count + h.count,
                        old.total_seconds + h.total_seconds)
                self.durations[h.handler] = h
            self.until = until
            return ([(h, s, n) for (h, s), n in sorted(self.ended.items())],
                    [self.durations[h] for h in sorted(self.durations)])
