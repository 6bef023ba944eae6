"""`TaskQueue`: the user's API — add tasks, read them back, retry, cancel, wait for work to
be done in-process in tests. Everything else (runners, the overseer, the CLI) works on the
`Store` and the rule modules below this facade.
"""
import asyncio
import select
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional,
                    TypeVar, Union)

from .runs import concurrency, control, durable, enqueue, flow, lifecycle, queues, rotation
from .fleet import maintenance
from .reads import records as reads
from .host import wakeup
from .periodic import scheduler as periodic
from .config import Config
from .store.db import SCHEMES
from .errors import InputError, TaskNotFound, WaitTimeout
from .store.models import as_utc, utcnow
from .reads.records import QueueInfo, RerunInfo, RunInfo, StepInfo, TaskInfo, TaskOutcome
from .reads import workflows as workflow_reads
from .reads.workflows import ParentResults, WorkflowInfo
from .store.bound import Store

if TYPE_CHECKING:
    from typing import Protocol
    from .reads.versions import VersionInfo
    if sys.version_info >= (3, 10):
        from typing import ParamSpec
        P = ParamSpec("P")
    H = TypeVar("H", covariant=True)

    class Enqueueable(Protocol[P, H]):
        """A function task (`functions.FunctionTask`) as `TaskQueue.enqueue` uses it, its
        handle `H`: named here, as functions.py opens a TaskQueue (a type imported back from
        it would close an import circle)."""

        def using(self, *, on: "TaskQueue") -> "Enqueueable[P, H]": ...

        def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> H: ...

# TaskQueue.wait reads the task at least this often (seconds): the bound on seeing an end
# that no wake-up reported (another host, a runner that died).
WAIT_POLL = 1.0
# Threads of a queue's awaitable methods. The event loop's thread competes for the GIL with
# each busy one: under 200 concurrent requests of tests/test_async.py the loop lagged 60-140 ms
# with two threads (and more with the default executor's), about 20 ms with one.
ASYNC_THREADS = 1


