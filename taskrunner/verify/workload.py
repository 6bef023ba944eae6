"""The workload of a verify session, on queues of its own (`QUEUE`, and `RATE_QUEUE` with a
rate): plain tasks, tasks that fail before they succeed (retries), tasks sharing a
concurrency key, rate-limited tasks, durable steps that write an application row in the
step's transaction, a workflow whose branches fan out from a root and fan in, and periodic
tasks of its own (`PERIODIC_QUEUE`: a quick one, and a slow one whose task outlasts its
interval, so its next due times are skipped). Every
handler records what it does in the session's history (`history.record`), before and after
each thing that matters, so the checker can order them. Every task is meant to end
``success``: anything else is a lost task."""
import time

from ..handler import TaskHandler
from ..errors import TaskError
from ..periodic import scheduler
from . import history

QUEUE, RATE_QUEUE = "taskrunner-verify", "taskrunner-verify-rate"
PERIODIC_QUEUE = "taskrunner-verify-periodic"
# The owner of every session's periodic tasks: those of a session killed -9 (which could not
# remove them) go with `taskrunner periodic remove --all --owner taskrunner-verify`.
PERIODIC_OWNER = "taskrunner-verify"
PERIODIC_EVERY = 1            # seconds: the periodic tasks' timer, "every 1s"
# The periodic tasks' work: the slow one outlasts its interval (rule 9 skips a due time
# while the previous task is unfinished).
PERIODIC_WORK = {"quick": 0.05, "slow": 1.5}
# The application's table the steps write to, created by verify itself (no migration of
# the product's schema): one row per step, in the step's transaction.
EFFECTS = "taskrunner_verify_effects"
RATE, BURST = 4.0, 2           # the rate queue's runs started per second, and its burst
CONCURRENCY_LIMIT = 2
WORK = 0.25                    # seconds a handler works (sleeps) per run or step
STEPS = 3
HANDLER = "taskrunner.verify.workload."


def _record(run, kind, **fields):
    """An event of a handler: its run, and the time on the database's clock besides this
    host's."""
    history.record(run.data["history"], kind, task=run.task_id, run=run.id,
                   db_at=run.queue.store.database_time(), **fields)


class Work(TaskHandler):
    """A plain task (also the rate-limited and keyed ones): records its start, works, fails
    while its attempt is at most data["fail"], records its return."""

    def handle(self, run):
        data = run.data
        _record(run, "start", attempt=run.attempt)
        time.sleep(data.get("work", WORK))
        if run.attempt <= data.get("fail", 0):
            raise TaskError("verify: a planned failure of attempt %d" % run.attempt,
                            code="VerifyPlanned")
        parents = data.get("fan_in")
        if parents:
            _record(run, "fanin", parents=len(list(run.parent_results.values())))
        _record(run, "done")
        run.results = {"task": run.task_id}


class Steps(TaskHandler):
    """Durable steps: each writes its application row in the step's own transaction, and
    records its execution before and its commit after."""

    def handle(self, run):
        _record(run, "start", attempt=run.attempt)
        for index in range(run.data["steps"]):
            name = "s%d" % index

            def write(connection, name=name):
                _record(run, "exec", step=name)
                time.sleep(WORK / 3)
                cursor = connection.cursor()
                mark = "?" if type(connection).__module__.startswith("sqlite3") else "%s"
                cursor.execute("INSERT INTO %s (task_id, step) VALUES (%s, %s)"
                               % (EFFECTS, mark, mark), (run.task_id, name))
                cursor.close()
                return name
            run.transaction_step(name, write)
            _record(run, "step", step=name)
        _record(run, "done")


def create_effects_table(store):
    """The steps' application table (verify's own; kept between sessions)."""
    store.db.execute_sql("CREATE TABLE IF NOT EXISTS %s (task_id BIGINT NOT NULL, step "
                         "VARCHAR(64) NOT NULL)" % EFFECTS)


def effects(store, task_ids):
    """{(task, step): rows} of `task_ids` in the application table."""
    counts = {}
    ids = sorted(task_ids)
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        marks = ", ".join(["?" if store.is_sqlite else "%s"] * len(chunk))
        for task, step, n in store.db.execute_sql(
                "SELECT task_id, step, count(*) FROM %s WHERE task_id IN (%s) GROUP BY "
                "task_id, step" % (EFFECTS, marks), chunk).fetchall():
            counts[(int(task), step)] = n
    return counts


