"""Periodic tasks and the PeriodicScheduler that submits them (the Docspell ADR), with
Nuntium's owner, min_spacing, timebox and tolerance, Docspell's subject and group, and rule
9: a due time yields at most one task, however many schedulers run against one database.

Timers are systemd calendar events (``Mon..Fri *-*-* 07:30 Europe/Berlin``), fixed
intervals written as time spans (``every 30s``, ``every 1h 30min``), anchored to the
previous due time so they do not drift, or spans after the previous task finished
(``after 5min``: TimescaleDB's schedule_interval). A calendar timer written without a
zone is stored with the zone it was defined in (see timers.py), so every host computes
the same instants from it.

A pass: take the earliest enabled due periodic task; mark it (a conditional update: only
one scheduler wins; the others try the next); then, in one transaction, submit its task
(or skip this occurrence while the previous task is unfinished), advance nextrun, unmark.
Missed due times after downtime collapse into one task (catch_up ``once``) or none
(``skip``: an occurrence more than MISFIRE_GRACE late is dropped). An ``every`` timer with
``anchor = "now"`` counts its next due time from the pass that handled the last one
(Nuntium), not from that due time.
"""
import bisect
import dataclasses
import json
import logging
import math
from collections import namedtuple
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Optional

import peewee as pw

from ..runs import lifecycle, sql
from ..fleet import liveness
from ..runs.enqueue import add_task, insert_many_and_wake, remember_queues, task_row, utc_instant
from ..errors import InputError, StateError, check_text
from ..handler import load_handler
from ..store.models import CANCELLED, CRASHED, DEFAULT_QUEUE, SUCCESS
from .definitions import (BUILTIN_ROTATION, CATCH_UP, MAX_NAME, RESERVED_PREFIX, check_periodic,
                          check_periodic_handlers, definition, due_columns, first_due,
                          validate_definitions)
from .timers import IntervalTimer, parse_timer

log = logging.getLogger("taskrunner.periodic")

def add_periodic(store, name, handler, timer, data=None, source="api", now=None, **options):
    """Create a periodic task; InputError for a bad timer, handler or a duplicate name."""
    now = store.database_time(now)
    if options.get("queue") is None:
        # Added here, the handler is imported: its class's queue applies (a [[periodic]]
        # entry of the config names its queue, since the overseer imports no handler).
        options["queue"] = load_handler(handler, store.config.handlers.allow).queue \
            or DEFAULT_QUEUE
    values, parsed = check_periodic(store.config, name, handler, timer, data, **options)
    try:
        with store.db.atomic():
            return store.PeriodicTask.create(
                created=now, updated_on=now, source=source, **values,
                **due_columns(parsed, first_due(parsed, now), values["name"], values["jitter"]))
    except pw.IntegrityError:
        raise InputError("a periodic task named %r already exists" % values["name"]) from None


def _get(store, name, owner=None):
    check_text("name", name, max_length=None)
    check_text("owner", owner, max_length=None)
    PeriodicTask = store.PeriodicTask
    row = PeriodicTask.get_or_none(PeriodicTask.name == name)
    if row is None or (owner is not None and row.owner != owner):
        raise InputError("no periodic task named %r%s" % (name, " owned by %r" % owner if owner else ""))
    return row


def run_now(store, name, owner=None, now=None):
    """Submit a task of the periodic task `name` now, outside its timer (an operator's "run
    now", enabled or not); its schedule (nextrun) stays as it is. Refused (StateError) while
    a task of it is unfinished, as its due times are skipped then. Returns the task id.
    The periodic task's row is locked while its tasks are looked at: a second run-now waits
    and then finds the first one's task (a scheduler's due time at that very instant may
    still submit one too: rule 9 is about due times, and this is none)."""
    PeriodicTask = store.PeriodicTask
    at = store.database_time(now)
    row = _get(store, name, owner)

    def step():
        store.locked(PeriodicTask.select(PeriodicTask.id).where(PeriodicTask.id == row.id)).get()
        unfinished = unfinished_task(store, row.id)
        if unfinished is not None:
            raise StateError("periodic task %r: its task %d has not finished"
                             % (name, unfinished.id))
        task_id = add_task(
            store, row.handler, data=json.loads(row.data), priority=row.priority,
            max_runtime=row.max_runtime, queue=row.queue, max_retries=row.max_retries,
            queued_by="periodic:%s (run now)" % row.name, periodic_task_id=row.id, now=now,
            import_handler=False, subject=row.subject, group=row.group_name)
        if row.resume:
            carry_checkpoints(store, [(task_id, row.last_task_id)])
        PeriodicTask.update({PeriodicTask.submitted_count: PeriodicTask.submitted_count + 1,
                             PeriodicTask.last_task_id: task_id, PeriodicTask.updated_on: at}
                            ).where(PeriodicTask.id == row.id).execute()
        return task_id
    return store.write(step)


MAX_BACKFILL = 1000    # instances one backfill creates unless told more (max_instances)


@dataclass(frozen=True)
class Instance:
    """An instance of a periodic task: its calendar time, when it is due (that time plus its
    jitter offset: its task's scheduled_on), and its task (None: none)."""
    instance: datetime
    scheduled_on: datetime
    task_id: Optional[int] = None

    def to_json(self):
        return {"instance": self.instance.isoformat(),
                "scheduled_on": self.scheduled_on.isoformat(), "task_id": self.task_id}