class TaskQueue:
    """The queue in one database.

    ``TaskQueue("sqlite:///taskrunner.db")``, ``TaskQueue("postgresql://user@host/db")``,
    ``TaskQueue("/etc/taskrunner.toml")``, ``TaskQueue(Config)``, or ``TaskQueue()`` for
    $TASKRUNNER_CONFIG / $TASKRUNNER_DATABASE_URL / the defaults.

    Opening a queue changes no schema: a database whose schema is behind this version
    raises `SchemaBehind`, unless ``migrate=True`` (or ``taskrunner init-db`` ran). Each
    queue works on its own database, whatever other queues the process has open.

    A SQLite URL that names no file (``sqlite://``, ``sqlite:///:memory:``) is refused with
    `ConfigError`: the tasks would vanish with the process. ``ephemeral=True`` allows it, for
    tests that run their tasks in-process (`run_pending`); the database lives in this
    thread's connection only.
    """

    def __init__(self, url_or_config: Union[str, Config, Store, None] = None, *,
                 migrate: bool = False, ephemeral: bool = False) -> None:
        self._watches: Dict[asyncio.AbstractEventLoop, "_EndWatch"] = {}
        self._executor: Optional[ThreadPoolExecutor] = None
        periodic.install_hooks()
        if isinstance(url_or_config, Store):
            # A runner's own store: what `run.queue` is inside a handler.
            self.config, self.store = url_or_config.config, url_or_config
            return
        if isinstance(url_or_config, Config):
            config = url_or_config
        elif url_or_config is None:
            config = Config.load()
        elif "://" in str(url_or_config) or str(url_or_config).partition(":")[0] in SCHEMES:
            config = Config.from_dict({"database": {"url": str(url_or_config)}}, source="<url>")
        else:
            config = Config.load(path=str(url_or_config))
        self.config = config
        self.store = Store(config, ephemeral=ephemeral)
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
        if self._executor is not None:
            # Its thread's connection is its own: closed there (peewee's are per thread).
            self._executor.submit(self.store.close)
            self._executor.shutdown(wait=True)
            self._executor = None
        self.store.close()

    # -- adding tasks -------------------------------------------------------------------------

    def add_task(self, handler: str, data: Any = None, *,
                 scheduled_on: Optional[datetime] = None, max_retries: Optional[int] = None,
                 priority: int = 0, run_timeout: Union[float, str, None] = None,
                 unique_key: Optional[str] = None, queued_by: Optional[str] = None,
                 max_runtime: Union[float, str, None] = None,
                 retry_backoff: Union[float, str, None] = None, queue: Optional[str] = None,
                 concurrency_key: Optional[str] = None,
                 concurrency_limit: Optional[int] = None, rate_key: Optional[str] = None,
                 tenant: Optional[str] = None, connection: Any = None,
                 after: Optional[Iterable[int]] = None,
                 on_parent_failure: Optional[str] = None,
                 delay: Union[float, str, None] = None,
                 debounce: Union[float, str, None] = None, debounce_key: Optional[str] = None,
                 debounce_max: Union[float, str, None] = None,
                 debounce_keep: Optional[str] = None,
                 max_attempts: Optional[int] = None) -> int:
        """Queue one task and return its id. `scheduled_on` is an aware datetime (a naive
        one is refused) or None for now; `delay` instead: due that long from now (seconds
        or a span, ``"5min"``). With `unique_key`, adding a key that a not-yet-final
        task holds stores nothing and returns that task's id. `queue`: None for the
        handler class's ``queue`` attribute, else ``default``. With `concurrency_key`, at
        most `concurrency_limit` (default 1) runs of the tasks sharing the key are live at
        once, on all hosts; such a task's run is created by the next pass of the queue.
        `run_timeout`, `max_runtime` and `retry_backoff` are seconds or spans as the config
        writes them (``"5min"``); `retry_backoff` may be 0 (retry at once). `rate_key`:
        its runs start no faster than that key's rate limit allows, on all hosts
        (`set_rate_limit`, ``[rate_limits]``); `tenant`: whose task it is, which a queue
        with ``fair_by = "tenant"`` round-robins between. `max_attempts`: the runs it may
        take in all, the first included, before it is given up (1: no retry); `max_retries`
        is the same count by its older name (default ``[task] max_retries``).

        `connection`: the application's open DB-API connection (sqlite3, psycopg, PyMySQL;
        or a SQLAlchemy ``Connection`` / Django ``connection``) to this queue's database:
        the task is written inside its transaction and commits or rolls back with it. Call
        `wake()` after the commit (PostgreSQL needs none unless through a pooler: the server
        delivers a NOTIFY at commit).

        `after`: ids of tasks this one runs after. It waits, without a run, until all of
        them succeeded (one that already did counts as done; an unknown id is refused),
        and gets its run in the transaction of the last success. A parent given up or
        cancelled cancels it (``ParentFailed``, and its own dependents in turn), unless
        `on_parent_failure` is ``"run"``: then it runs anyway. It joins the workflow of
        its first parent that has one. Not with `connection` or `unique_key`.

        `debounce` (seconds or a span, ``"30s"``): enqueues of `debounce_key` (default: the
        handler) within that span of each other collapse into one task, on every host: the
        first adds a task due `debounce` later; each later one while that task is not due
        yet moves it to `debounce` after itself (at most `debounce_max` after the first)
        and gives it its data (`debounce_keep` ``"last"``, the default) or keeps the first's
        (``"first"``); it returns that task's id. Once the task is due, the next enqueue adds
        a new task. Not with `scheduled_on`, `delay`, `unique_key`, `after` or
        `connection`."""
        return int(enqueue.add_task(
            self.store, handler, data=data, scheduled_on=scheduled_on, max_retries=max_retries,
            priority=priority, run_timeout=run_timeout, unique_key=unique_key,
            queued_by=queued_by, max_runtime=max_runtime, retry_backoff=retry_backoff,
            queue=queue, concurrency_key=concurrency_key, concurrency_limit=concurrency_limit,
            rate_key=rate_key, tenant=tenant, connection=connection,
            after=None if after is None else list(after), on_parent_failure=on_parent_failure,
            delay=delay, debounce=debounce, debounce_key=debounce_key,
            debounce_max=debounce_max, debounce_keep=debounce_keep,
            max_attempts=max_attempts))

    def enqueue(self, function_task: "Enqueueable[P, H]", *args: "P.args",
                **kwargs: "P.kwargs") -> "H":
        """Queue a run of a function task (``@task``) in this queue's database, with the
        function's own arguments: ``fn.using(on=queue).enqueue(...)``."""
        return function_task.using(on=self).enqueue(*args, **kwargs)

    def add_tasks(self, tasks: Iterable[Mapping[str, Any]], *,
                  connection: Any = None) -> List[int]:
        """Queue many tasks (dicts of add_task's arguments, with "handler"). All are
        validated first; those without a unique_key are stored in one transaction (with
        `connection`, all in the caller's, as for add_task)."""
        return [int(task_id) for task_id in enqueue.add_tasks(self.store, [
            dict(spec) for spec in tasks], connection=connection)]

    # -- workflows: tasks that run after others -------------------------------------------------

    def add_workflow(self, tasks: Iterable[Union[str, Mapping[str, Any]]],
                     name: Optional[str] = None) -> "WorkflowAdded":
        """Queue `tasks` together, in one transaction, as one workflow: each a dict of
        add_task's arguments with its "handler" (or just a handler path), plus "key" (a
        name for the tasks after it to refer to) and "after" (keys of tasks before it in
        `tasks`, and ids of existing tasks). Returns the workflow's id and its task ids;
        read it with `workflow`, `wait_workflow`, `cancel_workflow`."""
        specs = [_spec(task) for task in tasks]
        if not specs:
            raise InputError("a workflow needs at least one task")
        workflow_id, ids = enqueue.add_graph(self.store, specs, workflow=name or "")
        return WorkflowAdded(int(workflow_id), [int(i) for i in ids])

    def chain(self, *tasks: Union[str, Mapping[str, Any]], name: Optional[str] = None,
              on_parent_failure: Optional[str] = None) -> "WorkflowAdded":
        """A workflow of `tasks` (as `add_workflow`'s, without "key" and "after") each run
        after the one before it succeeded. `on_parent_failure` for every task after the
        first (default: a failure cancels the rest)."""
        specs = []
        for index, task in enumerate(tasks):
            spec = dict(_spec(task), key="#%d" % index)
            if index:
                spec["after"] = ["#%d" % (index - 1)]
                if on_parent_failure is not None:
                    spec.setdefault("on_parent_failure", on_parent_failure)
            specs.append(spec)
        return self.add_workflow(specs, name=name)

    def group(self, tasks: Iterable[Union[str, Mapping[str, Any]]],
              then: Union[str, Mapping[str, Any], None] = None,
              name: Optional[str] = None) -> "WorkflowAdded":
        """A workflow of `tasks` run side by side (fan-out) and, with `then`, one task after
        all of them (fan-in: its handler reads their results in ``run.parent_results``);
        its task id is the last of the returned ids. Thousands of tasks are added in
        multi-row INSERTs."""
        specs = [dict(_spec(task), key="#%d" % index) for index, task in enumerate(tasks)]
        if then is not None:
            specs.append(dict(_spec(then), after=[spec["key"] for spec in specs]))
        return self.add_workflow(specs, name=name)

    def workflow(self, workflow_id: int, graph: bool = True) -> WorkflowInfo:
        """A workflow's state: counts per state, progress, outcome and (with `graph`) its
        tasks with the tasks each runs after."""
        return workflow_reads.workflow_info(self.store, workflow_id, graph=graph)

    def wait_workflow(self, workflow_id: int, timeout: Optional[float] = None) -> WorkflowInfo:
        """Block until every task of the workflow is final; its state then (without the
        graph). `WaitTimeout` after `timeout` seconds."""
        return self._wait_for(
            lambda: workflow_reads.workflow_info(self.store, workflow_id, graph=False),
            lambda info: info.done, timeout, "workflow %d" % workflow_id)

    def cancel_workflow(self, workflow_id: int) -> Dict[str, int]:
        """Cancel every unfinished task of the workflow (running ones cooperatively, as
        `cancel`): {"cancelled": ended now, "stopping": running ones asked to stop}."""
        workflow_reads.workflow_info(self.store, workflow_id, graph=False)   # exists
        ids = workflow_reads.workflow_task_ids(self.store, workflow_id, unfinished=True)
        # The last first: each is cancelled by the operator, not by its parent's cancel.
        cancelled, stopping = control.cancel_workflow(self.store, reversed(ids))
        return {"cancelled": cancelled, "stopping": stopping}

    def parent_results(self, task_id: int) -> ParentResults:
        """The results of the tasks `task_id` runs after, keyed by task id, read in pages
        (a handler's ``run.parent_results``)."""
        return ParentResults(self.store, task_id)

    async def add_workflow_async(self, tasks: Iterable[Union[str, Mapping[str, Any]]],
                                 name: Optional[str] = None) -> "WorkflowAdded":
        """`add_workflow`, awaitable."""
        specs = list(tasks)
        return await self._in_thread(lambda: self.add_workflow(specs, name=name))

    async def wait_workflow_async(self, workflow_id: int,
                                  timeout: Optional[float] = None) -> WorkflowInfo:
        """`wait_workflow`, awaitable (in a thread of the queue's executor)."""
        return await self._in_thread(lambda: self.wait_workflow(workflow_id, timeout))

    def wake(self) -> None:
        """Wake this host's idle runners now: after committing tasks added with
        ``connection=`` (before the commit they would find nothing and sleep on)."""
        self.store.wake_local()

    # -- reading ------------------------------------------------------------------------------

    def get_task(self, task_id: int) -> TaskInfo:
        """The task; TaskNotFound for an unknown id."""
        return reads.get_task(self.store, task_id)

    def status_of(self, task_id: int) -> str:
        """The task's status word (as `get_task(id).status`), in one read of its row: for a
        poll. TaskNotFound for an unknown id."""
        return reads.status_of(self.store, task_id)

    def outcomes(self, task_ids: Iterable[int]) -> Dict[int, Optional[TaskOutcome]]:
        """{id: the task's outcome, or None while it has not ended} for many tasks in one
        read; an unknown id is left out."""
        return reads.task_outcomes(self.store, [int(task_id) for task_id in task_ids])

    def runs_of(self, task_id: int) -> List[RunInfo]:
        """Every run of the task, oldest first."""
        return reads.runs_of(self.store, task_id)

    def steps_of(self, task_id: int) -> List[StepInfo]:
        """The steps the task has recorded (``run.step``, sleeps, events), in order."""
        return reads.steps_of(self.store, task_id)

    def code_versions(self) -> List["VersionInfo"]:
        """Per code version, the runners running it and the durable tasks not ended that
        started under it, newest first: ``drained`` once neither is left (docs: "Changing
        durable code under running work")."""
        from .reads import versions
        return versions.code_versions(self.store)

    def reruns_of(self, task_id: int) -> List[RerunInfo]:
        """The task's re-runs from a step (`rerun_from`), oldest first: the step, how many
        steps each dropped, who asked and why, when, and the run it made."""
        reads.get_task(self.store, task_id)
        return reads.reruns_of(self.store, task_id)

    def send_event(self, task_id: int, name: str, payload: Any = None) -> bool:
        """Send the event `name`, with a JSON `payload`, to a task: when the task is
        ``waiting`` for it (``run.wait_for(name)``), its run is created at once, in the same
        transaction that stores the event, and this host's runners are woken; an event the
        task does not wait for yet is kept, and its next ``run.wait_for(name)`` takes it (events
        of one name are taken in the order they were sent, one per wait).
        Returns whether the task was woken. TaskNotFound for an unknown task, StateError for
        one that has ended."""
        return bool(durable.send_event(self.store, task_id, name, payload))

    def tasks(self, status: Optional[str] = None, limit: Optional[int] = 100, offset: int = 0,
              handler: Optional[str] = None, since: Optional[datetime] = None,
              until: Optional[datetime] = None, periodic_task: Optional[str] = None,
              queue: Optional[str] = None, error_code: Optional[str] = None
              ) -> List[TaskInfo]:
        """Tasks, most recent first, `offset` skipped, at most `limit` (None: all). Filters:
        `status` one of ``scheduled running waiting retrying given-up success cancelled
        error timeout failed`` (``waiting``: sleeping, waiting for an event, or for the tasks
        it runs after; docs, "Words", says what each means; the CLI and the dashboard
        take the same words), `handler`, `since` / `until` (aware) around queued_on,
        `periodic_task` the name of the periodic task that submitted them, `queue`,
        `error_code` the code of their last error."""
        return reads.list_tasks(self.store, status=status, limit=limit, offset=offset,
                                handler=handler, since=since, until=until,
                                periodic=periodic_task, queue=queue, error_code=error_code)

    # -- the operator's verbs -----------------------------------------------------------------

    def retry(self, task_id: int, dependents: bool = True) -> int:
        """Re-arm a failed or given-up task: its failures count from zero, a run now. With
        `dependents`, the tasks that its giving up cancelled (and theirs in turn) wait for
        it again. Returns how many dependents were re-armed."""
        return int(control.retry(self.store, task_id, dependents=dependents))

    def rerun_from(self, task_id: int, step: str, reason: Optional[str] = None,
                   requested_by: Optional[str] = None) -> int:
        """Run a durable task that succeeded or gave up again from its step `step`: the steps
        recorded before it keep their results, that step and the later ones run again (its
        checkpoint is cleared), as a new run of the same task, recorded with `requested_by`
        and `reason` (`get_task(id).reruns`). Returns the new run's id. StateError for a task
        that has not ended or did not give up; InputError for a step it never recorded."""
        return int(control.rerun_from(self.store, task_id, step, reason=reason,
                                      requested_by=requested_by))

    def cancel(self, task_id: int) -> Optional[int]:
        """Cancel a task that has not ended. A running task is stopped cooperatively: its
        runner notices within ``[runner] heartbeat_interval``, ``should_stop()`` turns true,
        the handler is interrupted if it still runs after ``[overseer] kill_grace``, and the
        run and the task end ``cancelled``. Returns the id of that running run (the task is
        not cancelled yet: `wait` for it), or None when the task is cancelled now."""
        return control.cancel(self.store, task_id)

    def pause_queue(self, name: str, create: bool = False) -> bool:
        """Stop claiming from the queue `name` on every host (within one check_interval);
        runs in flight finish. Returns False when it was paused already. A queue no task
        used and the config does not name is refused (InputError), unless `create`."""
        return bool(queues.set_paused(self.store, name, True, create=create))

    def resume_queue(self, name: str) -> bool:
        """Claim from the queue `name` again. Returns False when it was not paused."""
        return bool(queues.set_paused(self.store, name, False))

    def set_queue_limit(self, name: str, limit: Optional[int]) -> Dict[str, Any]:
        """Set the runners serving the queue `name` at once on each host to `limit`, on every
        host without a restart (None: back to its ``[queues.NAME] limit``). A lower limit:
        runs in flight finish, and from now on no runner of a host claims beyond it; a higher
        one: overseers start more runners within a check interval. Returns ``queue``,
        ``limit`` (in force now), ``source`` (``stored`` or ``config``) and ``changed``.
        InputError (nothing stored): a limit that is not a whole number >= 1, a queue with no
        ``[queues.NAME]`` table in the config."""
        in_force, changed = queues.set_host_limit(self.store, name, limit)
        return {"queue": name, "limit": in_force,
                "source": "config" if limit is None else "stored", "changed": changed}

    def remove_queue(self, name: str) -> None:
        """Forget the queue `name`; refused (InputError) while a task is in it or the config
        names it."""
        queues.remove_queue(self.store, name)

    def queues(self) -> List[QueueInfo]:
        """Every queue: paused, limit, runs scheduled and running, runners, lag."""
        return reads.queue_stats(self.store)

    def set_rate_limit(self, key: str, rate: str, burst: float = 0) -> List[str]:
        """Limit the runs of tasks added with ``rate_key=key`` — or, for ``"PREFIX*"``, with
        any key starting with PREFIX — to `rate` (``"25/s"``, ``"/min"``, ``"/h"``) on all
        hosts together, from now on (runners see a first limit within check_interval).
        `burst`: the bucket's size, 0 for a tenth of a second of the rate (at least 1).
        Overrides the config's ``[rate_limits]`` for that pattern; an exact key wins over the
        longest prefix. Returns the keys of live tasks it applies to. InputError on bad
        input."""
        return flow.set_rate_limit(self.store, key, rate, burst)

    def clear_rate_limit(self, key: str) -> None:
        """Remove the limit `set_rate_limit` gave `key` (the config's applies again, if
        any); InputError when it has none."""
        flow.clear_rate_limit(self.store, key)

    def rate_limits(self) -> Dict[str, Any]:
        """``limits``: the key limits in force (pattern, limit, rate, burst, source), and
        ``buckets``: every queue's and key's bucket (limit, allowance now, runs throttled)."""
        return {"limits": flow.limits(self.store), "buckets": flow.buckets(self.store)}

    async def set_rate_limit_async(self, key: str, rate: str, burst: float = 0) -> List[str]:
        """`set_rate_limit`, awaitable."""
        return await self._in_thread(lambda: self.set_rate_limit(key, rate, burst))

    async def clear_rate_limit_async(self, key: str) -> None:
        """`clear_rate_limit`, awaitable."""
        await self._in_thread(lambda: self.clear_rate_limit(key))

    async def rate_limits_async(self) -> Dict[str, Any]:
        """`rate_limits`, awaitable."""
        return await self._in_thread(self.rate_limits)

    def process_queue(self) -> Dict[str, Any]:
        """Mark dead runners, time out overdue runs, create due runs (what the overseer does
        every check_interval)."""
        return maintenance.process_queue(self.store)

    def rotate(self) -> Dict[str, int]:
        """Delete old ended tasks and runner rows ([rotation] settings)."""
        return dict(rotation.rotate(self.store, utcnow()))

    def wait(self, task_id: int, timeout: Optional[float] = None) -> TaskOutcome:
        """Block until the task is final — ``success``, ``given-up`` or ``cancelled`` — and
        return its outcome (results, or the last error and traceback); `WaitTimeout` after
        `timeout` seconds (None: no limit), TaskNotFound for an unknown id.

        A run that ends on this host wakes the waiter at once; one that ends elsewhere is
        seen within WAIT_POLL seconds (the waiter reads the task again at least that often).
        """
        return self._wait_for(lambda: reads.task_outcome(self.store, task_id),
                              lambda outcome: outcome is not None, timeout,
                              "task %d" % task_id)

    def _wait_for(self, read: Callable[[], Any], done: Callable[[Any], bool],
                  timeout: Optional[float], what: str) -> Any:
        """`read()` again until `done` of it (`wait`, `wait_workflow`): woken by an end on
        this host, else every WAIT_POLL seconds; WaitTimeout naming `what` after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        try:
            listener: Optional[wakeup.Listener] = wakeup.Listener(self.store.waiters_directory)
        except OSError:     # no writable runtime directory: the poll alone
            listener = None
        try:
            while True:
                # Listening before reading: an end committed after the read still wakes us.
                value = read()
                if done(value):
                    return value
                left = WAIT_POLL if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout("%s did not end within %gs" % (what, timeout or 0))
                if listener is None:
                    time.sleep(min(left, WAIT_POLL))
                elif select.select([listener], [], [], min(left, WAIT_POLL))[0]:
                    listener.drain()
        finally:
            if listener is not None:
                listener.close()

    # -- the same, awaitable ----------------------------------------------------------------

    async def add_task_async(self, handler: str, data: Any = None, *, connection: Any = None,
                             **options: Any) -> int:
        """`add_task`, awaitable: the statements run in a thread of the loop's executor, so the
        loop never waits on the database. `connection`: a psycopg ``AsyncConnection`` with a
        transaction open, which the task joins (commits or rolls back with it; PostgreSQL's
        NOTIFY wakes the runners at its commit)."""
        if connection is None:
            return await self._in_thread(lambda: self.add_task(handler, data, **options))
        row = enqueue.task_row(self.config, handler, data=data, **options)
        return int((await enqueue.add_in_transaction_async(self.store, connection, [row]))[0])

    async def add_tasks_async(self, tasks: Iterable[Mapping[str, Any]], *,
                              connection: Any = None) -> List[int]:
        """`add_tasks`, awaitable; `connection` as for `add_task_async`."""
        specs = [dict(spec) for spec in tasks]
        if connection is None:
            return await self._in_thread(lambda: self.add_tasks(specs))
        rows = [enqueue.task_row(self.config, **spec) for spec in specs]
        return [int(task_id) for task_id in
                await enqueue.add_in_transaction_async(self.store, connection, rows)]

    async def get_task_async(self, task_id: int) -> TaskInfo:
        """`get_task`, awaitable."""
        return await self._in_thread(lambda: self.get_task(task_id))

    async def runs_of_async(self, task_id: int) -> List[RunInfo]:
        """`runs_of`, awaitable."""
        return await self._in_thread(lambda: self.runs_of(task_id))

    async def send_event_async(self, task_id: int, name: str, payload: Any = None) -> bool:
        """`send_event`, awaitable."""
        return await self._in_thread(lambda: self.send_event(task_id, name, payload))

    async def _in_thread(self, call: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(ASYNC_THREADS, "taskrunner-async")
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def wait_async(self, task_id: int, timeout: Optional[float] = None) -> TaskOutcome:
        """`wait`, awaitable, woken by the same wake-ups: every waiter of this queue in one
        event loop shares one listening socket and one read of all the awaited tasks per
        wake-up (and per WAIT_POLL), so thousands of waiters cost no thread each and never
        block the loop."""
        loop = asyncio.get_running_loop()
        watch = self._watches.get(loop)
        if watch is None:
            watch = self._watches[loop] = _EndWatch(self, loop)
        future = watch.register(task_id)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise WaitTimeout("task %d did not end within %gs" % (task_id, timeout or 0)) \
                from None
        finally:
            watch.forget(task_id, future)

    def run_pending(self, max_runs: Optional[int] = None, now: Optional[datetime] = None) -> int:
        """Run due work in this process until none is left (or `max_runs`); returns how
        many runs were executed. For tests of handlers: no processes, no signals, and no
        runner slot of this host taken.

        `now` (aware): run what is due at that time, and compute retries' backoff from it,
        so a test takes a task through its retries without sleeping:
        ``run_pending(now=t0)``, then ``run_pending(now=t0 + timedelta(hours=1))``. With
        `now`, dead runners and overdue runs are left alone (their clocks are real)."""
        from .runner.loop import Runner
        clock = None
        if now is not None:
            if now.tzinfo is None:
                raise InputError("run_pending(now=...) takes an aware datetime")
            clock = as_utc(now)
        done = 0
        while max_runs is None or done < max_runs:
            if clock is None:
                maintenance.process_queue(self.store)
            else:
                lifecycle.create_missing_runs(self.store, clock)
            worker = Runner(self.store, install_signals=False, memory_limit=False, clock=clock,
                            facade=lambda store: self)
            ran = int(worker.work(burst=True, max_runs=None if max_runs is None
                                  else max_runs - done))
            done += ran
            # Again only for tasks that waited for a slot of their concurrency key.
            if not ran or not concurrency.has_waiting(self.store):
                break
        return done


class WorkflowAdded:
    """What `add_workflow`, `chain` and `group` return: the workflow's id (also its
    ``int()``) and its tasks' ids, in the order they were given."""

    def __init__(self, workflow_id: int, task_ids: List[int]) -> None:
        self.id, self.task_ids = workflow_id, task_ids

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return "<workflow %d: %d tasks>" % (self.id, len(self.task_ids))


