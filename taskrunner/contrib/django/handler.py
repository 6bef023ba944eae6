"""`RunDjangoTask`: the taskrunner handler that runs a Django task in a runner.

Under ``python manage.py taskrunner overseer`` Django is set up once in the overseer, before
it forks its runners; a runner started otherwise sets it up on its first Django task
(``DJANGO_SETTINGS_MODULE`` must name the settings).
"""
import inspect
import logging
from typing import Any, Awaitable, Optional

import django
from django.apps import apps
from django.db import close_old_connections

from ...errors import HandlerError
from ...handler import RunContext, TaskHandler

log = logging.getLogger("taskrunner.django")


def setup() -> None:
    if not apps.ready:
        django.setup()


class RunDjangoTask(TaskHandler):
    """Calls the Django task named in the data with its args and kwargs. The return value is
    stored as ``{"return_value": ...}``; an exception as ``{"exception_class_path": ...}``
    beside the run's traceback, and raised on, so the run fails and is retried as any
    other (``MAX_RETRIES``)."""

    def handle(self, run: RunContext) -> Optional[Awaitable[None]]:
        setup()
        from django.utils.module_loading import import_string
        from .backend import result_of
        from .compat import tasks
        spec = run.data
        try:
            task = import_string(spec["task"])
        except ImportError as exc:
            raise HandlerError("Django task %r cannot be imported: %s" % (spec["task"], exc)) \
                from None
        if not isinstance(task, tasks.Task):
            raise HandlerError("%r is not a Django task (@task)" % spec["task"])
        args = list(spec["args"])
        signals = _Signals(spec["backend"], tasks)
        result = None
        if task.takes_context or signals.wanted:
            result = result_of(spec["backend"], run.queue.get_task(run.task_id),
                               run.queue.runs_of(run.task_id))
        if task.takes_context:
            args.insert(0, tasks.TaskContext(task_result=result))
        signals.started(result)
        if inspect.iscoroutinefunction(task.func):
            return self._await(run, task.func(*args, **spec["kwargs"]), tasks, signals, result)
        # A runner lives for many runs: connections that Django would close at the end of a
        # request (CONN_MAX_AGE, broken ones) are closed around each task instead.
        close_old_connections()
        try:
            run.results = {"return_value": tasks.normalize_json(
                task.func(*args, **spec["kwargs"]))}
        except Exception as exc:
            run.results = {"exception_class_path": _path(type(exc))}
            signals.finished(result, exc=exc)
            raise
        else:
            signals.finished(result, value=run.results["return_value"])
        finally:
            close_old_connections()
        return None

    async def _await(self, run: RunContext, coroutine: Any, tasks: Any, signals: "_Signals",
                     result: Any) -> None:
        try:
            run.results = {"return_value": tasks.normalize_json(await coroutine)}
        except Exception as exc:
            run.results = {"exception_class_path": _path(type(exc))}
            signals.finished(result, exc=exc)
            raise
        signals.finished(result, value=run.results["return_value"])


class _Signals:
    """Django's ``task_started`` and ``task_finished``, sent by the runner around the attempt
    as Django's own backends send them, with the backend's class as sender: the attempt's
    `TaskResult` (RUNNING, then SUCCESSFUL or FAILED for this attempt: a FAILED attempt may
    still be retried by taskrunner). Reading the task for it costs two reads, made only when a
    receiver is connected (or the task takes a context)."""

    def __init__(self, alias: str, tasks: Any) -> None:
        self.tasks = tasks
        backends = getattr(tasks.package, "task_backends", None)
        self.sender = type(backends[alias]) if backends is not None else None
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
        self._send(self.tasks.task_started, result)

    def finished(self, result: Any, value: Any = None, exc: Optional[BaseException] = None
                 ) -> None:
        if not self.wanted:
            return
        import traceback
        from django.utils import timezone
        object.__setattr__(result, "finished_at", timezone.now())
        if exc is None:
            object.__setattr__(result, "_return_value", value)
            object.__setattr__(result, "status", self.tasks.TaskResultStatus.SUCCESSFUL)
        else:
            result.errors.append(self.tasks.TaskError(
                exception_class_path=_path(type(exc)),
                traceback="".join(traceback.format_exception(exc))))
            object.__setattr__(result, "status", self.tasks.TaskResultStatus.FAILED)
        self._send(self.tasks.task_finished, result)

    def _send(self, signal: Any, result: Any) -> None:
        # A receiver that raises neither fails the task nor hides its outcome: logged.
        for receiver, outcome in signal.send_robust(sender=self.sender, task_result=result):
            if isinstance(outcome, Exception):
                log.warning("Django task signal receiver %r raised %s: %s", receiver,
                            type(outcome).__name__, outcome)


def _path(cls: type) -> str:
    return "%s.%s" % (cls.__module__, cls.__qualname__)
