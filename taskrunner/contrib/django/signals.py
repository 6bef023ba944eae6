"""Django's task signals, sent with the backend's class as sender and the task's
`TaskResult`, from the process that stores what they tell:

- ``task_enqueued``: by the process that enqueued it, after the commit (backend.py);
- ``task_started``, ``task_finished``: by the runner around each attempt of the task's
  function (handler.py, `TaskSignals`): RUNNING, then SUCCESSFUL or FAILED for that attempt
  (a FAILED attempt may still be retried);
- ``task_finished`` (FAILED) for an end the function never saw, by the process that records
  it (`finished_elsewhere`, a hook of the run lifecycle): the runner died (the overseer that
  reaped it, or whoever found it dead later), the run timed out (the maintainer, or the
  runner past ``max_runtime``), the task was cancelled (the process that cancelled it), its
  module did not import in the runner.

A receiver that raises neither fails the task nor hides its outcome: it is logged.
"""
import logging
import traceback
from typing import Any, Optional

from ...reads.records import get_task, runs_of
from ...store.models import ERROR
from .compat import tasks

log = logging.getLogger("taskrunner.django")

# Errors of a run whose task function did not run to its end under the runner's handler: no
# task_finished was sent for them by the runner (the task's module did not import, the data
# did not decode, the runner exited under it: a KeyboardInterrupt).
NOT_SEEN_BY_THE_TASK = ("HandlerError", "DataDecodeError", "RunnerExited")


def class_path(cls: type) -> str:
    return "%s.%s" % (cls.__module__, cls.__qualname__)


def sender_of(alias: str) -> Optional[type]:
    backends = getattr(tasks.package, "task_backends", None)
    return type(backends[alias]) if backends is not None else None


def send(signal: Any, sender: Optional[type], result: Any) -> None:
    for receiver, outcome in signal.send_robust(sender=sender, task_result=result):
        if isinstance(outcome, Exception):
            log.warning("Django task signal receiver %r raised %s: %s", receiver,
                        type(outcome).__name__, outcome)


class TaskSignals:
    """``task_started`` and ``task_finished``, sent by the runner around an attempt as
    Django's own backends send them. Reading the task for them costs two reads, made only
    when a receiver is connected (or the task takes a context)."""

    def __init__(self, alias: str, tasks: Any) -> None:
        self.tasks = tasks
        self.sender = sender_of(alias)
        self.wanted = self.sender is not None and (
            tasks.task_started.has_listeners(self.sender)
            or tasks.task_finished.has_listeners(self.sender))

    def started(self, result: Any) -> None:
        if not self.wanted:
            return
        from django.utils import timezone
        now = timezone.now()
        object.__setattr__(result, "status", self.tasks.TaskResultStatus.RUNNING)
        object.__setattr__(result, "started_at", result.started_at or now)
        object.__setattr__(result, "last_attempted_at", now)
        send(self.tasks.task_started, self.sender, result)

    def finished(self, result: Any, value: Any = None, exc: Optional[BaseException] = None
                 ) -> None:
        if not self.wanted:
            return
        from django.utils import timezone
        object.__setattr__(result, "finished_at", timezone.now())
        if exc is None:
            object.__setattr__(result, "_return_value", value)
            object.__setattr__(result, "status", self.tasks.TaskResultStatus.SUCCESSFUL)
        else:
            result.errors.append(self.tasks.TaskError(
                exception_class_path=class_path(type(exc)),
                traceback="".join(traceback.format_exception(exc))))
            object.__setattr__(result, "status", self.tasks.TaskResultStatus.FAILED)
        send(self.tasks.task_finished, self.sender, result)


def finished_elsewhere(store: Any, task_id: int, status: str, error_code: Optional[str],
                       final: bool) -> None:
    """`lifecycle.after_failure` hook: ``task_finished`` (FAILED) for a Django task whose
    run ended without its function's end being seen by the runner (a death, a timeout, a
    cancel, an import that failed), sent after the commit by the process that recorded it,
    with the task's errors as ``get_result`` reads them (this run's among them). Django's
    database connections are left as found: a receiver that used the ORM in an overseer
    must not leave a connection that its next forked runner would share."""
    if status == ERROR and error_code not in NOT_SEEN_BY_THE_TASK:
        return      # the runner's handler sent it (TaskSignals.finished)
    from .results import django_task, result_of
    info = get_task(store, task_id)
    task = django_task(info)
    if task is None:
        return
    alias = info.data["backend"]
    sender = sender_of(alias)
    if sender is None or not tasks.task_finished.has_listeners(sender):
        return
    from django.db import connections
    from django.utils import timezone
    result = result_of(alias, task, info, runs_of(store, task_id))
    object.__setattr__(result, "status", tasks.TaskResultStatus.FAILED)
    object.__setattr__(result, "finished_at", result.finished_at or timezone.now())
    open_before = {c.alias for c in connections.all(initialized_only=True)
                   if c.connection is not None}
    try:
        send(tasks.task_finished, sender, result)
    finally:
        for connection in connections.all(initialized_only=True):
            if connection.connection is not None and connection.alias not in open_before \
                    and not connection.in_atomic_block:
                connection.close()
