"""`RunDjangoTask`: the taskrunner handler that runs a Django task in a runner.

Under ``python manage.py taskrunner overseer`` Django is set up once in the overseer, before
it forks its runners; a runner started otherwise sets it up on its first Django task
(``DJANGO_SETTINGS_MODULE`` must name the settings).
"""
import inspect
from typing import Any, Awaitable, Optional

import django
from django.apps import apps
from django.db import close_old_connections

from ...errors import HandlerError
from ...handler import RunContext, TaskHandler


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
        if task.takes_context:
            result = result_of(spec["backend"], run.queue.get_task(run.task_id),
                               run.queue.runs_of(run.task_id))
            args.insert(0, tasks.TaskContext(task_result=result))
        if inspect.iscoroutinefunction(task.func):
            return self._await(run, task.func(*args, **spec["kwargs"]), tasks)
        # A runner lives for many runs: connections that Django would close at the end of a
        # request (CONN_MAX_AGE, broken ones) are closed around each task instead.
        close_old_connections()
        try:
            run.results = {"return_value": tasks.normalize_json(
                task.func(*args, **spec["kwargs"]))}
        except Exception as exc:
            run.results = {"exception_class_path": _path(type(exc))}
            raise
        finally:
            close_old_connections()
        return None

    async def _await(self, run: RunContext, coroutine: Any, tasks: Any) -> None:
        try:
            run.results = {"return_value": tasks.normalize_json(await coroutine)}
        except Exception as exc:
            run.results = {"exception_class_path": _path(type(exc))}
            raise


def _path(cls: type) -> str:
    return "%s.%s" % (cls.__module__, cls.__qualname__)
