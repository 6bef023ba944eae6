"""Durable execution (DESIGN "Durable execution", rule 10): checkpoints, steps that run once,
durable sleep and events — the statements, and `DurableRun`, the durable side of one run
behind a handler's ``run``.

- A **checkpoint** is a JSON value on the task (``task_queue.checkpoint``), written with the
  run's progress in one transaction, conditional on the run still being its runner's; every
  later attempt starts from it (``run.resumed_from``).
- A **step** is a row of ``task_steps``, unique per (task, name). It is inserted after the
  step's function returned, in one transaction; a step run ``in_transaction`` calls its
  function inside that same transaction, with its connection, so what the function writes
  to this database commits together with the step's record or not at all (exactly once).
  A step recorded is never run again: every later attempt reads its result.
- **Sleep** and **events**: the run ends ``waiting`` (`errors.Waiting`, stored by
  lifecycle's end) and the task's next run is created at its time (the maintainer's pass,
  through next_run_on) or at once by `send_event`. A sleep's end, an event's deadline and
  the event consumed are recorded as steps too, so a resumed attempt replays them instead
  of starting them again; the N-th wait for one name in an attempt is a step of its own
  (``event-N:NAME``) and takes the N-th event of that name.
- **Code versions** (docs: "Changing durable code under running work"): the first durable
  record of a task writes, in its transaction, the version of its runner's code
  (``task_queue.code_version``; a plain job writes nothing). ``run.patched(NAME)`` answers
  whether the task takes a new code path, recorded as the step ``patch:NAME``: False when
  the task started under other code and this attempt still replays what that code recorded
  (steps not met again yet, or a checkpoint), True otherwise.

Everything here rides out a database outage (store.outage): a handler never sees a
database error from these calls.
"""
import hashlib
import json
from datetime import datetime, timedelta, timezone

import peewee as pw

from . import lifecycle
from .. import tracing
from ..errors import (EventTimeout, InputError, StateError, TaskError, TaskNotFound, Waiting,
                      check_text)
from ..store import outage
from ..store.models import LARGEST_ID, RUNNING, WAITING, as_utc, utcnow

# Step kinds: a function's result, the end of a sleep, an event consumed (or timed out), the
# deadline of a wait for an event, the answer of `run.patched` (``patch:NAME``).
STEP, SLEEP, EVENT, DEADLINE, PATCH = "step", "sleep", "event", "deadline", "patch"
# The names of steps that record tasks a run added (``add:...``) and how the tasks it
# waited for ended (``join-N``).
ADD, JOIN = "add", "join"
NAME_LIMIT = 200        # characters of a step's or an event's name
NOT_SENT = object()


def encode(value, what, max_size=None):
    """`value` as JSON text; TaskError naming `what` when it is not JSON (code NotJSON) or
    over `max_size` bytes ([task] max_result_size; code TooLarge): every later attempt reads
    a step's result back, and a table row is no place for a file. The records the engine
    makes itself (deadlines, the outcomes of tasks waited for) are not capped."""
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TaskError("%s is not JSON-serialisable: %s" % (what, exc), code="NotJSON") \
            from None
    size = len(text.encode("utf-8"))
    if max_size is not None and size > max_size:
        raise TaskError("%s is %d bytes of JSON, over [task] max_result_size (%d): store "
                        "large data elsewhere and return a reference" % (what, size, max_size),
                        code="TooLarge")
    return text


def _decoded(text):
    return None if text is None else json.loads(text)


def check_name(what, name):
    """InputError unless `name` is a non-empty text of at most NAME_LIMIT characters."""
    return check_text(what, name, NAME_LIMIT, empty=False)


# -- the statements --------------------------------------------------------------------------

def save_checkpoint(store, run_id, task_id, runner_id, text, percent, at):
    """Inside the caller's write transaction: the run's progress (and updated_on, which its
    run_timeout counts from) and the task's checkpoint `text`. False when the run is no
    longer this runner's.
    Race closed: an attempt whose run was taken away (timed out; its task resumed elsewhere)
    writing over the newer attempt's checkpoint — the run's UPDATE is conditional (rule 4)
    and the task is written only when it matched."""
    Run, Task = store.Run, store.Task
    values = {Run.updated_on: at}
    if percent is not None:
        values[Run.percent_completed] = percent
    if not Run.update(values).where((Run.id == run_id) & (Run.status == RUNNING)
                                    & (Run.runner_id == runner_id)).execute():
        return False
    Task.update(checkpoint=text, checkpoint_on=at).where(Task.id == task_id).execute()
    return True