def _calendar_times(timer, anchor, start, end, most):
    """The calendar times of `timer` in [start, end] — `most` + 1 at most: a range holding
    more is refused, and not walked to its end — and the one after the last (None: the
    timer ends). An ``every`` timer's grid runs through `anchor`."""
    times = []
    if isinstance(timer, IntervalTimer):
        step = timedelta(seconds=timer.seconds)
        at = anchor + step * math.ceil((start - anchor) / step)
        while at <= end and len(times) <= most:
            times.append(at)
            at += step
        return times, at
    at = timer.next_after(start - timedelta(microseconds=1))
    while at is not None and at <= end and len(times) <= most:
        if at >= start:
            times.append(at)
        at = timer.next_after(at)
    return times, at


def backfill(store, name, start, end, owner=None, max_instances=MAX_BACKFILL, now=None):
    """Temporal's backfill: create the instances of the periodic task `name` whose calendar
    times lie in [start, end] (aware datetimes) and have no task yet — each due at its
    calendar time plus its jitter offset (one in the past runs at once) — and return
    {"created": [Instance], "existing": [Instance], "upcoming": [Instance]}. The instance of
    a calendar time is the task of the periodic task scheduled between it and the next
    calendar time (a run-now task is none); "upcoming" are those after now or from the
    scheduler's next due time on: they are its to create, not a backfill's. InputError, and
    nothing created: an unknown name, start after end, an 'after SPAN' timer (no calendar),
    more than `max_instances` calendar times in the range.

    Race closed: two backfills of one range, or a backfill and a scheduler's pass — the
    periodic task's row is locked first (FOR UPDATE; the scheduler takes rows SKIP LOCKED),
    then its tasks in the range are read and the missing ones inserted, so the second finds
    the first one's tasks (MySQL's repeatable-read snapshot starts at the first plain read,
    after the lock); and the scheduler only creates instances from its next due time on,
    which a backfill leaves alone."""
    start, end = utc_instant(start, "from"), utc_instant(end, "to")
    if start > end:
        raise InputError("backfill: from (%sZ) is after to (%sZ)" % (start.isoformat(),
                                                                       end.isoformat()))
    if isinstance(max_instances, bool) or not isinstance(max_instances, int) \
            or max_instances < 1:
        raise InputError("backfill: max must be a positive integer, not %r" % (max_instances,))
    PeriodicTask, Task = store.PeriodicTask, store.Task
    row = _get(store, name, owner)
    at = store.database_time(now)
    outcome = {"created": [], "existing": [], "upcoming": []}
    run_now_label = "periodic:%s (run now)" % row.name
    written = []

    def step():
        outcome.update(created=[], existing=[], upcoming=[])
        # Its timer as it is now, under the lock (an alter waits for this backfill).
        current = store.locked(PeriodicTask.select().where(PeriodicTask.id == row.id)).get()
        timer = parse_timer(current.timer, current.timezone)
        if timer.after_finish:
            raise InputError("periodic task %r: an 'after SPAN' timer has no calendar times "
                             "to backfill" % name)
        times, beyond = _calendar_times(timer, _nominal(current) or current.created, start,
                                        end, max_instances)
        if len(times) > max_instances:
            raise InputError("backfill of periodic task %r: more than %d calendar times from "
                             "%sZ to %sZ; narrow the range or raise the maximum (--max)"
                             % (name, max_instances, start.isoformat(), end.isoformat()))
        if not times:
            return
        # The scheduler's from its next due time on; a disabled one starts after now when
        # enabled.
        scheduler_from = _nominal(current) if current.enabled else None
        window = Task.scheduled_on >= times[0]
        if beyond is not None:
            window &= Task.scheduled_on < beyond
        found = {}
        for task_id, scheduled_on in (
                Task.select(Task.id, Task.scheduled_on).where(
                    (Task.periodic_task_id == row.id) & window
                    & (Task.queued_by.is_null() | (Task.queued_by != run_now_label)))
                .order_by(Task.scheduled_on, Task.id)).tuples():
            found.setdefault(bisect.bisect_right(times, scheduled_on) - 1,
                             (task_id, scheduled_on))
        missing, tasks = [], []
        for index, nominal in enumerate(times):
            task_id, due = found.get(index) or (
                None, due_columns(timer, nominal, row.name, current.jitter)["nextrun"])
            instance = Instance(nominal.replace(tzinfo=timezone.utc),
                                due.replace(tzinfo=timezone.utc), task_id)
            if task_id is not None:
                outcome["existing"].append(instance)
            elif nominal > at or (scheduler_from is not None and nominal >= scheduler_from):
                outcome["upcoming"].append(instance)
            else:
                missing.append(instance)
                tasks.append(task_row(
                    store.config, current.handler, data=json.loads(current.data),
                    scheduled_on=instance.scheduled_on, priority=current.priority,
                    max_runtime=current.max_runtime, queue=current.queue,
                    max_retries=current.max_retries,
                    queued_by="periodic:%s (backfill)" % row.name, periodic_task_id=row.id,
                    now=at, import_handler=False, subject=current.subject,
                    group=current.group_name))
        if tasks:
            ids = insert_many_and_wake(store, tasks)
            outcome["created"] = [dataclasses.replace(instance, task_id=task_id)
                                  for instance, task_id in zip(missing, ids)]
            PeriodicTask.update({PeriodicTask.submitted_count:
                                 PeriodicTask.submitted_count + len(ids),
                                 PeriodicTask.updated_on: at}).where(
                PeriodicTask.id == row.id).execute()
        written[:] = [task["queue"] for task in tasks]
    store.write(step)
    remember_queues(store, written)
    return outcome


