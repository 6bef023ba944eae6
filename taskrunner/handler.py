"""Handlers: the classes that do the work of a task, and the `run` object they are given.

A handler is named by its dotted path (``myapp.tasks.SendDigest``). It must subclass
`TaskHandler` and, when ``[handlers] allow`` is set, match one of its glob patterns. The
allow-list is checked *before* importing, so a disallowed path never runs module code.
"""
import contextvars
import fnmatch
import importlib
import json
import logging
import os
import re
from datetime import datetime, timezone
import traceback
from typing import (TYPE_CHECKING, Any, Awaitable, Callable, Dict, Iterable, List, Mapping,
                    Optional, Protocol, Tuple, Union)

from .errors import HandlerError, TaskNotFound

if TYPE_CHECKING:
    from .reads.records import RunInfo, TaskInfo, TaskOutcome
    from .reads.workflows import ParentResults, WorkflowInfo

# Progress is part of the runner's conversation with the database: its warnings go there.
log = logging.getLogger("taskrunner.runner")

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


class TaskHandler:
    """Base class of every handler. Implement ``handle(self, run)``.

    One instance is made per run. Return normally for ``success``; raise for ``error``
    (``TaskError(message, code=...)`` to choose the error code). Long handlers should call
    ``run.progress(percent)`` now and then — it also proves the run is alive, since a run
    with no update for ``run_timeout`` seconds is marked ``timeout`` — and return early
    when ``run.should_stop()`` is true.

    ``async def handle(self, run)`` works too: the runner runs the coroutine to completion
    in an event loop of its own (``asyncio.run``); ``should_stop()``, ``max_runtime`` and
    the runner's signals behave as for a plain handler (an interrupt cancels the coroutine).

    Hooks, for error trackers and pagers: ``on_failure(run, exc)`` is called after a run of
    this handler ended ``error`` (it raised `exc`) or was interrupted as timed out;
    ``on_give_up(task)`` after such a failure made the task give up (a `TaskInfo`). They run
    in the runner, after the outcome is stored: an exception in a hook is logged and changes
    nothing. A run whose runner process died calls no hook (no process of its is left).

    ``queue``: the queue its tasks go to when ``add_task`` names none (else ``default``).
    """

    queue: Optional[str] = None

    def handle(self, run: "RunContext") -> Optional[Awaitable[None]]:
        raise NotImplementedError("%s.handle(run) is not implemented" % type(self).__name__)

    @classmethod
    def check_data(cls, data: Any) -> None:
        """Raise `InputError` when `data` cannot be this handler's task data; called as a
        task is added, before anything is stored (a function task checks the arguments
        against its signature). Accepts any JSON unless overridden."""

    def on_failure(self, run: "RunContext", exc: BaseException) -> None:
        """Called after a run of this handler failed; does nothing unless overridden."""

    def on_give_up(self, task: "TaskInfo") -> None:
        """Called after a failure made the task give up; does nothing unless overridden."""


def is_allowed(path, allow):
    return not allow or any(fnmatch.fnmatchcase(path, pattern) for pattern in allow)


def check_handler_path(path, allow=()):
    """Refuse a handler path that is not a dotted path or not allowed, without importing
    anything (the overseer validates periodic handlers this way: a module it imported would
    be inherited by every runner it forks, new code on disk or not)."""
    if not isinstance(path, str) or not _DOTTED.match(path):
        raise HandlerError("invalid handler %r: expected a dotted path like 'myapp.tasks.SendEmail'"
                           % (path,))
    if not is_allowed(path, allow):
        raise HandlerError("handler %r is not allowed by [handlers] allow" % path)


def load_handler(path, allow=()):
    """The handler class for `path`, or HandlerError saying why it cannot be used."""
    check_handler_path(path, allow)
    module_name, _, class_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail in any way; the message is what matters
        error = HandlerError("handler %r cannot be imported: %s: %s"
                             % (path, type(exc).__name__, exc))
        # Where the import failed, for the run that needed it (the CLI prints one line).
        error.import_traceback = traceback.format_exc()
        raise error from None
    found = getattr(module, class_name, None)
    if found is None:
        raise HandlerError("handler %r not found: module %r has no %r" % (path, module_name, class_name))
    # A function task (``@task``) carries the TaskHandler class that runs it: one lifecycle
    # below both faces.
    cls = getattr(found, "__taskrunner_handler__", found)
    if not (isinstance(cls, type) and issubclass(cls, TaskHandler)):
        raise HandlerError("handler %r is not a TaskHandler subclass or a function task "
                           "(@task)" % path)
    return cls


