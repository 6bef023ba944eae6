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
import json
import logging
import os
from datetime import timedelta, timezone

import peewee as pw

from ..runs import lifecycle
from ..fleet import liveness
from ..runs.enqueue import add_task
from ..errors import InputError, StateError, check_text
from ..handler import load_handler
from ..store.models import CANCELLED, CRASHED, DEFAULT_QUEUE, SUCCESS, utcnow
from .definitions import (BUILTIN_ROTATION, CATCH_UP, MAX_NAME, RESERVED_PREFIX, check_periodic,
                          check_periodic_handlers, definition, first_due, validate_definitions)
from .timers import IntervalTimer, parse_timer

log = logging.getLogger("taskrunner.periodic")

def add_periodic(store, name, handler, timer, data=None, source="api", now=None, **options):
    """Create a periodic task; InputError for a bad timer, handler or a duplicate name."""
    now = now or utcnow()
    if options.get("queue") is None:
        # Added here, the handler is imported: its class's queue applies (a [[periodic]]
        # entry of the config names its queue, since the overseer imports no handler).
        options["queue"] = load_handler(handler, store.config.handlers.allow).queue \
            or DEFAULT_QUEUE
    values, parsed = check_periodic(store.config, name, handler, timer, data, **options)
    try:
        with store.db.atomic():
            return store.PeriodicTask.create(nextrun=first_due(parsed, now), created=now,
                                       updated_on=now, source=source, **values)
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
    now = now or utcnow()
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
        PeriodicTask.update({PeriodicTask.submitted_count: PeriodicTask.submitted_count + 1,
                             PeriodicTask.last_task_id: task_id, PeriodicTask.updated_on: now}
                            ).where(PeriodicTask.id == row.id).execute()
        return task_id
    return store.write(step)


def set_enabled(store, name, enabled, owner=None, now=None):
    PeriodicTask = store.PeriodicTask
    row = _get(store, name, owner)
    now = now or utcnow()
    values = {PeriodicTask.enabled: enabled, PeriodicTask.updated_on: now}
    if enabled and not row.enabled:
        values[PeriodicTask.nextrun] = first_due(parse_timer(row.timer, row.timezone), now)
    PeriodicTask.update(values).where(PeriodicTask.id == row.id).execute()


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
    now = now or utcnow()

    def step():
        rows = list(PeriodicTask.select(PeriodicTask.id, PeriodicTask.timer, PeriodicTask.timezone)
                    .where((PeriodicTask.owner == owner) & (PeriodicTask.enabled != enabled)))
        for row in rows:
            values = {PeriodicTask.enabled: enabled, PeriodicTask.updated_on: now}
            if enabled:
                values[PeriodicTask.nextrun] = first_due(parse_timer(row.timer, row.timezone), now)
            PeriodicTask.update(values).where(PeriodicTask.id == row.id).execute()
        return len(rows)
    return store.write(step)


def sync_definitions(store, config=None, now=None, import_handlers=True):
    """Bring the rows that came from the config (its ``[[periodic]]`` tables and the built-in
    rotation task) in line with it: add new ones, update changed ones, disable those no
    longer in the file. Rows added through the API or CLI are never touched. Everything is
    validated first: one bad entry changes nothing."""
    PeriodicTask = store.PeriodicTask
    config = config or store.config
    now = now or utcnow()
    validated = validate_definitions(config, import_handlers)

    def step():
        existing = {r.name: r for r in PeriodicTask.select()}
        for name, (values, timer) in validated.items():
            row = existing.get(name)
            if row is None:
                PeriodicTask.create(nextrun=first_due(timer, now), created=now, updated_on=now,
                                    source="config", **values)
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
                    changed["nextrun"] = first_due(timer, now)
                elif "enabled" in changed and values["enabled"]:
                    changed["nextrun"] = first_due(parse_timer(row.timer, row.timezone), now)
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