def read_state(store, task_id):
    """(checkpoint text, {name: (kind, result text)}, code version) of a task: what an
    attempt resumes from and the version of the code the task started under, in two reads of
    indexes (the task's primary key, the steps' unique index)."""
    Task, Step = store.Task, store.Step
    row = Task.select(Task.checkpoint, Task.code_version).where(Task.id == task_id).first()
    steps = {name: (kind, result) for name, kind, result in Step.select(
        Step.name, Step.kind, Step.result).where(Step.task_id == task_id).tuples()}
    if row is None:
        return None, steps, None
    return row.checkpoint, steps, row.code_version


def record_code_version(store, task_id, code_version):
    """Inside the transaction of a task's first durable record: the version of the code it
    started under, unless one is recorded already (another attempt's, racing)."""
    Task = store.Task
    Task.update(code_version=code_version).where(
        (Task.id == task_id) & Task.code_version.is_null()).execute()


def insert_step(store, task_id, name, kind, run_id, attempt, result, started_on, at):
    """Inside the caller's transaction: the step's record. IntegrityError when the task has a
    step of that name already (rule 10: the unique index on (task_id, name))."""
    Step = store.Step
    Step.insert({Step.task_id: task_id, Step.name: name, Step.kind: kind, Step.run_id: run_id,
                 Step.attempt: attempt, Step.result: result, Step.started_on: started_on,
                 Step.finished_on: at}).execute()


def stored_step(store, task_id, name):
    """(kind, result text) of the task's step `name`, or None."""
    Step = store.Step
    return Step.select(Step.kind, Step.result).where(
        (Step.task_id == task_id) & (Step.name == name)).tuples().first()


def consume_event(store, task_id, name, run_id, at):
    """Inside the caller's write transaction: the oldest event `name` of the task not
    consumed yet becomes consumed by `run_id`; returns its payload text, or NOT_SENT.
    Race closed: two attempts taking one event — the locking read, and the UPDATE is
    conditional on the event still unconsumed (the step's unique index backs it)."""
    Event = store.Event
    row = store.locked(Event.select(Event.id, Event.payload).where(
        (Event.task_id == task_id) & (Event.name == name) & Event.consumed_on.is_null())
        .order_by(Event.id).limit(1)).first()
    if row is None or not Event.update(consumed_on=at, consumed_by=run_id).where(
            (Event.id == row.id) & Event.consumed_on.is_null()).execute():
        return NOT_SENT
    return row.payload


def send_event(store, task_id, name, payload=None, now=None):
    """Store the event `name` (its JSON `payload`) for the task; when the task is
    ``waiting`` for that event, its run is created in the same transaction (and the runners
    woken after it). An event the task does not wait for yet is kept: the task's next
    ``run.wait_for(name)`` consumes it (the events of a name in the order sent, one per
    wait). Returns whether the task was woken. TaskNotFound for an unknown task, StateError
    for one that has ended.
    Race closed: the event and a run ending ``waiting`` for it — both lock the task row
    first; the one that comes second sees the other (lifecycle._wait)."""
    check_name("event name", name)
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise InputError("a task id is an integer, not %r" % (task_id,))
    if not 0 < task_id <= LARGEST_ID:
        raise TaskNotFound("no task with id %d" % task_id)
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InputError("event payload is not JSON-serialisable: %s" % exc) from None
    if len(text.encode("utf-8")) > store.config.task.max_data_size:
        raise InputError("event payload is over [task] max_data_size (%d bytes)"
                         % store.config.task.max_data_size)
    at = store.database_time(now)
    Task, Event = store.Task, store.Event

    def step():
        task = store.locked(Task.select(Task.id, Task.last_status, Task.waiting_for,
                                        Task.finished_on).where(Task.id == task_id)).first()
        if task is None:
            raise TaskNotFound("no task with id %s" % task_id)
        if task.finished_on is not None:
            raise StateError("task %d has ended (%s): it takes no more events"
                             % (task.id, task.last_status))
        Event.insert({Event.task_id: task_id, Event.name: name, Event.payload: text,
                      Event.sent_on: at}).execute()
        if task.last_status == WAITING and task.waiting_for == name:
            lifecycle.wake_waiting(store, task_id, at)
            return True
        return False
    return store.write(step)