def check_handlers_in_child(paths, allow=()):
    """Import each handler in a forked child process and return the first HandlerError's
    message, or None: a module imported by a long-lived parent (the overseer) would be
    inherited by every process it forks later, old code and all."""
    if not paths:
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 0
        try:
            for path in paths:
                load_handler(path, allow)
        except HandlerError as exc:
            os.write(write_end, str(exc).encode("utf-8", "replace")[:4000])
            code = 2
        except BaseException:  # the child must never return into its parent's code
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return message or "checking the handlers failed"
    return None


def encode_data(data, max_size):
    """Task data as JSON text; refuse what is not JSON-serialisable or too large."""
    try:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        size = len(text.encode("utf-8"))
    except RecursionError:
        raise HandlerError("task data is nested too deeply") from None
    except UnicodeEncodeError:
        raise HandlerError("task data is not valid UTF-8 text (a lone surrogate)") from None
    except (TypeError, ValueError) as exc:
        raise HandlerError("task data is not JSON-serialisable: %s" % exc) from None
    if size > max_size:
        raise HandlerError("task data is %d bytes, over [task] max_data_size (%d)" % (size, max_size))
    return text


# The run whose handler this thread (or its event loop) is executing: what a function task's
# ``enqueue`` adds its children to, exactly once (functions.py). Set by the runner.
CURRENT_RUN: "contextvars.ContextVar[Optional[RunContext]]" = contextvars.ContextVar(
    "taskrunner_current_run", default=None)


def current_run() -> "Optional[RunContext]":
    """The `RunContext` of the run being executed here, or None outside a handler."""
    return CURRENT_RUN.get()


class Queue(Protocol):
    """The queue a handler is handed (``run.queue``): what a run may ask of the queue that
    executes it, as `TaskQueue` (taskrunner.api) does it. A type of its own, so a handler
    names no facade above it (the facade imports the runner, which imports handlers)."""

    def add_task(self, handler: str, data: Any = None, *,
                 scheduled_on: Optional[datetime] = None, max_retries: Optional[int] = None,
                 priority: int = 0, run_timeout: Union[float, str, None] = None,
                 unique_key: Optional[str] = None, queued_by: Optional[str] = None,
                 max_runtime: Union[float, str, None] = None,
                 retry_backoff: Union[float, str, None] = None, queue: Optional[str] = None,
                 concurrency_key: Optional[str] = None,
                 concurrency_limit: Optional[int] = None, rate_key: Optional[str] = None,
                 tenant: Optional[str] = None, connection: Any = None,
                 after: Optional[Iterable[int]] = None,
                 on_parent_failure: Optional[str] = None,
                 delay: Union[float, str, None] = None,
                 debounce: Union[float, str, None] = None, debounce_key: Optional[str] = None,
                 debounce_max: Union[float, str, None] = None,
                 debounce_keep: Optional[str] = None,
                 max_attempts: Optional[int] = None) -> int: ...

    async def add_task_async(self, handler: str, data: Any = None, *, connection: Any = None,
                             **options: Any) -> int: ...

    def add_workflow(self, tasks: Iterable[Union[str, Mapping[str, Any]]],
                     name: Optional[str] = None) -> Any: ...

    def get_task(self, task_id: int) -> "TaskInfo": ...

    def status_of(self, task_id: int) -> str: ...

    def runs_of(self, task_id: int) -> "List[RunInfo]": ...

    def outcomes(self, task_ids: Iterable[int]) -> "Dict[int, Optional[TaskOutcome]]": ...

    def parent_results(self, task_id: int) -> "ParentResults": ...

    def send_event(self, task_id: int, name: str, payload: Any = None) -> bool: ...

    def wait(self, task_id: int, timeout: Optional[float] = None) -> "TaskOutcome": ...

    async def wait_async(self, task_id: int,
                         timeout: Optional[float] = None) -> "TaskOutcome": ...

    def wait_workflow(self, workflow_id: int,
                      timeout: Optional[float] = None) -> "WorkflowInfo": ...

    def rotate(self) -> Dict[str, int]: ...