def carry_checkpoints(store, pairs):
    """Inside the caller's write transaction, for periodic tasks with ``resume``: each new
    task of `pairs` ((task id, its previous task's id or None)) starts from the checkpoint of
    the previous task when that one ended without success (stopped at its max_runtime, timed
    out, given up, cancelled) — Nuntium's "the next instantiation will proceed from that
    point". A previous task that succeeded, or stored no checkpoint, passes nothing on."""
    pairs = [(task_id, previous) for task_id, previous in pairs if previous is not None]
    if not pairs:
        return
    Task = store.Task
    ended = {row[0]: row[1:] for row in Task.select(
        Task.id, Task.checkpoint, Task.checkpoint_on).where(
        Task.id.in_([previous for _, previous in pairs]) & Task.finished_on.is_null(False)
        & (Task.last_status != SUCCESS) & Task.checkpoint.is_null(False)).tuples()}
    for task_id, previous in pairs:
        if previous in ended:
            checkpoint, checkpoint_on = ended[previous]
            Task.update(checkpoint=checkpoint, checkpoint_on=checkpoint_on).where(
                Task.id == task_id).execute()


# What alter_periodic changes; the rest of a definition is remove + add.
ALTERABLE = ("timer", "data", "queue", "priority", "max_attempts", "max_retries",
             "max_runtime", "enabled", "resume", "jitter", "next_start")


def _definition_of(row):
    """The definition a stored row was made from, as `definition` takes it: the values
    Nuntium's timebox and tolerance derive (max_runtime, min_spacing) are left to them."""
    return {"name": row.name, "handler": row.handler, "timer": row.timer,
            "data": json.loads(row.data), "priority": row.priority, "enabled": row.enabled,
            "catch_up": row.catch_up, "owner": row.owner, "submitter": row.submitter,
            "max_retries": row.max_retries, "subject": row.subject, "group": row.group_name,
            "timebox": row.timebox, "tolerance": row.tolerance, "queue": row.queue,
            "anchor": row.anchor, "resume": bool(row.resume), "jitter": row.jitter,
            "max_runtime": None if row.timebox == "half" else row.max_runtime,
            "min_spacing": None if row.tolerance is not None else row.min_spacing}


def alter_periodic(store, name, owner=None, now=None, **changes):
    """Change the periodic task `name` in place (TimescaleDB's alter_job): its `timer`,
    `data`, `queue`, `priority`, `max_attempts` (or `max_retries`, the same count),
    `max_runtime` (an absolute limit, which
    replaces a timebox), `enabled`, `resume`, `jitter` (a span; 0 or "0s": none; the next
    instance is spread again) and `next_start` (an aware datetime: its next due time, taken
    as it is: no jitter is added to it). Its counters, last run and tasks stay. Every value
    is checked before anything is written: InputError, and nothing changed. A new timer
    starts its schedule afresh from now on the database's clock, as enabling does, unless
    `next_start` is given. A periodic task from the config file takes `next_start` alone:
    the file holds the rest (the overseer's next sync would undo a change). Returns the
    changed row."""
    unknown = sorted(set(changes) - set(ALTERABLE))
    if unknown:
        raise InputError("periodic task %r: %s cannot be altered (these can: %s)"
                         % (name, ", ".join(unknown), ", ".join(ALTERABLE)))
    if not changes:
        raise InputError("periodic task %r: nothing to change" % (name,))
    PeriodicTask = store.PeriodicTask
    at = store.database_time(now)
    row = _get(store, name, owner)
    if row.source == "config" and set(changes) != {"next_start"}:
        source = store.config.source
        raise InputError(
            "periodic task %r is defined in the config file%s: change it there (the overseer's "
            "next sync would undo a change made here); only next_start may be altered"
            % (name, "" if source.startswith("<") else " %s" % source))
    spec = _definition_of(row)
    spec.update((key, value) for key, value in changes.items() if key != "next_start")
    if "max_attempts" in changes:       # the stored max_retries is what it replaces
        spec["max_retries"] = changes.get("max_retries")
    if "max_runtime" in changes:
        spec["timebox"] = None
    values, timer = definition(store.config, spec, "periodic task %r" % (name,),
                               import_handler=False)
    if values["timer"] == row.timer:
        values["timezone"] = row.timezone   # the zone it was defined in stays
    update = {key: value for key, value in values.items() if getattr(row, key) != value}
    jitter = values["jitter"]
    if "next_start" in changes:
        start = utc_instant(changes["next_start"], "next_start")
        update.update(nextrun=start, nominal=start if jitter else None)
    elif "timer" in update or "timezone" in update or update.get("enabled"):
        update.update(due_columns(timer, first_due(timer, at), row.name, jitter))
    elif "jitter" in update:
        update.update(due_columns(timer, _nominal(row), row.name, jitter))
    update["updated_on"] = at

    def step():
        # The row locked: a scheduler's pass (SKIP LOCKED) leaves it until this commits.
        store.locked(PeriodicTask.select(PeriodicTask.id).where(PeriodicTask.id == row.id)).get()
        PeriodicTask.update(**update).where(PeriodicTask.id == row.id).execute()
    store.write(step)
    return PeriodicTask.get_by_id(row.id)


