"""A Django task's `TaskResult`, read from its taskrunner task and runs: for the backend's
``get_result`` and for the runner (a task that takes a context, Django's task signals).

A Django task is stored under its own import path (``shop.tasks.send_receipt``: the object
there names its handler, handler.py); one stored under `RUN_DJANGO_TASK` names its Django task
in its data instead (tasks stored before Django tasks were named by their path, and tasks
whose ``@task`` names another backend).
"""
import re
from datetime import datetime
from typing import Any, List, Optional

from django.conf import settings
from django.utils import timezone
from django.utils.module_loading import import_string

from ...reads.records import RunInfo, TaskInfo
from ...store.models import CANCELLED, FAILED, RUNNING, SUCCESS
from .compat import tasks

RUN_DJANGO_TASK = "taskrunner.contrib.django.handler.RunDjangoTask"


def task_path(info: TaskInfo) -> str:
    """The import path of the Django task that a taskrunner task runs."""
    if info.handler == RUN_DJANGO_TASK:
        return str(info.data["task"])
    return info.handler


def django_task(info: TaskInfo) -> Optional[Any]:
    """The Django `Task` that a taskrunner task runs, or None when it runs none (a class
    handler's or a function task's task, or one whose Django task is gone)."""
    data = info.data
    if not isinstance(data, dict) or not {"args", "kwargs", "backend"} <= set(data):
        return None
    try:
        task = import_string(task_path(info))
    except ImportError:
        return None
    return task if isinstance(task, tasks.Task) else None


def local_time(value: Optional[datetime]) -> Optional[datetime]:
    """An aware UTC datetime as Django gives datetimes: aware with USE_TZ, else naive local."""
    if value is None or settings.USE_TZ:
        return value
    return timezone.make_naive(value)


# The last line of a formatted traceback: the exception's class, qualified by its module but
# for builtins (traceback.format_exception).
_RAISED = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def exception_class_path(run: RunInfo) -> str:
    """The exception a failed run raised (stored by `RunDjangoTask`); a task whose module did
    not import in the runner (a HandlerError with the import's traceback) the import's
    exception, as Django's import_string raises it; a run that never raised one (its runner
    died, its timeout passed) gets the nearest builtin."""
    if isinstance(run.results, dict) and isinstance(run.results.get("exception_class_path"), str):
        return str(run.results["exception_class_path"])
    if run.error_code == "HandlerError":
        lines = (run.traceback or "").rstrip().splitlines()
        raised = _RAISED.match(lines[-1]) if lines else None
        if raised is None:
            return "taskrunner.errors.HandlerError"
        name = raised.group(1)
        return name if "." in name else "builtins." + name
    return "builtins.TimeoutError"


def status_of(info: TaskInfo) -> Any:
    """Django's status of a task: a task waiting to retry is READY again; one that gave up or
    was cancelled is FAILED."""
    status = tasks.TaskResultStatus
    if info.status == SUCCESS:
        return status.SUCCESSFUL
    if info.given_up or info.status == CANCELLED:
        return status.FAILED
    return status.RUNNING if info.status == RUNNING else status.READY


def result_of(alias: str, task: Any, info: TaskInfo, runs: List[RunInfo]) -> Any:
    """The `TaskResult` of the Django task `task` (`django_task`) from its taskrunner task and
    its runs."""
    spec = info.data
    run_after = spec.get("run_after")
    task = task.using(
        priority=info.priority, queue_name=info.queue, backend=alias,
        run_after=local_time(datetime.fromisoformat(run_after)) if run_after else None)
    status = status_of(info)
    started = [run.started_on for run in runs if run.started_on is not None]
    finished = status in (tasks.TaskResultStatus.SUCCESSFUL, tasks.TaskResultStatus.FAILED)
    result = tasks.TaskResult(
        task=task, id=str(info.id), status=status, enqueued_at=local_time(info.queued_on),
        started_at=local_time(min(started)) if started else None,
        last_attempted_at=local_time(max(started)) if started else None,
        finished_at=local_time(info.finished_on) if finished else None,
        args=spec["args"], kwargs=spec["kwargs"], backend=alias,
        errors=[tasks.TaskError(exception_class_path=exception_class_path(run),
                                traceback=run.traceback or run.error_message or "")
                for run in runs if run.status in FAILED],
        worker_ids=[str(run.runner_id) for run in runs if run.runner_id is not None])
    if status == tasks.TaskResultStatus.SUCCESSFUL and isinstance(info.results, dict):
        object.__setattr__(result, "_return_value", info.results.get("return_value"))
    return result