class RunContext:
    """What a handler receives as `run`.

    ``data`` (decoded JSON), ``results`` (set it to anything JSON-serialisable; while the
    run goes on the runner stores it within a second of each change, and finally when the
    run ends), ``progress(percent)``, ``deadline`` (aware UTC datetime or None) and
    ``should_stop()``, with ``stop_reason`` and ``stop_deadline`` saying why and by when.
    ``id``, ``task_id`` and ``attempt`` identify the run; ``queue`` is the TaskQueue executing
    it (to queue follow-up tasks; typed as `Queue`).

    Durable execution (docs: "Durable tasks"): ``checkpoint(value)`` and
    ``resumed_from``, ``step(name, fn, ...)`` and ``transaction_step(name, fn, ...)`` (run
    once per task), ``idempotency_key(name)``, ``sleep(...)``, ``wait_for(name)`` and
    ``wait_for_tasks(ids)``; ``patched(name)`` and ``code_version`` to change the code under
    running tasks (docs: "Changing durable code under running work").
    """

    def __init__(self, run_id: int, task_id: int, attempt: int, data: Any, *,
                 queue: Queue, deadline: Optional[datetime] = None,
                 report: Optional[Callable[[Optional[int], Optional[str]], bool]] = None,
                 stopping: Optional[Callable[[], bool]] = None,
                 durable: Optional[Callable[[], Any]] = None,
                 stop_info: Optional[Callable[[], Tuple[Optional[str], Optional[datetime]]]]
                 = None) -> None:
        self.id = run_id
        self.queue = queue
        self.task_id = task_id
        self.attempt = attempt
        self.data: Any = data
        self.results: Any = None
        self.deadline = deadline
        self.lost = False
        self._report = report
        self._stopping = stopping
        self._durable = durable          # makes the run's DurableRun, on first use
        self._durable_made: Any = None
        self._stop_info = stop_info
        self._pending_progress: Optional[int] = None   # a percent not stored yet
        self._progress_warned = False
        self._stored_results: Optional[str] = None     # results as last stored, JSON

    @property
    def parent_results(self) -> Any:
        """The results of the tasks this one runs after (``after=``), keyed by task id: a
        mapping read from the database in pages when iterated (``items()``, ``values()``),
        or one at a time (``run.parent_results[task_id]``) — a fan-in over thousands of
        parents never holds them all in memory."""
        return self.queue.parent_results(self.task_id)

    def progress(self, percent: float) -> None:
        """Store percent_completed (0..100) and mark the run as alive.

        Never raises a database error: progress is bookkeeping, and a database restart must
        not fail the work it reports on. The percent is then kept and written by the next
        ``progress()`` (or ``flush_progress()``); only the latest percent is kept."""
        percent = max(0, min(100, int(percent)))
        if self._report is None:
            return
        self._pending_progress = percent
        self._write_progress()

    def flush_progress(self) -> bool:
        """Write the percent a database error kept back, if any. For the runner, after the
        handler returned and before it records the outcome (an ended run is no longer
        updated). True when nothing is left pending; never raises a database error."""
        return self._write_progress()

    def _write_progress(self) -> bool:
        report, percent = self._report, self._pending_progress
        if report is None or percent is None:
            return True
        # peewee is imported here, not at module level: `import taskrunner` stays free of
        # peewee and of every driver. It is loaded already whenever a report function exists.
        import peewee
        try:
            mine = report(percent, None)
        except (peewee.DatabaseError, peewee.InterfaceError) as exc:
            # InterfaceError is not a DatabaseError in peewee; PyMySQL raises it on a
            # connection it has closed.
            if not self._progress_warned:
                self._progress_warned = True      # once per run: a handler may report often
                first = str(exc).strip().splitlines()
                log.warning("run %d of task %d: progress %d%% not stored (%s); it will be "
                            "written by the next progress update", self.id, self.task_id,
                            percent, first[0] if first else type(exc).__name__)
            self._drop_dead_connection()
            return False
        self._pending_progress = None
        if not mine:
            # The run is no longer ours (it was marked timeout): the handler should stop.
            self.lost = True
        return True

    def flush_results(self) -> None:
        """Store ``results`` if it changed since it was last stored (the runner's heartbeat
        thread calls this twice a second during the run, so an assignment or a change in
        place is seen by others within a second). Results that are not JSON (yet), or are
        being changed as they are read, wait for the next call; a database error too: the
        outcome stores the final results anyway."""
        import peewee
        if self._report is None or self.results is None:
            return
        try:
            text = json.dumps(self.results, allow_nan=False)
        except (TypeError, ValueError, RuntimeError):
            return
        if text == self._stored_results:
            return
        try:
            mine = self._report(None, text)
        except (peewee.DatabaseError, peewee.InterfaceError) as exc:
            log.debug("run %d: results not stored yet: %s", self.id, exc)
            return
        self._stored_results = text
        if not mine:
            self.lost = True

    def _drop_dead_connection(self) -> None:
        """After a failed update, close this thread's connection if the server dropped it,
        so that the next statement opens a new one: peewee reconnects a connection it knows
        is closed, never one the server closed. peewee's own check (is_connection_usable:
        the transaction status on PostgreSQL, a ping on MySQL) decides, so that a lock
        timeout keeps the connection and its session settings. Not inside a transaction:
        one the handler opened is broken anyway, and is the handler's to end."""
        db = getattr(getattr(self.queue, "store", None), "db", None)
        if db is None or db.in_transaction() or db.is_connection_usable():
            return
        try:
            db.close()
        except Exception:  # closing a dead connection may fail in any driver-specific way
            log.debug("closing the lost connection failed", exc_info=True)

    def should_stop(self) -> bool:
        """True when the handler should wrap up: the runner is stopping, the deadline has
        passed, or the run was taken away (marked timeout). `stop_reason` says which."""
        if self.lost or (self._stopping is not None and self._stopping()):
            return True
        return self.deadline is not None and datetime.now(timezone.utc) >= self.deadline

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the handler is asked to stop, or None while it is not: ``"hup"`` (a reload:
        its runner is replaced by one with the new code), ``"term"`` / ``"int"`` (its runner
        is stopping), ``"interrupt"`` (a fast stop), ``"cancel"`` (an operator cancelled the
        task), ``"timeout"`` (its run was timed out or passed max_runtime), ``"deadline"``
        (`deadline` has passed)."""
        if self._stop_info is not None:
            reason = self._stop_info()[0]
            if reason is not None:
                return reason
        if self.lost:
            return "timeout"
        if self.deadline is not None and datetime.now(timezone.utc) >= self.deadline:
            return "deadline"
        return None

    @property
    def stop_deadline(self) -> Optional[datetime]:
        """By when (aware UTC) the handler should have returned once asked to stop: after it,
        the handler may be interrupted or its runner killed (``[overseer]
        graceful_timeout`` after a stop signal, ``kill_grace`` after a cancel or a timeout,
        the hard limit after `deadline`). None while it is not asked to stop. Time enough to
        finish a short step and `checkpoint` is time enough to return cleanly."""
        if self._stop_info is not None:
            reason, when = self._stop_info()
            if reason is not None:
                return when
        if self.stop_reason == "deadline":
            return self.deadline
        return None

    # -- durable execution: see runs/durable.py

    def _durable_run(self) -> Any:
        if self._durable is None:
            raise RuntimeError("durable execution needs a run executed by a runner")
        if self._durable_made is None:
            self._durable_made = self._durable()
        return self._durable_made

    @property
    def resumed_from(self) -> Any:
        """The last value given to `checkpoint` by an earlier attempt of this task (after a
        stop, a deploy, a crash, a timeout or a retry), or None on its first attempt."""
        return self._durable_run().resumed_from

    def checkpoint(self, value: Any, progress: Optional[float] = None) -> bool:
        """Store `value` (any JSON value) on the task, durably before returning, with
        ``progress`` (percent) when given: every later attempt of the task starts with it as
        `resumed_from`. Proves the run alive, as ``progress()`` does. Returns False (and
        `should_stop()` turns true) when the run is no longer this runner's: it was timed
        out, and the checkpoint was not stored."""
        mine = self._durable_run().checkpoint(value, progress)
        if not mine:
            self.lost = True
        return bool(mine)

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` once per task: its result (JSON) is recorded under `name`
        and every later attempt gets the recorded result without calling `fn`. A step killed
        before its record committed runs again: outside the database a step is at least
        once — hand `idempotency_key(name)` to the API it calls."""
        return self._durable_run().step(name, fn, args, kwargs)

    def transaction_step(self, name: str, fn: Callable[..., Any], *args: Any,
                         **kwargs: Any) -> Any:
        """``fn(connection, *args, **kwargs)`` once per task, inside the transaction that
        records the step: `connection` is the queue's own DB-API connection (sqlite3,
        psycopg, PyMySQL), so what `fn` writes to this database commits with the step's
        record or rolls back with it — exactly once. Keep `fn` to database work: it may run
        again after a deadlock, and it holds a write transaction while it runs."""
        return self._durable_run().step(name, fn, args, kwargs, in_transaction=True)

    def idempotency_key(self, name: str) -> str:
        """A key for the step `name` of this task, the same on every attempt: give it to an
        external API that deduplicates requests (a payment, an e-mail), so that a step run
        again after a crash does not act twice."""
        return str(self._durable_run().idempotency_key(name))

    def sleep(self, seconds: Optional[float] = None, *, until: Optional[datetime] = None,
              name: Optional[str] = None) -> None:
        """Sleep durably: the run ends ``waiting`` — not a failure, no retry used, the
        runner free for other work — and the task runs again at that time (``until``: an
        aware datetime), resuming from its checkpoint and steps; there this call returns.
        The end of the sleep is recorded the first time (as the step ``sleep-N``, N counting
        this attempt's unnamed sleeps, or `name`), so call it in the same order on every
        attempt."""
        self._durable_run().sleep(seconds, until, name)

    def wait_for(self, name: str, timeout: Optional[float] = None) -> Any:
        """Wait durably for the event `name` (``TaskQueue.send_event``) and return its
        payload: until it is sent, the run ends ``waiting`` as for `sleep`, and the task runs
        again as soon as it is; an event sent before the wait is kept for it.

        Each call takes one event: the N-th wait for `name` in an attempt (in call order)
        waits for and consumes the N-th event of that name sent to the task, recorded as the
        step ``event:NAME`` for the first, ``event-N:NAME`` after it — so call it in the same
        order on every attempt. Events sent early are kept and taken in the order sent.

        Raises `EventTimeout` when `timeout` seconds (from this wait's first call) pass
        without it. Uncaught, it gives the task up at once (no retry: every retry would
        time out again), with error code ``EventTimeout``; catch it to go on without the
        event."""
        return self._durable_run().wait_for(name, timeout)

    def patched(self, name: str) -> bool:
        """Whether this task takes the new code path `name` (docs: "Changing durable code
        under running work"): True for a task that started under the code running now, or
        that has not recorded anything past this point; False for a task that started under
        earlier code and recorded steps beyond here (or a checkpoint) without it — that
        task keeps the old path. Recorded the first time (as the step ``patch:NAME``), so
        every later attempt of the task gets the same answer."""
        return bool(self._durable_run().patched(name))

    @property
    def code_version(self) -> Optional[str]:
        """The version of the code this task started under (``[runner] code_version``, or a
        digest of the application's source): recorded with its first durable record, or
        the version running now for a task that has recorded nothing yet. None for a task
        that recorded something before versions were kept."""
        version = self._durable_run().code_version
        return None if version is None else str(version)

    def wait_for_tasks(self, task_ids: "list[int]") -> "list[dict[str, Any]]":
        """Wait durably until every task of `task_ids` (children this run added) has ended,
        and return how each ended, in order: ``{"task_id", "status"`` (``success``,
        ``given-up`` or ``cancelled``), ``"results", "error_code", "error_message"}``. Until
        then the run ends ``waiting`` — no runner held, no retry used — and the last of them
        to end gives the task its next run, which comes back here and goes on. Recorded the
        first time (as the step ``join-N``), so call it in the same order on every
        attempt."""
        ids = [int(task_id) for task_id in task_ids]

        def read(wanted: "list[int]") -> "dict[int, Any]":
            found = self.queue.outcomes(wanted)
            missing = [task_id for task_id in wanted if task_id not in found]
            if missing:
                raise TaskNotFound("no task with id %s" % missing[0])
            return {task_id: None if outcome is None else {
                "task_id": task_id, "status": outcome.status, "results": outcome.results,
                "error_code": outcome.error_code, "error_message": outcome.error_message}
                for task_id, outcome in found.items()}
        return list(self._durable_run().join(ids, read))

    def add_once(self, label: str, insert: Callable[[], Any]) -> Any:
        """``insert()`` — which adds tasks through ``run.queue`` and returns their ids —
        exactly once per task: in the transaction that records it as the step
        ``add:LABEL`` (``add-2:LABEL`` for the same label again in an attempt); a later
        attempt that comes back here with the same label gets the recorded ids and adds
        nothing. What a function task's ``enqueue`` does inside a handler, with the
        function's path and a digest of its arguments as the label."""
        return self._durable_run().add(label, insert)