def _nominal(row):
    """The calendar time of a row's next instance."""
    return row.nextrun if row.nominal is None else row.nominal


def _fresh(row, now):
    """The row values of a schedule started afresh from `now` (enabling)."""
    timer = parse_timer(row.timer, row.timezone)
    return due_columns(timer, first_due(timer, now), row.name, row.jitter)


def set_enabled(store, name, enabled, owner=None, now=None):
    PeriodicTask = store.PeriodicTask
    row = _get(store, name, owner)
    now = store.database_time(now)
    values = {"enabled": enabled, "updated_on": now}
    if enabled and not row.enabled:
        values.update(_fresh(row, now))
    PeriodicTask.update(**values).where(PeriodicTask.id == row.id).execute()


def remove_periodic(store, name, owner=None):
    """Delete a periodic task (its submitted tasks stay)."""
    PeriodicTask = store.PeriodicTask
    PeriodicTask.delete().where(PeriodicTask.id == _get(store, name, owner).id).execute()


def _owner_required(owner):
    if not isinstance(owner, str) or not owner:
        raise InputError("acting on all periodic tasks of an owner needs the owner")


def remove_owned(store, owner):
    """Delete every periodic task of `owner` (Nuntium: a channel deleted takes its tasks
    along), in one statement; returns how many."""
    _owner_required(owner)
    PeriodicTask = store.PeriodicTask
    return store.write(lambda: PeriodicTask.delete().where(PeriodicTask.owner == owner).execute())


def set_enabled_owned(store, owner, enabled, now=None):
    """Enable or disable every periodic task of `owner` in one transaction; returns how many
    changed. Enabled ones start a fresh schedule from now, like set_enabled."""
    _owner_required(owner)
    PeriodicTask = store.PeriodicTask
    now = store.database_time(now)

    def step():
        rows = list(PeriodicTask.select(PeriodicTask.id, PeriodicTask.name, PeriodicTask.timer,
                                        PeriodicTask.timezone, PeriodicTask.jitter)
                    .where((PeriodicTask.owner == owner) & (PeriodicTask.enabled != enabled)))
        for row in rows:
            values = {"enabled": enabled, "updated_on": now}
            if enabled:
                values.update(_fresh(row, now))
            PeriodicTask.update(**values).where(PeriodicTask.id == row.id).execute()
        return len(rows)
    return store.write(step)


def sync_definitions(store, config=None, now=None, import_handlers=True):
    """Bring the rows that came from the config (its ``[[periodic]]`` tables and the built-in
    rotation task) in line with it: add new ones, update changed ones, disable those no
    longer in the file. Rows added through the API or CLI are never touched. Everything is
    validated first: one bad entry changes nothing."""
    PeriodicTask = store.PeriodicTask
    config = config or store.config
    now = store.database_time(now)
    validated = validate_definitions(config, import_handlers)

    def step():
        existing = {r.name: r for r in PeriodicTask.select()}
        for name, (values, timer) in validated.items():
            row = existing.get(name)
            if row is None:
                PeriodicTask.create(created=now, updated_on=now, source="config", **values,
                                    **due_columns(timer, first_due(timer, now), name,
                                                  values["jitter"]))
            elif row.source != "config":
                log.warning("periodic task %r exists and was not created from the config; "
                            "the config entry is ignored", name)
            else:
                # The zone stays the one the timer was first defined in while its text is
                # unchanged: overseers syncing one file under different zones agree.
                zone = values.pop("timezone")
                changed = {k: v for k, v in values.items() if getattr(row, k) != v}
                if name == BUILTIN_ROTATION:
                    changed.pop("enabled", None)  # an operator's enable/disable stands
                if changed.get("timer"):
                    changed["timezone"] = zone
                    changed.update(due_columns(timer, first_due(timer, now), name,
                                               values["jitter"]))
                elif changed.get("enabled") or "jitter" in changed:
                    # Enabled: a fresh schedule from now; a new jitter: the next instance
                    # spread again.
                    stored = parse_timer(row.timer, row.timezone)
                    nominal = first_due(stored, now) if changed.get("enabled") else _nominal(row)
                    changed.update(due_columns(stored, nominal, name, values["jitter"]))
                if changed:
                    changed["updated_on"] = now
                    PeriodicTask.update(**changed).where(PeriodicTask.id == row.id).execute()
        PeriodicTask.update(enabled=False, updated_on=now).where(
            (PeriodicTask.source == "config") & PeriodicTask.name.not_in(list(validated))
            & (PeriodicTask.enabled == True)).execute()  # noqa: E712 - SQL comparison
    for attempt in range(3):
        try:
            return store.write(step)
        except pw.IntegrityError:
            # Another overseer synced the same new row a moment ago: sync again over it.
            if attempt == 2:
                raise


# -- the scheduler ------------------------------------------------------------------------