def forget_tasks(store, task_ids):
    """Inside the caller's transaction: the steps and events of deleted tasks."""
    if task_ids:
        store.Step.delete().where(store.Step.task_id.in_(list(task_ids))).execute()
        store.Event.delete().where(store.Event.task_id.in_(list(task_ids))).execute()


# -- one run's durable side ------------------------------------------------------------------

class DurableRun:
    """The durable side of one run (`RunContext` delegates to it): what the task resumed
    from, its steps, sleeps and waits. Made by the runner for each run; used by the
    handler's thread alone. `clock()`: this host's naive UTC now (run_pending's injected
    time); `stored()` is called after each write that proves the run alive."""

    def __init__(self, store, run_id, task_id, attempt, runner_id, clock=None,
                 code_version=None):
        self.store, self.run_id, self.task_id = store, run_id, task_id
        self.attempt, self.runner_id = attempt, runner_id
        self.clock = clock or utcnow
        # The version of the code running this attempt: its runner's (runner/versions.py).
        self.runner_version = code_version
        self.lost = False            # a checkpoint found the run no longer this runner's
        self._loaded = False
        self._resumed = None
        self._steps = {}
        self._started = None         # the version the task started under, once known
        self._unversioned = False    # the task has no record yet: the first writes its version
        self._earlier = frozenset()  # names of the steps earlier attempts recorded
        self._met = set()            # of those, the ones this attempt came back to
        self._calls = {}             # kind -> calls made this attempt (unnamed sleeps)
        self._waits = {}             # event name -> waits for it made this attempt

    def _through(self, fn):
        return outage.call_through(self.store.db, fn)[0]

    def _now(self):
        """This host's time on the database's clock."""
        return self.store.database_time(self.clock())

    def _load(self):
        if not self._loaded:
            text, self._steps, self._started = self._through(
                lambda: read_state(self.store, self.task_id))
            self._resumed = _decoded(text)
            # A task that recorded something before versions were (0032) keeps NULL: its
            # version is unknown, never this runner's.
            self._unversioned = self._started is None and text is None and not self._steps \
                and self.runner_version is not None
            self._earlier = frozenset(name for name, (kind, _) in self._steps.items()
                                      if kind != PATCH)
            self._loaded = True

    def _replayed(self, name):
        """The record of the step `name` (kind, result text), or None: the lookup by name of
        every call that may have been recorded by an earlier attempt."""
        found = self._steps.get(name)
        if found is not None:
            self._met.add(name)
        return found

    def _versioned(self):
        """Inside the transaction of a durable record: the task's version, the first time."""
        if self._unversioned:
            record_code_version(self.store, self.task_id, self.runner_version)

    def _wrote(self):
        """After the transaction of a durable record committed."""
        if self._unversioned:
            self._started, self._unversioned = self.runner_version, False

    @property
    def code_version(self):
        """The version of the code the task started under: the one recorded with its first
        durable record, or this runner's for a task that has none yet (the one it will
        record); None for a task that recorded something before versions were kept."""
        self._load()
        return self.runner_version if self._unversioned else self._started

    def patched(self, name):
        """Whether the task takes the new code path `name`: the answer is recorded (the step
        ``patch:NAME``) the first time, and every later attempt gets it. True unless the task
        started under other code and this attempt is replaying what that code recorded past
        this point — steps of earlier attempts it has not come back to yet, or a checkpoint
        it resumed from: that code went on without the patch, so the task keeps the old
        path. False for a task whose version is unknown (it recorded before 0032) on the
        same terms."""
        check_name("patch name", name)
        self._load()
        step = ("%s:%s" % (PATCH, name))[:NAME_LIMIT]
        found = self._replayed(step)
        if found is None:
            other_code = not self._unversioned and (self._started is None
                                                    or self._started != self.runner_version)
            replaying = bool(self._earlier - self._met) or self._resumed is not None
            self._record(step, PATCH, encode(not (other_code and replaying), "a patch"),
                         self._now())
            found = self._steps[step]
        return _decoded(found[1])

    @property
    def resumed_from(self):
        self._load()
        return self._resumed

    def checkpoint(self, value, percent=None):
        self._load()
        text = encode(value, "the checkpoint", self.store.config.task.max_result_size)
        if percent is not None:
            percent = max(0, min(100, int(percent)))
        def transaction():
            if not save_checkpoint(self.store, self.run_id, self.task_id, self.runner_id,
                                   text, percent, self._now()):
                return False
            self._versioned()
            return True
        mine = self._through(lambda: self.store.write(transaction))
        if not mine:
            self.lost = True
        else:
            self._wrote()
        return mine

    def idempotency_key(self, name):
        """A key stable for the task's step `name` on every attempt: taskrunner-TASK-NAME,
        the name hashed when it is not plain ASCII or is long."""
        check_name("step name", name)
        plain = name if name.isascii() and name.isprintable() and len(name) <= 64 \
            else hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
        return "taskrunner-%d-%s" % (self.task_id, plain)

    def step(self, name, fn, args, kwargs, in_transaction=False):
        check_name("step name", name)
        self._load()
        found = self._replayed(name)
        if found is not None:
            if tracing.active():
                tracing.step_replayed(name)
            return _decoded(found[1])
        if tracing.active():
            with tracing.step_span(name, self.task_id):
                return self._run_step(name, fn, args, kwargs, in_transaction)
        return self._run_step(name, fn, args, kwargs, in_transaction)

    def _run_step(self, name, fn, args, kwargs, in_transaction):
        started = self._now()
        if in_transaction:
            return self._record_with(name, STEP, lambda conn: fn(conn, *args, **kwargs),
                                     started)
        value = fn(*args, **kwargs)
        return self._record(name, STEP, encode(value, "the result of step %r" % name,
                                               self.store.config.task.max_result_size),
                            started)

    def _record(self, name, kind, text, started):
        """Record a step whose value is known; the value recorded first wins (another
        attempt's, when this one lost its run meanwhile)."""
        return self._record_with(name, kind, lambda conn: None, started, text)

    def _record_with(self, name, kind, body, started, text=None):
        """In one write transaction: body(the connection) — its value is the step's result
        unless `text` is given — and the step's record; returns the step's result. When
        the task has the step already (recorded by another attempt meanwhile), the
        transaction rolls back, body's writes with it, and the stored result is returned."""
        store = self.store

        def transaction():
            value = body(store.db.connection())
            recorded = text if text is not None else encode(
                value, "the result of step %r" % name, store.config.task.max_result_size)
            insert_step(store, self.task_id, name, kind, self.run_id, self.attempt,
                        recorded, started, self._now())
            self._versioned()
            return recorded
        try:
            recorded = self._through(lambda: store.write(transaction))
            self._wrote()
        except pw.IntegrityError:
            found = self._through(lambda: stored_step(store, self.task_id, name))
            if found is None:
                raise          # the body's own write broke a constraint
            recorded = found[1]
            kind = found[0]
        self._steps[name] = (kind, recorded)
        return _decoded(recorded)

    def add(self, label, insert):
        """Tasks this run adds, exactly once: ``insert()`` adds them through this store and
        returns their ids (JSON), inside the transaction that records the step
        ``add:LABEL`` — ``add-2:LABEL``, ``add-3:LABEL``, ... for the same label again in
        this attempt, in call order. `label` names what is added (a function task and a
        digest of its arguments and options): a later attempt that makes the same call gets
        the recorded ids and adds nothing, whatever the calls around it; a call with other
        arguments adds its own task. Inside a transaction of the handler's own
        (``transaction_step``), whose record makes the adds exactly once already,
        ``insert()`` simply joins it."""
        if self.store.db.in_transaction():
            return insert()
        self._load()
        count = self._calls[(ADD, label)] = self._calls.get((ADD, label), 0) + 1
        step = ("%s:%s" % (ADD if count == 1 else "%s-%d" % (ADD, count), label))[:NAME_LIMIT]
        found = self._replayed(step)
        if found is not None:
            return _decoded(found[1])
        return self._record_with(step, STEP, lambda conn: insert(), self._now())

    def join(self, task_ids, read):
        """How the tasks `task_ids` ended, once all have: ``read(ids)`` gives {id: a JSON
        outcome, or None while the task has not ended}. Recorded as the step ``join-N`` the
        first time all have ended, so every later attempt gets the same outcomes; until
        then the run ends ``waiting`` for those that have not (errors.Waiting: the last of
        them to end gives the task its next run, holding no runner meanwhile)."""
        self._load()
        step = self._ordinal_name(JOIN, None)
        if self._replayed(step) is None:
            outcomes = self._through(lambda: read(list(task_ids)))
            pending = [task_id for task_id in task_ids if outcomes.get(task_id) is None]
            if pending:
                raise Waiting(tasks=pending, message="waiting for %d task%s: %s" % (
                    len(pending), "" if len(pending) == 1 else "s",
                    ", ".join(map(str, pending[:10])) + (" ..." if len(pending) > 10 else "")))
            self._record(step, STEP, encode([outcomes[task_id] for task_id in task_ids],
                                            "the outcomes of the tasks waited for"),
                         self._now())
        return _decoded(self._steps[step][1])

    def _ordinal_name(self, kind, name):
        if name is not None:
            return check_name("%s name" % kind, name)
        count = self._calls[kind] = self._calls.get(kind, 0) + 1
        return "%s-%d" % (kind, count)

    def sleep(self, seconds=None, until=None, name=None):
        """Return when the sleep's end has come; else end the run ``waiting`` until then
        (raises errors.Waiting). The end is recorded as a step the first time, so a resumed
        attempt that comes back to this call goes on."""
        if (seconds is None) == (until is None):
            raise InputError("run.sleep takes seconds or until=, one of them")
        if until is not None and (not isinstance(until, datetime) or until.tzinfo is None):
            raise InputError("run.sleep(until=...) takes an aware datetime, not %r" % (until,))
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(
                seconds, (int, float)) or not 0 <= seconds <= 3153600000):
            raise InputError("run.sleep takes a number of seconds, not %r" % (seconds,))
        step = self._ordinal_name(SLEEP, name)
        self._load()
        found = self._replayed(step)
        if found is not None:
            end = _time(_decoded(found[1])["until"])
        else:
            end = as_utc(until) if until is not None else self._now() + timedelta(
                seconds=seconds)
            end = _time(self._record(step, SLEEP, encode({"until": _iso(end)}, "until"),
                                     self._now())["until"])
        if end <= self._now():
            return
        raise Waiting(until=end - self.store.clock_offset(), message="sleeping until %s"
                      % _iso(end))

    def wait_for(self, name, timeout=None):
        """The payload of an event `name` sent to the task (TaskQueue.send_event), consumed
        once: recorded as a step, so every later attempt gets the same payload. The N-th
        wait for `name` in an attempt (in call order) is the step ``event:NAME`` for the
        first, ``event-N:NAME`` after it (as ``sleep-N``; a prefix, so that no other name's
        first wait has the same step name), and takes the oldest event of that name no
        earlier wait consumed: the N-th one sent, when no wait before it timed out. Until it
        comes, the run ends ``waiting`` (errors.Waiting); after `timeout` seconds (counted
        from that wait's first call, on any attempt: the step ``deadline:NAME`` or
        ``deadline-N:NAME``) EventTimeout."""
        check_name("event name", name)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not 0 <= timeout <= 3153600000):
            raise InputError("run.wait_for(timeout=...) takes seconds, not %r" % (timeout,))
        self._load()
        count = self._waits[name] = self._waits.get(name, 0) + 1
        ordinal = "" if count == 1 else "-%d" % count     # the first keeps its stored name
        step = "event%s:%s" % (ordinal, name)
        if self._replayed(step) is None:
            deadline = None
            if timeout is not None:
                key = "deadline%s:%s" % (ordinal, name)
                found = self._replayed(key)
                if found is not None:
                    deadline = _time(_decoded(found[1])["until"])
                else:
                    deadline = _time(self._record(key, DEADLINE, encode({"until": _iso(
                        self._now() + timedelta(seconds=timeout))}, "until"),
                        self._now())["until"])
            self._consume(step, name, deadline)
        outcome = _decoded(self._steps[step][1])
        if outcome.get("timeout"):
            raise EventTimeout("event %r did not come within its timeout" % name)
        return outcome.get("payload")

    def _consume(self, step, name, deadline):
        """Record the event `name` as the step `step` when it was sent, or its timeout when
        `deadline` has passed; else end the run waiting for it."""
        store, started = self.store, self._now()

        def body(conn):
            payload = consume_event(store, self.task_id, name, self.run_id, self._now())
            if payload is not NOT_SENT:
                return {"payload": _decoded(payload)}
            if deadline is not None and deadline <= self._now():
                return {"timeout": True}
            raise _NoEvent()
        try:
            self._record_with(step, EVENT, body, started)
        except _NoEvent:
            until = None if deadline is None else deadline - store.clock_offset()
            raise Waiting(until=until, event=name, message="waiting for event %r%s" % (
                name, "" if deadline is None else " until %s" % _iso(deadline))) from None


class _NoEvent(Exception):
    """Rolls back a wait's transaction when its event has not come."""


def _iso(when):
    return when.replace(tzinfo=timezone.utc).isoformat()


def _time(text):
    return as_utc(datetime.fromisoformat(text))
