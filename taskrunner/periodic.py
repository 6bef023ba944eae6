"""Periodic tasks and the PeriodicScheduler that submits them (the Docspell ADR), with
Nuntium's owner, min_spacing and timebox, and rule 9: a due time yields at most one task,
however many schedulers run against one database.

Timers are systemd calendar events (``Mon..Fri *-*-* 07:30 Europe/Berlin``) or fixed
intervals written as time spans (``every 30s``, ``every 1h 30min``), anchored to the
previous due time so they do not drift.

A pass: take the earliest enabled due periodic task; mark it (a conditional update: only
one scheduler wins; the others try the next); then, in one transaction, submit its task
(or skip this occurrence while the previous task is unfinished), advance nextrun, unmark.
Missed due times after downtime collapse into one task (catch_up ``once``) or none
(``skip``: an occurrence more than MISFIRE_GRACE late is dropped).
"""
import json
import logging
import math
import os
from datetime import timedelta, timezone

import peewee as pw

from . import lifecycle, liveness
from .calendar import CalendarError, parse_calendar
from .config import check_queue_name
from .enqueue import add_task
from .errors import InputError, StateError
from .handler import check_handler_path, encode_data, load_handler
from .models import CANCELLED, CRASHED, DEFAULT_QUEUE, SUCCESS, utcnow
from .timespan import parse_timespan

log = logging.getLogger("taskrunner.periodic")

CATCH_UP = ("once", "skip")
BUILTIN_ROTATION = "taskrunner.rotate"


class IntervalTimer:
    """``every SPAN``: due times anchor + k * interval."""

    def __init__(self, seconds, text):
        self.seconds = seconds
        self.normalized = "every %s" % text

    def next_after(self, base, anchor=None):
        if anchor is None or anchor > base:
            return base + timedelta(seconds=self.seconds) if anchor is None else anchor
        steps = math.floor((base - anchor).total_seconds() / self.seconds) + 1
        return anchor + timedelta(seconds=steps * self.seconds)


class CalendarTimer:
    def __init__(self, event):
        self.event = event
        self.normalized = event.normalized

    def next_after(self, base, anchor=None):
        elapse = self.event.next_after(base.replace(tzinfo=timezone.utc))
        return None if elapse is None else elapse.astimezone(timezone.utc).replace(tzinfo=None)


