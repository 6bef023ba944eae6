"""`TaskrunnerBackend`: Django's Tasks API on taskrunner's queue.

A Django task becomes one taskrunner task whose handler is the task's import path
(``shop.tasks.send_receipt``: its name in the CLI, the dashboard and the metrics) and whose
data is ``{"args": [...], "kwargs": {...}, "backend": alias, "run_after": ISO 8601 or
null}``; its result is read back from the task and its runs (results.py).

The backend's ``task_class`` is `TaskrunnerTask` (handler.py): Django's ``@task`` makes the
object at that path with it, and the object names the handler that runs it, so a runner
finds the handler by importing the path, as it finds any other. A task whose ``@task`` names
another backend is a plain Django `Task` that names no handler; enqueued here (``.using(
backend=...)``) it is stored as every Django task was before: under `RUN_DJANGO_TASK`, its
path in the data (``"task"``).
"""
import os
from datetime import datetime
from typing import Any, Dict, List, Optional

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from ...api import TaskQueue
from ...config import Config, check_queue_name
from ...errors import TaskNotFound, TaskRunnerError
from ...reads.records import aware
from .compat import tasks
from .database import url_of
from .handler import TaskrunnerTask
from .results import RUN_DJANGO_TASK, django_task, local_time, result_of

# OPTIONS: where the tables are (a DATABASES alias, else a URL of their own), a taskrunner
# config file for everything else, and the retry policy of the tasks this backend adds.
TASK_OPTIONS = {"MAX_ATTEMPTS": "max_attempts", "MAX_RETRIES": "max_retries",
                "RUN_TIMEOUT": "run_timeout",
                "MAX_RUNTIME": "max_runtime", "RETRY_BACKOFF": "retry_backoff"}
OPTIONS = {"DATABASE", "URL", "CONFIG"} | set(TASK_OPTIONS)


class TaskrunnerBackend(tasks.BaseTaskBackend):
    """Tasks stored in taskrunner's tables and run by its runners.

    ``OPTIONS``: ``DATABASE`` (a ``DATABASES`` alias, default ``"default"``: the tables live
    in the application's database, and `enqueue` commits with its transaction) or ``URL``
    (a taskrunner database URL of their own); ``CONFIG`` (a taskrunner TOML file: runner
    limits, queues, retention); ``MAX_ATTEMPTS`` (runs in all; ``MAX_RETRIES`` is the same
    count by its older name), ``RUN_TIMEOUT``, ``MAX_RUNTIME``, ``RETRY_BACKOFF`` for every
    task it adds. ``QUEUES`` are taskrunner queues.

    Priority: Django's -100..100 is taskrunner's priority as it is (higher runs first, the
    same order as Django's).
    """

    task_class = TaskrunnerTask
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
            config = self.config(url)
            if queue is not None:
                queue.close()
            queue = self._queues[url] = TaskQueue(config, migrate=migrate)
        return queue

    def declared_queues(self) -> str:
        """$TASKRUNNER_QUEUES for this backend: its ``QUEUES`` (besides any already there),
        each a lane of its own with runners of its own, as Django users expect: a runner
        serving ``default`` would otherwise also run every queue the config has no
        ``[queues.NAME]`` table for."""
        given = [n.strip() for n in os.environ.get("TASKRUNNER_QUEUES", "").split(",")]
        return ",".join(sorted({n for n in given if n} | set(self.queues)))

    def config(self, url: Optional[str] = None) -> Config:
        """The taskrunner config of this backend: ``CONFIG`` (or the defaults), this
        backend's queues declared (`declared_queues`), the tables at `url`."""
        config: Config = Config.load(
            path=self.options.get("CONFIG"), database_url=url,
            environ=dict(os.environ, TASKRUNNER_QUEUES=self.declared_queues()))
        return config

    def check(self, **kwargs: Any) -> List[checks.CheckMessage]:
        try:
            self.database_url()
            self.config()
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
        data = {"args": tasks.normalize_json(list(args)),
                "kwargs": tasks.normalize_json(dict(kwargs)), "backend": self.alias,
                "run_after": run_after.isoformat() if run_after is not None else None}
        handler = task.module_path
        if not isinstance(task, TaskrunnerTask):     # its @task names another backend
            handler, data = RUN_DJANGO_TASK, dict(data, task=task.module_path)
        options = dict(self.task_options, priority=task.priority, queue=task.queue_name,
                       scheduled_on=run_after)
        queue = self.queue()
        if self.database is None:
            task_id = queue.add_task(handler, data, **options)
            result = self._ready(task, task_id, data, queue.get_task(task_id).queued_on)
            tasks.task_enqueued.send(type(self), task_result=result)
            return result
        from django.db import connections, transaction
        # Through Django's own connection and transaction: a rollback leaves no task, and the
        # runners are woken only once it is committed (before, they would find nothing).
        connection = connections[self.database]
        with transaction.atomic(using=self.database):
            task_id = queue.add_task(handler, data, connection=connection, **options)
            result = self._ready(task, task_id, data, self._queued_on(queue, connection,
                                                                      task_id))
            transaction.on_commit(lambda: self._committed(queue, result), using=self.database)
        return result

    @staticmethod
    def _queued_on(queue: TaskQueue, connection: Any, task_id: int) -> Optional[datetime]:
        """The task's queued_on as stored, read in the transaction that added it (the
        store's own connection cannot see it before the commit)."""
        Task = queue.store.Task
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s FROM %s WHERE id = %%s" % (
                Task.queued_on.column_name, Task._meta.table_name), [task_id])
            value = cursor.fetchone()[0]
        return aware(Task.queued_on.python_value(value))

    def _committed(self, queue: TaskQueue, result: Any) -> None:
        queue.wake()
        tasks.task_enqueued.send(type(self), task_result=result)

    def _ready(self, task: Any, task_id: int, data: Dict[str, Any],
               queued_on: Optional[datetime]) -> Any:
        """The result of a task just added, as `get_result` reads it back: enqueued_at is
        the stored queued_on, not a second reading of the clock."""
        return tasks.TaskResult(
            task=task, id=str(task_id), status=tasks.TaskResultStatus.READY,
            enqueued_at=local_time(queued_on), started_at=None, finished_at=None,
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
        task = django_task(info)
        if task is None:        # a taskrunner task that is no Django task
            raise tasks.TaskResultDoesNotExist(result_id)
        return result_of(self.alias, task, info, runs)