def _spec(task: Union[str, Mapping[str, Any]]) -> Dict[str, Any]:
    """A task spec of a workflow: a dict, or a handler path alone."""
    if isinstance(task, str):
        return {"handler": task}
    if not isinstance(task, Mapping):
        raise InputError("invalid task %r: expected a dict with a 'handler' or a handler path"
                         % (task,))
    return dict(task)


class _EndWatch:
    """The waiters of one queue in one event loop: one wake-up listener, and one read of the
    outcomes of every awaited task per wake-up (wake-ups that arrive during a read make one
    more read, not one each). It listens only while somebody waits."""

    def __init__(self, queue: TaskQueue, loop: asyncio.AbstractEventLoop) -> None:
        self.queue, self.store, self.loop = queue, queue.store, loop
        self.waiting: Dict[int, List["asyncio.Future[TaskOutcome]"]] = {}
        self.woken = asyncio.Event()
        self.watching: Optional["asyncio.Task[None]"] = None

    def register(self, task_id: int) -> "asyncio.Future[TaskOutcome]":
        """A future of the task's outcome, registered before the caller awaits anything."""
        future: "asyncio.Future[TaskOutcome]" = self.loop.create_future()
        self.waiting.setdefault(task_id, []).append(future)
        self.woken.set()            # a new task to read now, not at the next wake-up
        if self.watching is None:
            self.watching = self.loop.create_task(self._watch())
        return future

    def forget(self, task_id: int, future: "asyncio.Future[TaskOutcome]") -> None:
        futures = self.waiting.get(task_id, [])
        if future in futures:
            futures.remove(future)
            if not futures:
                del self.waiting[task_id]

    def _readable(self) -> None:
        assert self.listener is not None
        self.listener.drain()
        self.woken.set()

    async def _watch(self) -> None:
        try:
            self.listener: Optional[wakeup.Listener] = wakeup.Listener(
                self.store.waiters_directory)
        except OSError:     # no writable runtime directory: the poll alone
            self.listener = None
        if self.listener is not None:
            self.loop.add_reader(self.listener.fileno(), self._readable)
        try:
            while self.waiting:
                # Cleared before the read: an end committed after it still wakes the next.
                self.woken.clear()
                ids = list(self.waiting)
                try:
                    outcomes = await self.queue._in_thread(
                        lambda: reads.task_outcomes(self.store, ids))
                except Exception as exc:    # the database's error, for every waiter to see
                    self._settle({task_id: exc for task_id in ids})
                else:
                    self._settle({task_id: outcomes[task_id] if task_id in outcomes
                                        else TaskNotFound("no task with id %s" % task_id)
                                        for task_id in ids
                                        if outcomes.get(task_id, True) is not None})
                if self.waiting:
                    try:
                        await asyncio.wait_for(self.woken.wait(), WAIT_POLL)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.watching = None
            if self.listener is not None:
                self.loop.remove_reader(self.listener.fileno())
                self.listener.close()

    def _settle(self, values: Dict[int, Any]) -> None:
        """Hand each task's outcome (or exception) to its waiters."""
        for task_id, value in values.items():
            for future in self.waiting.pop(task_id, []):
                if future.done():
                    continue
                if isinstance(value, BaseException):
                    future.set_exception(value)
                else:
                    future.set_result(value)


__all__ = ["TaskQueue", "WorkflowAdded"]
