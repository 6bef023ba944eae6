"""`TaskQueue`: the user's API — add tasks, read them back, retry, cancel, wait for work to
be done in-process in tests. Everything else (runners, the overseer, the CLI) works on the
`Store` and the rule modules below this facade.
"""
from datetime import datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

from . import concurrency, enqueue, lifecycle, maintenance, queues, reads, rotation
from . import periodic  # noqa: F401 - registers the periodic tasks' outcome hook
from .config import Config
from .models import utcnow
from .reads import QueueInfo, RunInfo, TaskInfo
from .store import Store


class TaskQueue:
    """The queue in one database.

    ``TaskQueue("sqlite:///taskrunner.db")``, ``TaskQueue("postgresql://user@host/db")``,
    ``TaskQueue("/etc/taskrunner.toml")``, ``TaskQueue(Config)``, or ``TaskQueue()`` for
    $TASKRUNNER_CONFIG / $TASKRUNNER_DATABASE_URL / the defaults.

    Opening a queue changes no schema: a database whose schema is behind this version
    raises `SchemaBehind`, unless ``migrate=True`` (or ``taskrunner init-db`` ran). Each
    queue works on its own database, whatever other queues the process has open.
    """

    def __init__(self, url_or_config: Union[str, Config, Store, None] = None, *,
                 migrate: bool = False) -> None:
        if isinstance(url_or_config, Store):
            # A runner's own store: what `run.queue` is inside a handler.
            self.config, self.store = url_or_config.config, url_or_config
            return
        if isinstance(url_or_config, Config):
            config = url_or_config
        elif url_or_config is None:
            config = Config.load()
        elif "://" in str(url_or_config):
            config = Config.from_dict({"database": {"url": str(url_or_config)}}, source="<url>")
        else:
            config = Config.load(path=str(url_or_config))
        self.config = config
        self.store = Store(config)
        if migrate:
            self.store.migrate()
        else:
            self.store.require_schema()

    def __enter__(self) -> "TaskQueue":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def migrate(self) -> List[str]:
        """Bring the schema up to date; returns the migrations applied."""
        return list(self.store.migrate())

    def close(self) -> None:
        self.store.close()

    # -- adding tasks -------------------------------------------------------------------------

    def add_task(self, handler: str, data: Any = None, *,
                 scheduled_on: Optional[datetime] = None, max_retries: Optional[int] = None,
                 priority: int = 0, run_timeout: Optional[float] = None,
                 unique_key: Optional[str] = None, queued_by: Optional[str] = None,
                 max_runtime: Optional[float] = None,
                 retry_backoff: Optional[float] = None, queue: Optional[str] = None,
                 concurrency_key: Optional[str] = None,
                 concurrency_limit: Optional[int] = None, connection: Any = None) -> int:
        """Queue one task and return its id. `scheduled_on` is an aware datetime (a naive
        one is refused) or None for now. With `unique_key`, adding a key that a not-yet-final
        task holds stores nothing and returns that task's id. `queue`: None for the
        handler class's ``queue`` attribute, else ``default``. With `concurrency_key`, at
        most `concurrency_limit` (default 1) runs of the tasks sharing the key are live at
        once, on all hosts; such a task's run is created by the next pass of the queue.

        `connection`: the application's open DB-API connection (sqlite3, psycopg, PyMySQL;
        or a SQLAlchemy ``Connection`` / Django ``connection``) to this queue's database:
        the task is written inside its transaction and commits or rolls back with it. Call
        `wake()` after the commit (PostgreSQL needs none: the server delivers a NOTIFY at
        commit)."""
        return int(enqueue.add_task(
            self.store, handler, data=data, scheduled_on=scheduled_on, max_retries=max_retries,
            priority=priority, run_timeout=run_timeout, unique_key=unique_key,
            queued_by=queued_by, max_runtime=max_runtime, retry_backoff=retry_backoff,
            queue=queue, concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
            connection=connection))

    def add_tasks(self, tasks: Iterable[Mapping[str, Any]], *,
                  connection: Any = None) -> List[int]:
        """Queue many tasks (dicts of add_task's arguments, with "handler"). All are
        validated first; those without a unique_key are stored in one transaction (with
        `connection`, all in the caller's, as for add_task)."""
        return [int(task_id) for task_id in enqueue.add_tasks(self.store, [
            dict(spec) for spec in tasks], connection=connection)]

    def wake(self) -> None:
        """Wake this host's idle runners now: after committing tasks added with
        ``connection=`` (before the commit they would find nothing and sleep on)."""
        self.store.wake_local()

    # -- reading ------------------------------------------------------------------------------

    def get_task(self, task_id: int) -> TaskInfo:
        """The task; TaskNotFound for an unknown id."""
        return reads.get_task(self.store, task_id)

    def runs_of(self, task_id: int) -> List[RunInfo]:
        """Every run of the task, oldest first."""
        return reads.runs_of(self.store, task_id)

    def tasks(self, status: Optional[str] = None, limit: int = 100) -> List[TaskInfo]:
        """Tasks, most recent first; `status` a run status or ``given-up``."""
        return reads.list_tasks(self.store, status=status, limit=limit)

    # -- the operator's verbs -----------------------------------------------------------------

    def retry(self, task_id: int) -> None:
        """Re-arm a failed or given-up task: its failures count from zero, a run now."""
        lifecycle.retry(self.store, task_id)

    def cancel(self, task_id: int) -> None:
        """Cancel a task that is not running."""
        lifecycle.cancel(self.store, task_id)

    def pause_queue(self, name: str) -> bool:
        """Stop claiming from the queue `name` on every host (within one check_interval);
        runs in flight finish. Returns False when it was paused already."""
        return bool(queues.set_paused(self.store, name, True))

    def resume_queue(self, name: str) -> bool:
        """Claim from the queue `name` again. Returns False when it was not paused."""
        return bool(queues.set_paused(self.store, name, False))

    def queues(self) -> List[QueueInfo]:
        """Every queue: paused, limit, runs scheduled and running, runners, lag."""
        return reads.queue_stats(self.store)

    def process_queue(self) -> Dict[str, Any]:
        """Mark dead runners, time out overdue runs, create due runs (what the overseer does
        every check_interval)."""
        return maintenance.process_queue(self.store)

    def rotate(self) -> Dict[str, int]:
        """Delete old ended tasks and runner rows ([rotation] settings)."""
        return dict(rotation.rotate(self.store, utcnow()))

    def run_pending(self, max_runs: Optional[int] = None) -> int:
        """Run due work in this process until none is left (or `max_runs`); returns how
        many runs were executed. For tests of handlers: no processes, no signals."""
        from .runner import Worker
        done = 0
        while max_runs is None or done < max_runs:
            maintenance.process_queue(self.store)
            worker = Worker(self.store, install_signals=False, memory_limit=False)
            ran = int(worker.work(burst=True, max_runs=None if max_runs is None
                                  else max_runs - done))
            done += ran
            # Again only for tasks that waited for a slot of their concurrency key.
            if not ran or not concurrency.has_waiting(self.store):
                break
        return done


__all__ = ["TaskQueue"]
