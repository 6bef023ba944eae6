"""A run's outcome once its handler returned: what the runner stores, what it logs, and the
handler's hooks it calls (``on_failure``, ``on_give_up``).

A failure is logged at WARNING with its traceback, a give-up at ERROR; a hook that raises is
logged and changes nothing — the outcome is stored before any hook runs.
"""
import logging
import traceback as tb
from datetime import timedelta
from typing import Any, NamedTuple, Optional

from ..reads import records as reads
from ..errors import Retry, TaskError, Waiting
from ..logs import run_fields
from ..store.models import ERROR, FAILED, REQUEUED, TIMEOUT, WAITING

log = logging.getLogger("taskrunner.runner")


class Interrupted(BaseException):
    """Raised inside a handler to interrupt it. BaseException so that a handler's
    ``except Exception`` does not swallow it."""


class Outcome(NamedTuple):
    """How a run ended, as the runner stores it. `exc`: the exception of a failure, for the
    handler's on_failure hook."""
    status: str
    code: Optional[str] = None
    message: Optional[str] = None
    results: Optional[str] = None        # JSON text
    retry_at: Any = None                 # naive UTC datetime of a snoozed or waiting run
    traceback: Optional[str] = None
    exc: Optional[BaseException] = None
    # The event a waiting run waits for, or the ids of the tasks it waits for (a list).
    waiting_for: Any = None
    give_up: bool = False                # a failure not to retry (TaskError retry=False)


def failed(code, message, traceback=None, exc=None, status=ERROR, give_up=False):
    return Outcome(status, code, message, traceback=traceback, exc=exc, give_up=give_up)


def of_exception(exc, now, aborted=False, stopping=None):
    """The outcome of a handler that raised `exc`: an interrupt is a timeout when its run
    was taken away (`aborted`), else a hand-back; `Retry` requeues (at `now` + in_seconds);
    a failure while its runner was told to stop (`stopping`: why) hands the run back too;
    `Waiting` (run.sleep, run.wait_for) ends it waiting, stopping or not. A `TaskError`
    with ``retry=False`` (EventTimeout among them) gives its task up now."""
    if isinstance(exc, Waiting):
        if exc.tasks:
            return Outcome(WAITING, "WaitingForTasks", str(exc), waiting_for=list(exc.tasks))
        return Outcome(WAITING, "Sleeping" if exc.event is None else "WaitingForEvent",
                       str(exc), retry_at=exc.until, waiting_for=exc.event)
    if isinstance(exc, Interrupted):
        if aborted:
            return failed("Interrupted", str(exc), format_traceback(exc), exc, TIMEOUT)
        return Outcome(REQUEUED, "Stopped", "handed back: %s" % exc)
    if isinstance(exc, Retry):
        code = "Snoozed" if exc.in_seconds else "Retry"
        message = exc.reason or ("run again in %gs" % exc.in_seconds if exc.in_seconds
                                 else "run again")
        retry_at = now + timedelta(seconds=exc.in_seconds) if exc.in_seconds else None
        return Outcome(REQUEUED, code, message, retry_at=retry_at)
    code = exc.code if isinstance(exc, TaskError) and exc.code else type(exc).__name__
    text = str(exc) or repr(exc)
    if stopping is not None:
        return Outcome(REQUEUED, "Stopped", "handed back: %s; the handler ended with %s: %s"
                       % (stopping, code, text))
    return failed(code, text, format_traceback(exc), exc,
                  give_up=isinstance(exc, TaskError) and not exc.retry)


def format_traceback(exc):
    """The traceback of an exception raised by a handler, from the handler's frame down
    (the runner's own frame, where it called the handler, says nothing)."""
    trace = exc.__traceback__
    if trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    return "".join(tb.format_exception(type(exc), exc, trace))


def after_run(store, claimed, outcome, elapsed, handler=None, context=None):
    """Log the stored outcome of `claimed` and call the handler's hooks for a failure."""
    if outcome.status not in FAILED:
        # Every run of a busy runner: the line and its fields are built only when logged.
        if not log.isEnabledFor(logging.INFO):
            return
        fields = run_fields(claimed, outcome.status, elapsed, outcome.code)
        log.info("run %d of task %d finished: %s %s in %.3fs%s", claimed.run_id,
                 claimed.task_id, claimed.handler, outcome.status, elapsed,
                 " (%s: %s)" % (outcome.code, outcome.message) if outcome.code else "",
                 extra=fields)
        return
    fields = run_fields(claimed, outcome.status, elapsed, outcome.code)
    log.warning("run %d of task %d failed: %s %s in %.3fs (%s: %s)%s", claimed.run_id,
                claimed.task_id, claimed.handler, outcome.status, elapsed, outcome.code,
                _short(outcome.message), "\n" + outcome.traceback.rstrip() if outcome.traceback
                else "", extra=fields)
    if handler is not None and outcome.exc is not None:
        _call_hook(claimed, "on_failure", handler.on_failure, context, outcome.exc)
    try:
        task = reads.get_task(store, claimed.task_id)
    except Exception:  # the outcome is stored; a failed read only loses the give-up report
        log.warning("run %d of task %d: could not read the task after its failure",
                    claimed.run_id, claimed.task_id, exc_info=True)
        return
    if task.given_up:
        log.error("task %d gave up after %d failed run(s)%s: %s (%s: %s)", task.id,
                  task.runs_failed, " (an error not to retry)" if outcome.give_up else "",
                  task.handler, task.last_error_code, _short(task.last_error_message),
                  extra=run_fields(claimed, "given-up", error_code=task.last_error_code))
        if handler is not None:
            _call_hook(claimed, "on_give_up", handler.on_give_up, task)


def _short(text, limit=500):
    """A message as one log line shows it (the traceback that follows has it whole)."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def _call_hook(claimed, name, hook, *args):
    try:
        hook(*args)
    except Exception:  # a hook's failure is the hook's: logged, the outcome stands
        log.error("run %d of task %d: %s.%s raised; the run's outcome is unchanged",
                  claimed.run_id, claimed.task_id, claimed.handler, name, exc_info=True)
