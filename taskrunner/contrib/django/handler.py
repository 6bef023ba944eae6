"""The runner side of a Django task: `TaskrunnerTask`, the object Django's ``@task`` makes for
a `TaskrunnerBackend`, which names the handler that runs it; `RunDjangoTask`, that handler.

Why the task object names its handler. A Django task is stored under its own import path
(``shop.tasks.send_receipt``), so that the CLI (``--handler``), the dashboard, the workflow
graph and the metrics say that name. A runner finds the handler of a path as it finds any
other (`taskrunner.handler.load_handler`, under ``[handlers] allow``): it imports the module
and takes the object there, which is a handler class or names one as
``__taskrunner_handler__`` — the contract function tasks keep too. Django lets a backend
choose the class of its tasks (``BaseTaskBackend.task_class``, documented for custom
backends), so the backend's tasks are `TaskrunnerTask` objects that keep that contract. Hence:

- nothing is registered anywhere, at import or at boot: the name and the handler travel
  together in the object that the runner already imports, in every process that has it
  (``manage.py taskrunner ...``, a plain ``taskrunner runner``, the web process adding it);
- taskrunner's own layers know nothing of Django: `load_handler` is unchanged, and a runner
  that never imports a Django task's module never imports Django;
- one lifecycle: every Django task runs through `RunDjangoTask` (a subclass per task path,
  which runs the task at that path, the one the allow-list checked), on the same runner path
  as any handler.

Rejected: a registry of "adapters" in taskrunner.handler that this package would fill — at
import, a hook one linter fix away from vanishing; at Django's boot (``AppConfig.ready``),
absent from a runner that did not set Django up — or a table there naming this package by
string, an upward dependency that the layout test cannot see.

Tasks stored under `RunDjangoTask` itself (before Django tasks were named by their path, or
whose ``@task`` names another backend) name their Django task in their data and still run.

Under ``python manage.py taskrunner overseer`` (or ``runner``) Django is set up once, in the
overseer, before it forks its runners, and before any task's module is imported. A runner
started otherwise (``DJANGO_SETTINGS_MODULE`` naming the settings) imports a task's module
first and sets Django up when it runs its first Django task: it can run the tasks whose
modules import without Django's app registry (no models imported at module level).
"""
import functools
import inspect
import logging
from typing import Any, Awaitable, Optional

import django
from django.apps import apps
from django.db import close_old_connections

from ...errors import HandlerError, Waiting
from ...handler import RunContext, TaskHandler
from ...runner.outcomes import Interrupted
from .compat import tasks

log = logging.getLogger("taskrunner.django")


def setup() -> None:
    if not apps.ready:
        django.setup()


class RunDjangoTask(TaskHandler):
    """Calls a Django task with the args and kwargs of the data: the task at `task_path`, or
    for `RunDjangoTask` itself the one named in the data (``"task"``). The return value is
    stored as ``{"return_value": ...}``; an exception (any BaseException, as Django reports
    them) as ``{"exception_class_path": ...}`` beside the run's traceback, and raised on, so the run fails and is retried as any
    other (``MAX_RETRIES``)."""

    # The import path of the Django task that this class runs (`handler_for`).
    task_path: Optional[str] = None

    def handle(self, run: RunContext) -> Optional[Awaitable[None]]:
        setup()
        from django.utils.module_loading import import_string
        from .results import result_of
        spec = run.data
        path = self.task_path or spec["task"]
        try:
            task = import_string(path)
        except ImportError as exc:
            raise HandlerError("Django task %r cannot be imported: %s" % (path, exc)) from None
        if not isinstance(task, tasks.Task):
            raise HandlerError("%r is not a Django task (@task)" % path)
        args = list(spec["args"])
        signals = _Signals(spec["backend"], tasks)
        result = None
        if task.takes_context or signals.wanted:
            result = result_of(spec["backend"], task, run.queue.get_task(run.task_id),
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
        except BaseException as exc:
            _failed(run, signals, result, exc)
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
        except BaseException as exc:
            _failed(run, signals, result, exc)
            raise
        signals.finished(result, value=run.results["return_value"])


def _failed(run: RunContext, signals: "_Signals", result: Any, exc: BaseException) -> None:
    """An attempt that raised `exc`: its class stored beside the run's traceback, and
    task_finished (FAILED) sent — for any BaseException, as Django's immediate backend does
    (SystemExit, KeyboardInterrupt; the caller raises it on). Not for the runner's own
    interrupt (a stop hands the run back, a timeout takes it away: no failure of the task)
    or a durable wait."""
    if isinstance(exc, (Interrupted, Waiting)):
        return
    run.results = {"exception_class_path": _path(type(exc))}
    signals.finished(result, exc=exc)


@functools.lru_cache(maxsize=None)
def handler_for(path: str) -> type:
    """The `RunDjangoTask` that runs the Django task at `path` (one class per path, kept)."""
    cls = type("RunDjangoTask[%s]" % path, (RunDjangoTask,), {"task_path": path})
    cls.__module__ = __name__
    return cls


class TaskrunnerTask(tasks.Task):
    """Django's `Task` as a `TaskrunnerBackend` makes it (its ``task_class``): the same
    task, which also names the handler that runs it, as a function task does."""

    __slots__ = ()

    @property
    def __taskrunner_handler__(self) -> type:
        return handler_for(self.module_path)


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