class Workload:
    """What a session enqueues, a wave at a time; each task's enqueue recorded with its shape
    (and, for a dependent, its parents)."""

    def __init__(self, queue, directory, session, workers, max_retries=20):
        self.queue, self.directory = queue, directory
        self.key = "taskrunner-verify-%s" % session
        self.workers, self.max_retries = workers, max_retries
        self.waves = 0
        self.task_ids = []

    def limits(self):
        history.record(self.directory, "limit", what="concurrency", key=self.key,
                       limit=CONCURRENCY_LIMIT)
        history.record(self.directory, "limit", what="rate", key=RATE_QUEUE, rate=RATE,
                       burst=BURST)

    def _add(self, shape, handler, data=None, **options):
        data = dict(data or {}, history=self.directory)
        options.setdefault("queue", QUEUE)
        task_id = self.queue.add_task(HANDLER + handler, data, max_retries=self.max_retries,
                                      retry_backoff=0, **options)
        history.record(self.directory, "enqueue", task=task_id, shape=shape,
                       queue=options["queue"], steps=data.get("steps", 0),
                       concurrency_key=options.get("concurrency_key"),
                       key=options.get("concurrency_key"))
        self.task_ids.append(task_id)
        return task_id

    def wave(self):
        """One wave: plain tasks for every worker, a retried one, two keyed, two rate-limited,
        a task of steps; every third wave a workflow (root, branches, fan-in)."""
        for _ in range(self.workers):
            self._add("plain", "Work")
        self._add("retry", "Work", {"fail": 2})
        for _ in range(2):
            self._add("concurrency", "Work", concurrency_key=self.key,
                      concurrency_limit=CONCURRENCY_LIMIT)
        for _ in range(2):
            self._add("rate", "Work", {"work": 0.02}, queue=RATE_QUEUE)
        self._add("steps", "Steps", {"steps": STEPS})
        if self.waves % 3 == 0:
            self.workflow(branches=3)
        self.waves += 1

    def workflow(self, branches):
        data = {"history": self.directory}
        specs = [{"key": "root", "handler": HANDLER + "Work", "data": data}]
        specs += [{"key": "b%d" % i, "handler": HANDLER + "Work", "data": dict(
            data, fail=1 if i == 0 else 0), "after": ["root"]} for i in range(branches)]
        specs.append({"key": "fan-in", "handler": HANDLER + "Work",
                      "data": dict(data, fan_in=True),
                      "after": ["b%d" % i for i in range(branches)]})
        for spec in specs:
            spec.update(queue=QUEUE, max_retries=self.max_retries, retry_backoff=0)
        ids = self.queue.add_workflow(specs, name="taskrunner-verify").task_ids
        keys = {spec["key"]: task_id for spec, task_id in zip(specs, ids)}
        for spec, task_id in zip(specs, ids):
            history.record(self.directory, "enqueue", task=task_id,
                           shape="fan-in" if spec["key"] == "fan-in" else "workflow",
                           queue=QUEUE, parents=[keys[k] for k in spec.get("after", ())],
                           reads=spec["key"] == "fan-in")
        self.task_ids.extend(ids)


class Periodic:
    """The session's periodic tasks (``taskrunner-verify-SESSION-quick`` and ``-slow``, on
    PERIODIC_QUEUE, no timebox: their work, not a max_runtime, decides when they end), each
    recorded with its first due time and interval, so the checker knows which instances
    were due; removed at the end (`remove`)."""

    def __init__(self, store, directory, session):
        self.store, self.directory = store, directory
        self.names = {kind: "taskrunner-verify-%s-%s" % (session, kind)
                      for kind in PERIODIC_WORK}
        self.ids = []

    def add(self):
        for kind, name in self.names.items():
            row = scheduler.add_periodic(
                self.store, name, HANDLER + "Work", "every %ds" % PERIODIC_EVERY,
                {"history": self.directory, "work": PERIODIC_WORK[kind]},
                source="verify", owner=PERIODIC_OWNER, queue=PERIODIC_QUEUE, timebox="off",
                max_retries=20)
            self.ids.append(row.id)
            # Read back: the due time as the database stores it (its precision), which the
            # tasks' scheduled_on will be compared with.
            first = self.store.PeriodicTask.get_by_id(row.id).nextrun
            history.record(self.directory, "periodic", name=name, every=PERIODIC_EVERY,
                           first=str(first))

    def task_ids(self):
        Task = self.store.Task
        return [t.id for t in Task.select(Task.id).where(Task.periodic_task_id.in_(self.ids))] \
            if self.ids else []

    def collect(self):
        """Each task the periodic tasks submitted: its due time (scheduled_on), when it was
        created and when it finished, on the database's clock."""
        Task, names = self.store.Task, dict(zip(self.ids, self.names.values()))
        for task in Task.select(Task.id, Task.periodic_task_id, Task.scheduled_on,
                                Task.queued_on, Task.finished_on).where(
                Task.periodic_task_id.in_(self.ids)) if self.ids else ():
            history.record(self.directory, "instance", periodic=names[task.periodic_task_id],
                           task=task.id, scheduled=str(task.scheduled_on),
                           created=str(task.queued_on),
                           finished=task.finished_on and str(task.finished_on))

    def remove(self):
        PeriodicTask = self.store.PeriodicTask
        if self.ids:
            PeriodicTask.delete().where(PeriodicTask.id.in_(self.ids)).execute()
        self.ids = []