def parse_timer(text):
    """A timer from its text; InputError says what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("invalid timer %r: expected a calendar event or 'every SPAN'" % (text,))
    stripped = text.strip()
    if stripped.lower().startswith("every "):
        span = stripped[6:].strip()
        try:
            seconds = parse_timespan(span)
        except ValueError as exc:
            raise InputError("invalid timer %r: %s" % (text, exc)) from None
        if seconds < 1:
            raise InputError("invalid timer %r: the interval must be at least 1s" % text)
        return IntervalTimer(seconds, span)
    try:
        return CalendarTimer(parse_calendar(stripped))
    except CalendarError as exc:
        raise InputError("invalid timer %r: %s" % (text, exc)) from None


# -- definitions --------------------------------------------------------------------------

# The derived queued_by "periodic:NAME" must fit its 255-character column.
MAX_NAME = 255 - len("periodic:")


def _definition(config, spec, where, import_handler=True):
    """Validate one definition (API, CLI or config) into row values; InputError on bad
    input. Without `import_handler` the handler path is checked but not imported."""
    known = {"name", "handler", "timer", "data", "priority", "enabled", "catch_up",
             "max_runtime", "min_spacing", "max_retries", "owner", "submitter", "queue"}
    unknown = set(spec) - known
    if unknown:
        raise InputError("%s: unknown key %s" % (where, ", ".join(sorted(unknown))))
    for key in ("name", "handler", "timer"):
        if not isinstance(spec.get(key), str) or not spec[key].strip():
            raise InputError("%s: %s is required (a string)" % (where, key))
    name = spec["name"].strip()
    if len(name) > MAX_NAME:
        raise InputError("%s: name is longer than %d characters" % (where, MAX_NAME))
    for key in ("owner", "submitter"):
        if spec.get(key) is not None and (not isinstance(spec[key], str) or len(spec[key]) > 255):
            raise InputError("%s: %s must be a string of at most 255 characters" % (where, key))
    if import_handler:
        load_handler(spec["handler"], config.handlers.allow)
    else:
        check_handler_path(spec["handler"], config.handlers.allow)
    timer = parse_timer(spec["timer"])
    catch_up = spec.get("catch_up", "once")
    if catch_up not in CATCH_UP:
        raise InputError("%s: catch_up must be 'once' or 'skip'" % where)
    values = {"name": name, "handler": spec["handler"], "timer": spec["timer"].strip(),
              "data": encode_data(spec.get("data"), config.task.max_data_size),
              "priority": spec.get("priority", 0), "enabled": spec.get("enabled", True),
              "catch_up": catch_up, "owner": spec.get("owner"), "submitter": spec.get("submitter"),
              "max_retries": spec.get("max_retries"),
              "queue": check_queue_name(spec.get("queue", DEFAULT_QUEUE),
                                        "%s: queue" % where)}
    if isinstance(values["priority"], bool) or not isinstance(values["priority"], int):
        raise InputError("%s: priority must be an integer" % where)
    if not isinstance(values["enabled"], bool):
        raise InputError("%s: enabled must be true or false" % where)
    retries = values["max_retries"]
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)
                                or retries < 1):
        raise InputError("%s: max_retries must be an integer of at least 1" % where)
    for key in ("max_runtime", "min_spacing"):
        value = spec.get(key)
        if value is not None:
            try:
                value = parse_timespan(value)
            except ValueError as exc:
                raise InputError("%s: %s: %s" % (where, key, exc)) from None
            if key == "max_runtime" and value <= 0:
                raise InputError("%s: max_runtime must be greater than zero" % where)
        values[key] = value
    return values, timer


def _first_due(timer, now):
    return timer.next_after(now, anchor=now if isinstance(timer, IntervalTimer) else None)


def add_periodic(store, name, handler, timer, data=None, source="api", now=None, **options):
    """Create a periodic task; InputError for a bad timer, handler or a duplicate name."""
    now = now or utcnow()
    if options.get("queue") is None:
        # Added here, the handler is imported: its class's queue applies (a [[periodic]]
        # entry of the config names its queue, since the overseer imports no handler).
        options["queue"] = load_handler(handler, store.config.handlers.allow).queue \
            or DEFAULT_QUEUE
    values, parsed = _definition(store.config, dict(name=name, handler=handler, timer=timer,
                                                    data=data, **options), "periodic task %r" % name)
    try:
        with store.db.atomic():
            return store.PeriodicTask.create(nextrun=_first_due(parsed, now), created=now,
                                       updated_on=now, source=source, **values)
    except pw.IntegrityError:
        raise InputError("a periodic task named %r already exists" % values["name"]) from None


def _get(store, name, owner=None):
    PeriodicTask = store.PeriodicTask
    row = PeriodicTask.get_or_none(PeriodicTask.name == name)
    if row is None or (owner is not None and row.owner != owner):
        raise InputError("no periodic task named %r%s" % (name, " owned by %r" % owner if owner else ""))
    return row


def set_enabled(store, name, enabled, owner=None, now=None):
    PeriodicTask = store.PeriodicTask
    row = _get(store, name, owner)
    now = now or utcnow()
    values = {PeriodicTask.enabled: enabled, PeriodicTask.updated_on: now}
    if enabled and not row.enabled:
        values[PeriodicTask.nextrun] = _first_due(parse_timer(row.timer), now)
    PeriodicTask.update(values).where(PeriodicTask.id == row.id).execute()


def remove_periodic(store, name, owner=None):
    """Delete a periodic task (its submitted tasks stay)."""
    PeriodicTask = store.PeriodicTask
    PeriodicTask.delete().where(PeriodicTask.id == _get(store, name, owner).id).execute()


def sync_definitions(store, config=None, now=None, import_handlers=True):
    """Bring the rows that came from the config (its ``[[periodic]]`` tables and the built-in
    rotation task) in line with it: add new ones, update changed ones, disable those no
    longer in the file. Rows added through the API or CLI are never touched. Everything is
    validated first: one bad entry changes nothing."""
    PeriodicTask = store.PeriodicTask
    config = config or store.config
    now = now or utcnow()
    entries = [dict(d) for d in config.periodic]
    entries.append({"name": BUILTIN_ROTATION, "handler": "taskrunner.handlers.Rotate",
                    "timer": config.rotation.timer, "submitter": "taskrunner"})
    validated = {}
    for index, spec in enumerate(entries):
        where = "[[periodic]] #%d (%s)" % (index + 1, spec.get("name", "no name"))
        values, timer = _definition(config, spec, where, import_handlers)
        if values["name"] in validated:
            raise InputError("%s: duplicate name %r" % (where, values["name"]))
        validated[values["name"]] = (values, timer)

    def step():
        existing = {r.name: r for r in PeriodicTask.select()}
        for name, (values, timer) in validated.items():
            row = existing.get(name)
            if row is None:
                PeriodicTask.create(nextrun=_first_due(timer, now), created=now, updated_on=now,
                                    source="config", **values)
            elif row.source != "config":
                log.warning("periodic task %r exists and was not created from the config; "
                            "the config entry is ignored", name)
            else:
                changed = {k: v for k, v in values.items() if getattr(row, k) != v}
                if name == BUILTIN_ROTATION:
                    changed.pop("enabled", None)  # an operator's enable/disable stands
                if changed.get("timer") or ("enabled" in changed and values["enabled"]):
                    changed["nextrun"] = _first_due(timer, now)
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
        self.worker = "%s:%d:%.3f" % (liveness.hostname(), pid, liveness.create_time(pid))

    def clear_stale_marks(self, now=None):
        """Marks of schedulers that died (same host: their PID is gone) or older than
        STALE_MARK. A mark lives for one short transaction, so these are leftovers."""
        PeriodicTask = self.store.PeriodicTask
        now = now or utcnow()
        cleared = PeriodicTask.update(worker=None, marked=None).where(
            PeriodicTask.marked < now - self.STALE_MARK).execute()
        host = liveness.hostname()
        for row in PeriodicTask.select(PeriodicTask.id, PeriodicTask.worker).where(
                PeriodicTask.worker.startswith(host + ":")):
            _, pid, created = row.worker.rsplit(":", 2)
            if not liveness.process_alive(int(pid), float(created)):
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

    def run_pending(self, now=None):
        """One pass: handle every due periodic task. Returns {"submitted": [task ids],
        "skipped": [names]}."""
        PeriodicTask = self.store.PeriodicTask
        now = now or utcnow()
        result = {"submitted": [], "skipped": []}
        tried = set()
        while True:
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
            timer = parse_timer(row.timer)
        except InputError as exc:
            log.error("periodic task %r disabled: %s", row.name, exc)
            PeriodicTask.update(enabled=False, worker=None, marked=None, last_status="error"
                                ).where(PeriodicTask.id == row.id).execute()
            return
        following = timer.next_after(due, anchor=due)
        if following is not None and following <= now:
            following = timer.next_after(now, anchor=due)  # missed due times: catch up once

        def step():
            values = {PeriodicTask.nextrun: following, PeriodicTask.worker: None,
                      PeriodicTask.marked: None, PeriodicTask.last_due: due,
                      PeriodicTask.updated_on: now}
            reason = self._skip_reason(row, due, now)
            if reason:
                values[PeriodicTask.skipped_count] = PeriodicTask.skipped_count + 1
            else:
                task_id = add_task(
                    self.store, row.handler, data=json.loads(row.data),
                    scheduled_on=due.replace(tzinfo=timezone.utc),
                    priority=row.priority, max_runtime=row.max_runtime, queue=row.queue,
                    max_retries=row.max_retries, queued_by=row.submitter or "periodic:" + row.name,
                    periodic_task_id=row.id, now=now, import_handler=False)
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
        if reason:
            log.info("periodic task %r: due time %s skipped: %s", row.name, due, reason)
            result["skipped"].append(row.name)
        else:
            log.info("periodic task %r: submitted task %d for %s", row.name, task_id, due)
            result["submitted"].append(task_id)

    def _skip_reason(self, row, due, now):
        if row.catch_up == "skip" and due < now - self.MISFIRE_GRACE:
            return "missed while no scheduler ran (catch_up = skip)"
        Task = self.store.Task
        unfinished = Task.select(Task.id).where(
            (Task.periodic_task_id == row.id) & Task.finished_on.is_null()
            & (Task.last_status != CANCELLED)).first()
        if unfinished is not None:
            return "task %d of the previous due time is unfinished" % unfinished.id
        return None


def record_outcome(store, periodic_task_id, status, now, error_code=None):
    """After a run of one of its tasks ended: the periodic task's last status, consecutive
    failures and crashes (a hook of the run lifecycle)."""
    PeriodicTask = store.PeriodicTask
    values = {PeriodicTask.last_status: status, PeriodicTask.updated_on: now}
    if error_code == CRASHED:
        values[PeriodicTask.crash_count] = PeriodicTask.crash_count + 1
    if status == SUCCESS:
        values[PeriodicTask.consecutive_failures] = 0
    elif status != CANCELLED:
        values[PeriodicTask.consecutive_failures] = PeriodicTask.consecutive_failures + 1
    PeriodicTask.update(values).where(PeriodicTask.id == periodic_task_id).execute()


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
    return PeriodicTask.update(last_run=now).where(condition).execute() == 1


