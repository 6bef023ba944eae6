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
from typing import Any, Awaitable, Optional

import django
from django.apps import apps
from django.db import close_old_connections

from ...errors import HandlerError, Waiting
from ...handler import RunContext, TaskHandler
from ...runner.outcomes import Interrupted
from .compat import tasks
from .signals import TaskSignals, class_path

def setup() -> None:
    if not apps.ready:
        django.setup()


class RunDjangoTask(TaskHandler):
    """Calls a Django task with the args and kwargs of the data: the task at `task_path`, or
    for `RunDjangoTask` itself the one named in the data (``"task"``). The return value is
    stored as ``{"return_value": ...}``; an exception (any BaseException, as Django reports
    them) as ``{"exception_class_path": ...}`` beside the run's traceback, and raised on, so
    the run fails and is retried as any other (``MAX_RETRIES``)."""

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
        signals = TaskSignals(spec["backend"], tasks)
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

    async def _await(self, run: RunContext, coroutine: Any, tasks: Any, signals: TaskSignals,
                     result: Any) -> None:
        try:
            run.results = {"return_value": tasks.normalize_json(await coroutine)}
        except BaseException as exc:
            _failed(run, signals, result, exc)
            raise
        signals.finished(result, value=run.results["return_value"])


def _failed(run: RunContext, signals: TaskSignals, result: Any, exc: BaseException) -> None:
    """An attempt that raised `exc`: its class stored beside the run's traceback, and
    task_finished (FAILED) sent — for a BaseException too (SystemExit), as Django's
    immediate backend does. Not for a KeyboardInterrupt, which Django's immediate backend
    lets through unreported ("if the user tried to terminate, let them"): it ends the runner,
    and task_finished is sent by whoever records the end of its run (signals.py); nor for
    the runner's own interrupt (a stop hands the run back; a timeout is reported by whoever
    recorded it) or a durable wait."""
    if isinstance(exc, (Interrupted, Waiting, KeyboardInterrupt)):
        return
    run.results = {"exception_class_path": class_path(type(exc))}
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
