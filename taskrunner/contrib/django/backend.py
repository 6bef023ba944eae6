"""`TaskrunnerBackend`: Django's Tasks API on taskrunner's queue.

A Django task becomes one taskrunner task of the handler `RunDjangoTask` whose data is
``{"task": module path, "args": [...], "kwargs": {...}, "backend": alias, "run_after":
ISO 8601 or null}``; its result is read back from the task and its runs (`result_of`).
"""
from datetime import datetime
from typing import Any, Dict, List, Optional

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from ...api import TaskQueue
from ...config import Config, check_queue_name
from ...errors import TaskNotFound, TaskRunnerError
from ...reads.records import RunInfo, TaskInfo
from ...store.models import CANCELLED, FAILED, RUNNING, SUCCESS
from .compat import tasks
from .database import url_of

HANDLER = "taskrunner.contrib.django.handler.RunDjangoTask"
# OPTIONS: where the tables are (a DATABASES alias, else a URL of their own), a taskrunner
# config file for everything else, and the retry policy of the tasks this backend adds.
TASK_OPTIONS = {"MAX_RETRIES": "max_retries", "RUN_TIMEOUT": "run_timeout",
                "MAX_RUNTIME": "max_runtime", "RETRY_BACKOFF": "retry_backoff"}
OPTIONS = {"DATABASE", "URL", "CONFIG"} | set(TASK_OPTIONS)


class TaskrunnerBackend(tasks.BaseTaskBackend):
    """Tasks stored in taskrunner's tables and run by its runners.

    ``OPTIONS``: ``DATABASE`` (a ``DATABASES`` alias, default ``"default"``: the tables live
    in the application's database, and `enqueue` commits with its transaction) or ``URL``
    (a taskrunner database URL of their own); ``CONFIG`` (a taskrunner TOML file: runner
    limits, queues, retention); ``MAX_RETRIES``, ``RUN_TIMEOUT``, ``MAX_RUNTIME``,
    ``RETRY_BACKOFF`` for every task it adds. ``QUEUES`` are taskrunner queues.

    Priority: Django's -100..100 is taskrunner's priority as it is (higher runs first, the
    same order as Django's).
    """

    supports_defer = True
    supports_priority = True
    supports_get_result = True
    supports_async_task = True

    def __init__(self, alias: str, params: Dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - OPTIONS)
        if unknown:
            raise ImproperlyConfigured("TASKS[%r] OPTIONS: unknown option %s (expected %s)"
                                       % (alias, ", ".join(unknown), ", ".join(sorted(OPTIONS))))
        if "URL" in self.options and "DATABASE" in self.options:
            raise ImproperlyConfigured("TASKS[%r] OPTIONS: DATABASE or URL, not both" % alias)
        self.database: Optional[str] = (None if "URL" in self.options
                                        else self.options.get("DATABASE", "default"))
        for name in self.queues:
            try:
                check_queue_name(name)
            except TaskRunnerError as exc:
                raise ImproperlyConfigured("TASKS[%r] QUEUES: %s" % (alias, exc)) from None
        self.task_options = {TASK_OPTIONS[key]: value for key, value in self.options.items()
                             if key in TASK_OPTIONS}
        self._queues: Dict[str, TaskQueue] = {}

    # -- the queue --------------------------------------------------------------------------

    def database_url(self) -> str:
        """The taskrunner URL of the tables: from the Django database's settings as they are
        now (Django's test runner renames the database it tests on)."""
        if self.database is None:
            return str(self.options["URL"])
        from django.db import connections
        return url_of(connections[self.database].settings_dict, self.database)

    def queue(self, migrate: bool = False) -> TaskQueue:
        """The `TaskQueue` of this backend's database (one per URL, kept)."""
        url = self.database_url()
        queue = self._queues.get(url)
        if queue is None or migrate:
            config = Config.load(path=self.options.get("CONFIG"), database_url=url)
            if queue is not None:
                queue.close()
            queue = self._queues[url] = TaskQueue(config, migrate=migrate)
        return queue

    def check(self, **kwargs: Any) -> List[checks.CheckMessage]:
        try:
            self.database_url()
        except TaskRunnerError as exc:
            return [checks.Error(str(exc), obj="TASKS[%r]" % self.alias,
                                 id="taskrunner.E001")]
        return []

    # -- adding -----------------------------------------------------------------------------

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        run_after = task.run_after
        if run_after is not None and timezone.is_naive(run_after):
            run_after = timezone.make_aware(run_after)     # USE_TZ = False: local time
        data = {"task": task.module_path, "args": tasks.normalize_json(list(args)),
                "kwargs": tasks.normalize_json(dict(kwargs)), "backend": self.alias,
                "run_after": run_after.isoformat() if run_after is not None else None}
        options = dict(self.task_options, priority=task.priority, queue=task.queue_name,
                       scheduled_on=run_after)
        queue = self.queue()
        if self.database is None:
            task_id = queue.add_task(HANDLER, data, **options)
            result = self._ready(task, task_id, data)
            tasks.task_enqueued.send(type(self), task_result=result)
            return result
        from django.db import connections, transaction
        # Through Django's own connection and transaction: a rollback leaves no task, and the
        # runners are woken only once it is committed (before, they would find nothing).
        with transaction.atomic(using=self.database):
            task_id = queue.add_task(HANDLER, data, connection=connections[self.database],
                                     **options)
            result = self._ready(task, task_id, data)
            transaction.on_commit(lambda: self._committed(queue, result), using=self.database)
        return result

    def _committed(self, queue: TaskQueue, result: Any) -> None:
        queue.wake()
        tasks.task_enqueued.send(type(self), task_result=result)

    def _ready(self, task: Any, task_id: int, data: Dict[str, Any]) -> Any:
        return tasks.TaskResult(
            task=task, id=str(task_id), status=tasks.TaskResultStatus.READY,
            enqueued_at=timezone.now(), started_at=None, finished_at=None,
            last_attempted_at=None, args=data["args"], kwargs=data["kwargs"],
            backend=self.alias, errors=[], worker_ids=[])

    # -- reading ----------------------------------------------------------------------------

    def get_result(self, result_id: str) -> Any:
        try:
            task_id = int(result_id)
        except (TypeError, ValueError):
            raise tasks.TaskResultDoesNotExist(result_id) from None
        queue = self.queue()
        try:
            info, runs = queue.get_task(task_id), queue.runs_of(task_id)
        except TaskNotFound:
            raise tasks.TaskResultDoesNotExist(result_id) from None
        if info.handler != HANDLER:     # a taskrunner task that is no Django task
            raise tasks.TaskResultDoesNotExist(result_id)
        return result_of(self.alias, info, runs)