# What a pass reads of each due periodic task it marked (one row object per column would
# cost more than the rest of its submission).
Due = namedtuple("Due", (
    "id", "name", "handler", "data", "priority", "submitter", "timer", "timezone", "nextrun",
    "catch_up", "max_runtime", "max_retries", "last_due", "last_task_id", "subject",
    "group_name", "tolerance", "queue", "anchor", "resume", "jitter", "nominal"))
DUE_TIMES = (Due._fields.index("nextrun"), Due._fields.index("last_due"),
             Due._fields.index("nominal"))


def _datetimes(row, positions):
    """`row` with the datetimes at `positions` as naive datetimes (SQLite gives text)."""
    if not any(isinstance(row[i], str) for i in positions):
        return row
    row = list(row)
    for i in positions:
        if isinstance(row[i], str):
            row[i] = datetime.fromisoformat(row[i])
    return row


class PeriodicScheduler:
    """Submits the tasks of due periodic tasks; safe with any number of schedulers.

    A pass takes the due periodic tasks BATCH at a time, in due order, one transaction each:
    the rows read FOR UPDATE SKIP LOCKED (rule 9: `_take`), their previous tasks read in one
    query, the tasks inserted in multi-row INSERTs, the periodic tasks advanced in one
    statement — so 10,000 due at once cost a few dozen statements (it was a query with a
    growing NOT IN list, a mark and a transaction of its own for each periodic task: ~30 a
    second on SQLite). Every time it compares is on the database's clock
    (`Store.database_time`)."""

    STALE_MARK = timedelta(seconds=60)
    MISFIRE_GRACE = timedelta(seconds=5)
    BATCH = 500     # periodic tasks per mark and per transaction

    def __init__(self, store):
        self.store = store
        self._timers = {}       # (timer text, zone) -> the parsed timer
        self._followings = {}   # within a pass: (timer, zone, anchor, due, now) -> next due

    def clear_stale_marks(self, now=None):
        """Marks of schedulers that died — on this host, their PID is gone; on another, their
        runner row has ended (a sweep found their heartbeat too old, or they retired) — or
        older than STALE_MARK. A mark lives for one short transaction, so these are
        leftovers: a holder killed between its mark and its submission would otherwise hold
        that periodic task back for STALE_MARK after the next holder took over. Clearing the
        mark of a scheduler that still lives costs nothing but its due time: its submission
        is conditional on its mark (rule 9)."""
        PeriodicTask = self.store.PeriodicTask
        now = self.store.database_time(now)
        cleared = PeriodicTask.update(worker=None, marked=None).where(
            PeriodicTask.marked < now - self.STALE_MARK).execute()
        host = liveness.host_id(self.store)
        # A batch marked by one scheduler is one worker: each is looked at once.
        for (worker,) in PeriodicTask.select(PeriodicTask.worker).where(
                PeriodicTask.worker.is_null(False)).distinct().tuples():
            worker_host, pid, created = worker.rsplit(":", 2)
            if worker_host == host:
                gone = not liveness.process_alive(int(pid), float(created))
            else:
                gone = liveness.process_ended(self.store, worker_host, int(pid), float(created))
            if gone:
                cleared += PeriodicTask.update(worker=None, marked=None).where(
                    PeriodicTask.worker == worker).execute()
        if cleared:
            log.info("cleared %d stale periodic marks", cleared)
        return cleared

    def next_due(self, queues=None):
        """The earliest nextrun of an enabled periodic task (of `queues`: see run_pending),
        or None."""
        PeriodicTask = self.store.PeriodicTask
        where = (PeriodicTask.enabled == True) & PeriodicTask.marked.is_null()  # noqa: E712
        if queues is not None:
            where &= PeriodicTask.queue.in_(list(queues))
        return PeriodicTask.select(pw.fn.MIN(PeriodicTask.nextrun).alias("due")).where(
            where).get().due

    def run_pending(self, now=None, until=None, queues=None):
        """One pass: handle every due periodic task. Returns {"submitted": [task ids],
        "skipped": [names]}. `until`, asked before each batch, ends the pass early when
        true; what is left stays due for the next pass (a burst of due times must not keep
        the maintainer from its other work, nor from a stop). `now`: this host's time (a
        test's injected one; None: now), put on the database's clock. `queues`: the periodic
        tasks whose tasks go to these queues only (`taskrunner verify`'s own schedulers,
        which leave every other periodic task to the fleet's)."""
        now = self.store.database_time(now)
        result = {"submitted": [], "skipped": []}
        self._followings = {}
        after = None    # (nextrun, id) of the last due periodic task this pass took
        while until is None or not until():
            taken = self._batch(now, after, result, queues=queues)
            if not taken:
                return result
            after = (taken[-1].nextrun, taken[-1].id)
        return result

    def _batch(self, now, after, result, only=None, queues=None):
        """One transaction: take up to BATCH due periodic tasks (after `after` in due order,
        or the one whose id is `only`), submit or skip the occurrence of each, advance them.
        Returns the rows taken. A batch the database refuses (a task it rejects) is done
        again one periodic task at a time, so the others go on and the one at fault
        records its error; its next due time tries again."""
        taken = []

        def step():
            taken[:] = self._take(now, after, only, queues)
            return self._submit(taken, now) if taken else ([], [])
        try:
            outcomes, written = self.store.write(step)
        except (StateError, InputError, pw.IntegrityError, pw.DataError,
                pw.ProgrammingError) as exc:
            if only is None:
                for row in list(taken):
                    self._batch(now, None, result, only=row.id)
            elif taken:
                self._record_error(taken[0], now, exc)
            return taken
        remember_queues(self.store, written)
        for row, kind, detail in outcomes:
            if kind == "submitted":
                log.info("periodic task %r: submitted task %d for %s", row.name, detail,
                         row.nextrun)
                result["submitted"].append(detail)
            elif kind == "skipped":
                log.info("periodic task %r: due time %s skipped: %s", row.name, row.nextrun,
                         detail)
                result["skipped"].append(row.name)
            elif kind == "wait":
                log.debug("periodic task %r: its previous task has not finished; next look "
                          "at %s", row.name, detail)
        return taken

    def _take(self, now, after, only, queues=None):
        """Race closed: two schedulers taking the same due time — the due periodic tasks are
        read FOR UPDATE SKIP LOCKED in the transaction that advances them (SQLite: inside
        its one write transaction), so each is taken by one scheduler, and another finds it
        advanced once this one commits; a scheduler killed before the commit leaves nothing
        behind. Rows marked by a scheduler of an earlier version (the Docspell ADR's mark)
        are left to it (`clear_stale_marks`)."""
        PeriodicTask, backend = self.store.PeriodicTask, self.store.backend
        fields = [PeriodicTask.enabled, PeriodicTask.nextrun]
        values = [True, now]
        where = "enabled = {m} AND nextrun <= {m} AND marked IS NULL"
        if only is not None:
            where += " AND id = {m}"
            fields.append(PeriodicTask.id)
            values.append(only)
        elif after is not None:
            # Each due periodic task is tried once per pass, even one left due.
            where += " AND (nextrun > {m} OR (nextrun = {m} AND id > {m}))"
            fields += [PeriodicTask.nextrun, PeriodicTask.nextrun, PeriodicTask.id]
            values += [after[0], after[0], after[1]]
        if queues is not None and only is None:
            where += " AND queue IN (%s)" % ", ".join(["{m}"] * len(queues))
            fields += [PeriodicTask.queue] * len(queues)
            values += list(queues)
        statement = ("SELECT {cols} FROM {t} WHERE " + where + " ORDER BY nextrun, id LIMIT %d%s"
                     % (self.BATCH, "" if self.store.is_sqlite else " FOR UPDATE SKIP LOCKED")
                     ).format(cols=", ".join(Due._fields), t=self._table, m=self._param)
        cursor = self.store.db.execute_sql(statement, sql.bind(backend, fields, values))
        return [Due._make(_datetimes(row, DUE_TIMES)) for row in cursor.fetchall()]

    @property
    def _table(self):
        return self.store.PeriodicTask._meta.table_name

    @property
    def _param(self):
        return "?" if self.store.is_sqlite else "%s"

    def _listed(self, count):
        """`count` placeholders, for an IN list."""
        return ", ".join([self._param] * count)

    def _timer(self, row):
        """The row's parsed timer (parsed once per text and zone); None after disabling a
        periodic task whose timer no longer parses."""
        key = (row.timer, row.timezone)
        if key not in self._timers:
            try:
                self._timers[key] = parse_timer(row.timer, row.timezone)
            except InputError as exc:
                log.error("periodic task %r disabled: %s", row.name, exc)
                PeriodicTask = self.store.PeriodicTask
                PeriodicTask.update(enabled=False, last_status="error").where(
                    PeriodicTask.id == row.id).execute()
                return None
        return self._timers[key]

    def _following(self, row, timer, now):
        """The due time after row.nextrun: the next on the timer's grid; after downtime,
        the first one after now (catch-up once); Nuntium's now + interval for ``anchor =
        "now"``. Periodic tasks sharing a timer and a due time share the answer (a
        calendar's next elapse costs about a millisecond; 10,000 minutely timers are due
        at the same minute)."""
        key = (row.timer, row.timezone, row.anchor, _nominal(row), now)
        if key not in self._followings:
            self._followings[key] = self._compute_following(row, timer, now)
        return self._followings[key]

    def _compute_following(self, row, timer, now):
        due = _nominal(row)
        following = timer.next_after(due, anchor=due)
        if row.anchor == "now" and isinstance(timer, IntervalTimer) and not timer.after_finish:
            # Nuntium's nextRun = currentTime + interval: a late pass moves the grid with it.
            return timer.next_after(now)
        if following is not None and following <= now:
            return timer.next_after(now, anchor=due)  # missed due times: catch up once
        return following

    def _record_error(self, row, now, exc):
        """Recorded on the periodic task, its due time passed over; its next due time
        tries again."""
        PeriodicTask = self.store.PeriodicTask
        text = str(exc).strip()
        log.error("periodic task %r: due time %s not submitted: %s", row.name, row.nextrun,
                  text.splitlines()[0] if text else type(exc).__name__)
        timer = self._timer(row)
        if timer is not None:
            PeriodicTask.update(last_status="error", **due_columns(
                timer, self._following(row, timer, now), row.name, row.jitter)
            ).where((PeriodicTask.id == row.id) & (PeriodicTask.nextrun == row.nextrun)
                    ).execute()

    def _submit(self, rows, now):
        """Inside the batch's transaction, the rows taken: read their previous tasks in one
        query, insert the tasks to submit in multi-row INSERTs (enqueue's
        `insert_many_and_wake`), then advance every row in one statement. Returns ([(row,
        kind, task id / reason / next look)], the queue names written). The due time of an
        instance is its calendar time plus its jitter offset (`due_columns`): its task's
        scheduled_on."""
        # Rule 9 skips a due time while "the previous task" is unfinished: the one its
        # periodic task submitted last (by primary key, whatever the history's length).
        previous = {}
        last_ids = [row.last_task_id for row in rows if row.last_task_id is not None]
        if last_ids:
            previous = {row[0]: row[1:] for row in (_datetimes(r, (1,)) for r in (
                self.store.db.execute_sql(
                    "SELECT id, finished_on, last_status FROM {t} WHERE id IN ({ids})".format(
                        t=self.store.Task._meta.table_name, ids=self._listed(len(last_ids))),
                    last_ids).fetchall()))}
        outcomes, tasks, advances, submitting = [], [], [], []
        for row in rows:
            timer = self._timer(row)
            if timer is None:
                continue
            spread = due_columns(timer, self._following(row, timer, now), row.name, row.jitter)
            following = [spread["nextrun"], spread["nominal"]]
            # A previous task rotated away has finished long ago.
            finished, status = previous.get(row.last_task_id, (None, CANCELLED))
            unfinished = row.last_task_id if finished is None and status != CANCELLED else None
            due = row.nextrun
            if timer.after_finish:
                wait = self._after_finish_wait(timer, now, unfinished, finished)
                if wait is not None:
                    # Not an occurrence: look again when the previous task may have finished.
                    advances.append([wait, None, row.last_due, now, 0, 0, None, row.id])
                    outcomes.append((row, "wait", wait))
                    continue
            reason = self._skip_reason(row, due, now, unfinished)
            if reason:
                advances.append(following + [due, now, 0, 1, None, row.id])
                outcomes.append((row, "skipped", reason))
                continue
            # Checked as any task is (a definition valid when stored may not be now: its
            # data grew past max_data_size, its handler left handlers.allow).
            tasks.append(task_row(
                self.store.config, row.handler, data=json.loads(row.data),
                scheduled_on=due.replace(tzinfo=timezone.utc), priority=row.priority,
                max_runtime=row.max_runtime, queue=row.queue, max_retries=row.max_retries,
                queued_by=row.submitter or "periodic:" + row.name, periodic_task_id=row.id,
                now=now, import_handler=False, subject=row.subject, group=row.group_name))
            submitting.append(len(advances))
            advances.append(following + [due, now, 1, 0, None, row.id])
            outcomes.append((row, "submitted", None))
        task_ids = insert_many_and_wake(self.store, tasks) if tasks else []
        for index, task_id in zip(submitting, task_ids):
            advances[index][6] = task_id
        by_row = {advance[7]: advance[6] for advance in advances}
        outcomes = [(row, kind, by_row[row.id] if kind == "submitted" else detail)
                    for row, kind, detail in outcomes]
        carry_checkpoints(self.store, [(detail, row.last_task_id) for row, kind, detail
                                       in outcomes if kind == "submitted" and row.resume])
        if advances:
            self._advance_rows(advances)
        return outcomes, [task["queue"] for task in tasks]

    ADVANCED = ("nextrun", "nominal", "last_due", "updated_on", "submitted_count",
                "skipped_count", "last_task_id", "id")

    def _advance_rows(self, advances):
        """Advance the periodic tasks of `advances` ([nextrun, nominal, last_due, updated_on,
        submitted, skipped, last_task_id, id]), taken by this transaction: PostgreSQL in one
        statement (the rows as one JSON parameter, as the catalogue's multi-row INSERT),
        the others in one executemany. A mark (a scheduler of an earlier version) goes
        with it."""
        PeriodicTask, backend = self.store.PeriodicTask, self.store.backend
        table = PeriodicTask._meta.table_name
        if backend == "postgresql":
            statement = (
                "UPDATE {t} SET nextrun = v.nextrun, nominal = v.nominal, last_due = v.last_due, "
                "updated_on = v.updated_on, worker = NULL, marked = NULL, "
                "submitted_count = {t}.submitted_count + v.submitted_count, "
                "skipped_count = {t}.skipped_count + v.skipped_count, "
                "last_task_id = COALESCE(v.last_task_id, {t}.last_task_id) "
                "FROM json_to_recordset(%s) AS v(nextrun timestamp, nominal timestamp, "
                "last_due timestamp, "
                "updated_on timestamp, submitted_count integer, skipped_count integer, "
                "last_task_id integer, id integer) "
                "WHERE {t}.id = v.id").format(t=table)
            rows = [dict(zip(self.ADVANCED, values)) for values in advances]
            count = self.store.db.execute_sql(
                statement, [json.dumps(rows, default=datetime.isoformat)]).rowcount
        else:
            statement = (
                "UPDATE {t} SET nextrun = {m}, nominal = {m}, last_due = {m}, updated_on = {m}, "
                "worker = NULL, marked = NULL, submitted_count = submitted_count + {m}, "
                "skipped_count = skipped_count + {m}, "
                "last_task_id = COALESCE({m}, last_task_id) "
                "WHERE id = {m}").format(t=table, m=self._param)
            if backend == "sqlite":     # its datetimes as the text peewee stores (sql.bind)
                advances = [[v.isoformat(" ") if isinstance(v, datetime) else v
                             for v in values] for values in advances]
            cursor = self.store.db.cursor()
            try:
                cursor.executemany(statement, advances)
                count = cursor.rowcount
            finally:
                cursor.close()
        if count != len(advances):   # rows locked by this transaction: never, but say so
            raise StateError("%d periodic tasks taken were not advanced" % (len(advances) - count))

    def _skip_reason(self, row, due, now, unfinished):
        if row.catch_up == "skip" and due < now - self.MISFIRE_GRACE:
            return "missed while no scheduler ran (catch_up = skip)"
        if row.tolerance is not None:
            return None  # Nuntium: submitted regardless; the check at start decides
        if unfinished is not None:
            return "task %d of the previous due time is unfinished" % unfinished
        return None

    @staticmethod
    def _after_finish_wait(timer, now, unfinished, finished):
        """An ``after SPAN`` timer: None when its task may be submitted now; otherwise when
        to look again — SPAN after the previous task finished, or SPAN from now while it is
        unfinished (its end moves nextrun to finish + SPAN: `record_outcome`)."""
        span = timedelta(seconds=timer.seconds)
        if unfinished is not None:
            return now + span
        if finished is not None and finished + span > now:
            return finished + span
        return None