class PeriodicScheduler:
    """Submits the tasks of due periodic tasks; safe with any number of schedulers."""

    STALE_MARK = timedelta(seconds=60)
    MISFIRE_GRACE = timedelta(seconds=5)

    def __init__(self, store):
        self.store = store
        pid = os.getpid()
        self.worker = "%s:%d:%.3f" % (liveness.host_id(store), pid, liveness.create_time(pid))

    def clear_stale_marks(self, now=None):
        """Marks of schedulers that died — on this host, their PID is gone; on another, their
        runner row has ended (a sweep found their heartbeat too old, or they retired) — or
        older than STALE_MARK. A mark lives for one short transaction, so these are
        leftovers: a holder killed between its mark and its submission would otherwise hold
        that periodic task back for STALE_MARK after the next holder took over. Clearing the
        mark of a scheduler that still lives costs nothing but its due time: its submission
        is conditional on its mark (rule 9)."""
        PeriodicTask = self.store.PeriodicTask
        now = now or utcnow()
        cleared = PeriodicTask.update(worker=None, marked=None).where(
            PeriodicTask.marked < now - self.STALE_MARK).execute()
        host = liveness.host_id(self.store)
        for row in PeriodicTask.select(PeriodicTask.id, PeriodicTask.worker).where(
                PeriodicTask.worker.is_null(False)):
            worker_host, pid, created = row.worker.rsplit(":", 2)
            if worker_host == host:
                gone = not liveness.process_alive(int(pid), float(created))
            else:
                gone = liveness.process_ended(self.store, worker_host, int(pid), float(created))
            if gone:
                cleared += PeriodicTask.update(worker=None, marked=None).where(
                    (PeriodicTask.id == row.id) & (PeriodicTask.worker == row.worker)).execute()
        if cleared:
            log.info("cleared %d stale periodic marks", cleared)
        return cleared

    def next_due(self):
        """The earliest nextrun of an enabled periodic task, or None."""
        PeriodicTask = self.store.PeriodicTask
        row = (PeriodicTask.select(pw.fn.MIN(PeriodicTask.nextrun).alias("due"))
               .where((PeriodicTask.enabled == True)  # noqa: E712
                      & PeriodicTask.marked.is_null()).get())
        return row.due

    def run_pending(self, now=None, until=None):
        """One pass: handle every due periodic task. Returns {"submitted": [task ids],
        "skipped": [names]}. `until`, asked before each due periodic task, ends the pass
        early when true; what is left stays due for the next pass (a burst of due times
        must not keep the maintainer from its other work, nor from a stop)."""
        PeriodicTask = self.store.PeriodicTask
        now = now or utcnow()
        result = {"submitted": [], "skipped": []}
        tried = set()
        while until is None or not until():
            query = (PeriodicTask.select().where(
                (PeriodicTask.enabled == True) & (PeriodicTask.nextrun <= now)  # noqa: E712
                & PeriodicTask.marked.is_null()).order_by(PeriodicTask.nextrun, PeriodicTask.id))
            if tried:
                query = query.where(PeriodicTask.id.not_in(list(tried)))
            candidate = query.first()
            if candidate is None:
                return result
            tried.add(candidate.id)
            if self._mark(candidate, now):
                self._fire(candidate, now, result)
        return result

    def _mark(self, row, now):
        """Race closed: two schedulers taking the same due time — the mark is a conditional
        update on (not marked, this nextrun); exactly one scheduler's update matches."""
        PeriodicTask = self.store.PeriodicTask
        return PeriodicTask.update(worker=self.worker, marked=now).where(
            (PeriodicTask.id == row.id) & PeriodicTask.marked.is_null()
            & (PeriodicTask.nextrun == row.nextrun)).execute() == 1

    def _fire(self, row, now, result):
        """Submit (or skip) the occurrence row.nextrun, advance nextrun and unmark — one
        transaction, so a scheduler dying midway leaves either nothing or all of it."""
        PeriodicTask = self.store.PeriodicTask
        due = row.nextrun
        try:
            timer = parse_timer(row.timer, row.timezone)
        except InputError as exc:
            log.error("periodic task %r disabled: %s", row.name, exc)
            PeriodicTask.update(enabled=False, worker=None, marked=None, last_status="error"
                                ).where(PeriodicTask.id == row.id).execute()
            return
        following = timer.next_after(due, anchor=due)
        if row.anchor == "now" and isinstance(timer, IntervalTimer) and not timer.after_finish:
            # Nuntium's nextRun = currentTime + interval: a late pass moves the grid with it.
            following = timer.next_after(now)
        elif following is not None and following <= now:
            following = timer.next_after(now, anchor=due)  # missed due times: catch up once

        def step():
            values = {PeriodicTask.nextrun: following, PeriodicTask.worker: None,
                      PeriodicTask.marked: None, PeriodicTask.last_due: due,
                      PeriodicTask.updated_on: now}
            wait = self._after_finish_wait(row, timer, now) if timer.after_finish else None
            if wait is not None:
                # Not an occurrence: look again when the previous task may have finished.
                values.update({PeriodicTask.nextrun: wait, PeriodicTask.last_due: row.last_due})
                if not PeriodicTask.update(values).where(
                        (PeriodicTask.id == row.id) & (PeriodicTask.worker == self.worker)
                        ).execute():
                    raise StateError("lost the mark of periodic task %r" % row.name)
                return "wait", wait
            reason = self._skip_reason(row, due, now)
            if reason:
                values[PeriodicTask.skipped_count] = PeriodicTask.skipped_count + 1
            else:
                task_id = add_task(
                    self.store, row.handler, data=json.loads(row.data),
                    scheduled_on=due.replace(tzinfo=timezone.utc),
                    priority=row.priority, max_runtime=row.max_runtime, queue=row.queue,
                    max_retries=row.max_retries, queued_by=row.submitter or "periodic:" + row.name,
                    periodic_task_id=row.id, now=now, import_handler=False,
                    subject=row.subject, group=row.group_name)
                values[PeriodicTask.submitted_count] = PeriodicTask.submitted_count + 1
                values[PeriodicTask.last_task_id] = task_id
            advanced = PeriodicTask.update(values).where(
                (PeriodicTask.id == row.id) & (PeriodicTask.worker == self.worker)).execute()
            if not advanced:
                raise StateError("lost the mark of periodic task %r" % row.name)
            return reason, None if reason else task_id
        try:
            reason, task_id = self.store.write(step)
        except StateError as exc:
            # Another scheduler took the mark over: the due time is its to submit.
            log.info("periodic task %r: %s", row.name, exc)
            return
        except (InputError, pw.IntegrityError, pw.DataError, pw.ProgrammingError) as exc:
            # Recorded on the periodic task; its next due time tries again.
            log.error("periodic task %r: due time %s not submitted: %s", row.name, due,
                      str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            PeriodicTask.update(worker=None, marked=None, nextrun=following, last_status="error"
                                ).where((PeriodicTask.id == row.id)
                                        & (PeriodicTask.worker == self.worker)).execute()
            return
        if reason == "wait":
            log.debug("periodic task %r: its previous task has not finished %gs ago; next "
                      "look at %s", row.name, timer.seconds, task_id)
        elif reason:
            log.info("periodic task %r: due time %s skipped: %s", row.name, due, reason)
            result["skipped"].append(row.name)
        else:
            log.info("periodic task %r: submitted task %d for %s", row.name, task_id, due)
            result["submitted"].append(task_id)

    def _skip_reason(self, row, due, now):
        if row.catch_up == "skip" and due < now - self.MISFIRE_GRACE:
            return "missed while no scheduler ran (catch_up = skip)"
        if row.tolerance is not None:
            return None  # Nuntium: submitted regardless; the check at start decides
        unfinished = unfinished_task(self.store, row.id)
        if unfinished is not None:
            return "task %d of the previous due time is unfinished" % unfinished.id
        return None

    def _after_finish_wait(self, row, timer, now):
        """An ``after SPAN`` timer: None when its task may be submitted now; otherwise when
        to look again — SPAN after the previous task finished, or SPAN from now while it is
        unfinished (its end moves nextrun to finish + SPAN: `record_outcome`)."""
        span = timedelta(seconds=timer.seconds)
        if unfinished_task(self.store, row.id) is not None:
            return now + span
        Task = self.store.Task
        finished = (Task.select(pw.fn.MAX(Task.finished_on).alias("last"))
                    .where(Task.periodic_task_id == row.id).get().last)
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
    but a cancel resets them) — a hook of the run lifecycle."""
    PeriodicTask = store.PeriodicTask
    values = {PeriodicTask.last_status: status, PeriodicTask.updated_on: now}
    if error_code == CRASHED:
        values[PeriodicTask.crash_count] = PeriodicTask.crash_count + 1
        values[PeriodicTask.consecutive_crashes] = PeriodicTask.consecutive_crashes + 1
    elif status != CANCELLED:
        values[PeriodicTask.consecutive_crashes] = 0
    if status == SUCCESS:
        values[PeriodicTask.consecutive_failures] = 0
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


lifecycle.on_outcome(record_outcome)


def allow_start(store, periodic_task_id, now=None):
    """Nuntium's tolerance, checked when a run starts: False (drop the task) when the
    previous task of this periodic task started less than min_spacing ago; otherwise record
    this start as last_run. Race closed: two runners starting two tasks of one periodic
    task — the check and the update are one conditional UPDATE."""
    PeriodicTask = store.PeriodicTask
    now = now or utcnow()
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