def _local(value: Optional[datetime]) -> Optional[datetime]:
    """An aware UTC datetime as Django gives datetimes: aware with USE_TZ, else naive local."""
    if value is None or settings.USE_TZ:
        return value
    return timezone.make_naive(value)


def exception_class_path(run: RunInfo) -> str:
    """The exception a failed run raised (stored by `RunDjangoTask`); a run that never
    raised one (its runner died, its timeout passed) gets the nearest builtin."""
    if isinstance(run.results, dict) and isinstance(run.results.get("exception_class_path"), str):
        return str(run.results["exception_class_path"])
    if run.error_code == "HandlerError":
        return "taskrunner.errors.HandlerError"
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


def result_of(alias: str, info: TaskInfo, runs: List[RunInfo]) -> Any:
    """The `TaskResult` of a task of `RunDjangoTask` and its runs."""
    spec = info.data
    run_after = spec.get("run_after")
    task = import_string(spec["task"]).using(
        priority=info.priority, queue_name=info.queue, backend=alias,
        run_after=_local(datetime.fromisoformat(run_after)) if run_after else None)
    status = status_of(info)
    started = [run.started_on for run in runs if run.started_on is not None]
    finished = status in (tasks.TaskResultStatus.SUCCESSFUL, tasks.TaskResultStatus.FAILED)
    result = tasks.TaskResult(
        task=task, id=str(info.id), status=status, enqueued_at=_local(info.queued_on),
        started_at=_local(min(started)) if started else None,
        last_attempted_at=_local(max(started)) if started else None,
        finished_at=_local(info.finished_on) if finished else None,
        args=spec["args"], kwargs=spec["kwargs"], backend=alias,
        errors=[tasks.TaskError(exception_class_path=exception_class_path(run),
                                traceback=run.traceback or run.error_message or "")
                for run in runs if run.status in FAILED],
        worker_ids=[str(run.runner_id) for run in runs if run.runner_id is not None])
    if status == tasks.TaskResultStatus.SUCCESSFUL and isinstance(info.results, dict):
        object.__setattr__(result, "_return_value", info.results.get("return_value"))
    return result