def unfinished_task(store, periodic_task_id):
    """A task of the periodic task that has not finished (one waiting for a retry too)."""
    Task = store.Task
    return Task.select(Task.id).where(
        (Task.periodic_task_id == periodic_task_id) & Task.finished_on.is_null()
        & (Task.last_status != CANCELLED)).first()


def record_outcome(store, periodic_task_id, status, now, error_code=None):
    """After a run of one of its tasks ended: the periodic task's last status, consecutive
    failures, crashes (total) and consecutive crashes (a crash after a crash; any other end
    but a cancel resets them), and its lifetime counts of runs, successes and errors (a
    cancel counts in none) — a hook of the run lifecycle."""
    PeriodicTask = store.PeriodicTask
    values = {PeriodicTask.last_status: status, PeriodicTask.updated_on: now}
    if status != CANCELLED:
        values[PeriodicTask.run_count] = PeriodicTask.run_count + 1
    if error_code == CRASHED:
        values[PeriodicTask.crash_count] = PeriodicTask.crash_count + 1
        values[PeriodicTask.consecutive_crashes] = PeriodicTask.consecutive_crashes + 1
    elif status != CANCELLED:
        values[PeriodicTask.consecutive_crashes] = 0
        if status != SUCCESS:
            values[PeriodicTask.error_count] = PeriodicTask.error_count + 1
    if status == SUCCESS:
        values[PeriodicTask.consecutive_failures] = 0
        values[PeriodicTask.success_count] = PeriodicTask.success_count + 1
    elif status != CANCELLED:
        values[PeriodicTask.consecutive_failures] = PeriodicTask.consecutive_failures + 1
    PeriodicTask.update(values).where(PeriodicTask.id == periodic_task_id).execute()
    row = PeriodicTask.select(PeriodicTask.timer, PeriodicTask.enabled).where(
        PeriodicTask.id == periodic_task_id).first()
    if row is None or not row.enabled or not row.timer.lower().startswith("after "):
        return
    # TimescaleDB's schedule_interval: the next task SPAN after this one finished (a run
    # that ends with a retry pending has not finished its task).
    try:
        span = timedelta(seconds=parse_timer(row.timer).seconds)
    except InputError:
        return  # its scheduler disables it; the end of this run must not fail over it
    if unfinished_task(store, periodic_task_id) is None:
        PeriodicTask.update(nextrun=now + span).where(PeriodicTask.id == periodic_task_id
                                                      ).execute()


def install_hooks():
    """Wire this module's bookkeeping into the run lifecycle (`record_outcome` on every end
    of a periodic task's run). Called where a process builds its store (TaskQueue, the
    overseer, the maintainer), never by importing this module: an import kept only for its
    side effect is one linter fix away from silently stopping the bookkeeping."""
    lifecycle.on_outcome(record_outcome)


def allow_start(store, periodic_task_id, now=None):
    """Nuntium's tolerance, checked when a run starts: False (drop the task) when the
    previous task of this periodic task started less than min_spacing ago; otherwise record
    this start as last_run. Race closed: two runners starting two tasks of one periodic
    task — the check and the update are one conditional UPDATE."""
    PeriodicTask = store.PeriodicTask
    now = store.database_time(now)
    row = PeriodicTask.get_or_none(PeriodicTask.id == periodic_task_id)
    if row is None:
        return True
    condition = PeriodicTask.id == row.id
    if row.min_spacing:
        condition &= (PeriodicTask.last_run.is_null()
                      | (PeriodicTask.last_run <= now - timedelta(seconds=row.min_spacing)))
    if PeriodicTask.update(last_run=now).where(condition).execute() == 1:
        return True
    PeriodicTask.update(dropped_count=PeriodicTask.dropped_count + 1).where(
        PeriodicTask.id == row.id).execute()
    log.info("periodic task %r: task dropped at start: the previous one started at %s, less "
             "than %gs ago", row.name, row.last_run, row.min_spacing)
    return False


