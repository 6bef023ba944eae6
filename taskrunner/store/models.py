"""One model per table. The schema itself is created by the numbered migrations in
`taskrunner/store/migrations/`; these models are how the code reads and writes it.

The classes here are unbound templates: each `Store` binds its own subclasses to its own
database (`bind_models`), so two queues in one process never share a binding.

Times are stored as naive UTC datetimes. Rule 1 (one non-final run per task) lives in the schema:
``task_runs.active_task_id`` holds the task id while a run is scheduled or running and NULL
once it is final, under a unique index — the database refuses a second live run.
"""
from datetime import datetime, timezone
from typing import NamedTuple, Type

import peewee as pw

# The largest id a table's id column holds, on every database (BIGINT): a larger one names
# no row, and the drivers refuse to bind it (OverflowError), so it is refused before that.
LARGEST_ID = 2 ** 63 - 1

# Run and task states.
SCHEDULED = "scheduled"
RUNNING = "running"
SUCCESS = "success"
ERROR = "error"
TIMEOUT = "timeout"
CANCELLED = "cancelled"
# The run ended without an outcome of its own and the task runs again, not counted as a
# failure: its runner was told to stop (error_code Stopped) or the handler snoozed.
REQUEUED = "requeued"
# The handler ended the run to sleep or to wait for an event (run.sleep, run.wait_for): final
# for the run, not a failure; the task is `waiting` until its time or its event comes.
WAITING = "waiting"
RUN_FINAL = (SUCCESS, ERROR, TIMEOUT, CANCELLED, REQUEUED, WAITING)
# error_code of a run whose runner process died under it: a crash, counted apart.
CRASHED = "RunnerDied"
FAILED = (ERROR, TIMEOUT)
# A running runner's exit_reason while it winds down its run: "stopping: why".
STOPPING_PREFIX = "stopping: "
# How much of a failed run's traceback is kept: its end, where the error is.
TRACEBACK_LIMIT = 65536

# The queue of a task that names none.
DEFAULT_QUEUE = "default"

# Runner kinds: the rows of task_runners are the host's processes (an overseer's
# maintainer does its database maintenance, overseer/maintainer.py).
OVERSEER = "overseer"
RUNNER = "runner"
MAINTAINER = "maintainer"


def state_word(status, finished_on, running=False):
    """How a task with this last_status and finished_on is shown on every face (the API,
    the CLI, the dashboard, the metrics): a failed task is ``retrying`` or ``given-up``, as
    the filters name them; one with a run `running` is ``running`` (a claim writes the run
    alone: the task's row says ``scheduled`` until the run ends)."""
    if running:
        return RUNNING
    if status in FAILED:
        return "given-up" if finished_on else "retrying"
    return status


def utcnow():
    return datetime.now(timezone.utc).replace(tzinfo=None)


def as_utc(value):
    """A naive UTC datetime from an aware one (a naive one is taken as UTC already)."""
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


class BaseModel(pw.Model):
    class Meta:
        legacy_table_names = False


class Task(BaseModel):
    queued_on = pw.DateTimeField()
    queued_by = pw.CharField(null=True)
    scheduled_on = pw.DateTimeField()
    handler = pw.CharField()
    data = pw.TextField()
    priority = pw.IntegerField(default=0)
    last_status = pw.CharField(max_length=16, default=SCHEDULED)
    max_retries = pw.IntegerField()
    runs_failed = pw.IntegerField(default=0)
    run_count = pw.IntegerField(default=0)
    run_timeout = pw.DoubleField()
    max_runtime = pw.DoubleField(null=True)
    retry_backoff = pw.DoubleField(null=True)
    unique_key = pw.CharField(null=True)
    # unique_key while the task is not final, NULL after: the unique index makes
    # "one live task per key" a database rule.
    active_key = pw.CharField(null=True, unique=True)
    periodic_task_id = pw.IntegerField(null=True, index=True)
    # When the next run may be created; NULL while a run is live or the task is final.
    next_run_on = pw.DateTimeField(null=True, index=True)
    updated_on = pw.DateTimeField()
    finished_on = pw.DateTimeField(null=True, index=True)
    last_error_code = pw.CharField(null=True)
    last_error_message = pw.TextField(null=True)
    crash_count = pw.IntegerField(default=0)
    # Runs ended by a dead runner in a row (TimescaleDB's consecutive crashes; 0018): the
    # crash backoff; any other end of a run resets it.
    runs_crashed = pw.IntegerField(default=0)
    # Carried from the periodic task that submitted it (Docspell's job subject and group_).
    subject = pw.CharField(null=True)
    group_name = pw.CharField(null=True)
    queue = pw.CharField(max_length=64, default=DEFAULT_QUEUE)
    # At most concurrency_limit live runs of the tasks with this key (migration 0010);
    # waiting_key is the key while the task waits for a free slot of it.
    concurrency_key = pw.CharField(null=True)
    concurrency_limit = pw.IntegerField(null=True)
    waiting_key = pw.CharField(null=True)
    # Durable execution (0019): the last run.checkpoint() value (JSON) and when it was
    # stored; the event a `waiting` task waits for (its next_run_on: until when).
    checkpoint = pw.TextField(null=True)
    checkpoint_on = pw.DateTimeField(null=True)
    waiting_for = pw.CharField(null=True)
    # Flow control (0021, runs/flow.py): the key whose rate limit its runs spend, and the
    # tenant a fair queue round-robins between.
    rate_key = pw.CharField(null=True)
    tenant = pw.CharField(null=True)
    # The graph (migration 0020, runs/graph.py): the workflow of the tasks added together;
    # how many edges lead from this task to its dependents (0: its success releases nothing);
    # the edges to its parents not satisfied yet while it waits for them (NULL once released,
    # or for a task that never waited); what a failed parent does to it (NULL: cancel).
    workflow_id = pw.IntegerField(null=True, index=True)
    dependents = pw.IntegerField(default=0)
    waiting_parents = pw.IntegerField(null=True)
    on_parent_failure = pw.CharField(max_length=8, null=True)
    # OpenTelemetry (0030, tracing.py): the context of the span that added the task, as the
    # propagator's carrier in JSON; NULL unless the adding process traced.
    trace_context = pw.TextField(null=True)
    # Debounce (0026, runs/debounce.py): the key it was added with; the same while its window
    # may be open (unique with the handler: one open window per key), cleared by the enqueue
    # that finds it closed; the latest due time the window may be pushed to; the enqueues
    # that landed in it. NULL for a task added without a debounce.
    debounce_key = pw.CharField(null=True)
    debounce_open = pw.CharField(null=True)
    debounce_until = pw.DateTimeField(null=True)
    debounce_count = pw.IntegerField(null=True)
    # Code versions (0032, runs/durable.py): the version of the code a durable task started
    # under, written with its first durable record; NULL for a task that recorded nothing.
    code_version = pw.CharField(max_length=64, null=True)

    class Meta:
        table_name = "task_queue"
        indexes = ((("debounce_open", "handler"), True),)

    @property
    def given_up(self):
        """Failed and final: after max_retries failures in a row, or a failure not to retry
        (TaskError ``retry=False``) — as the status word ``given-up`` (reads.state_word)."""
        return self.last_status in FAILED and self.finished_on is not None


class Run(BaseModel):
    task_id = pw.IntegerField(index=True)
    created_on = pw.DateTimeField()
    started_on = pw.DateTimeField(null=True)
    updated_on = pw.DateTimeField()
    finished_on = pw.DateTimeField(null=True)
    percent_completed = pw.IntegerField(default=0)
    results = pw.TextField(null=True)
    status = pw.CharField(max_length=16, default=SCHEDULED)
    error_code = pw.CharField(null=True)
    error_message = pw.TextField(null=True)
    # The traceback of a failed run (its last TRACEBACK_LIMIT bytes).
    traceback = pw.TextField(null=True)
    # Set by an operator's cancel of the running run: its runner stops it cooperatively.
    cancel_requested_on = pw.DateTimeField(null=True)
    runner_id = pw.IntegerField(null=True)
    attempt = pw.IntegerField(default=1)
    active_task_id = pw.IntegerField(null=True, unique=True)
    # Copied from the task so the claim is one index range scan on this table.
    priority = pw.IntegerField(default=0)
    scheduled_on = pw.DateTimeField()
    queue = pw.CharField(max_length=64, default=DEFAULT_QUEUE)
    # The task's concurrency key, and the slot of it this run holds while it is live.
    concurrency_key = pw.CharField(null=True)
    concurrency_slot = pw.IntegerField(null=True)
    # The task's rate key and tenant, copied for the claim (runs/flow.py).
    rate_key = pw.CharField(null=True)
    tenant = pw.CharField(null=True)

    class Meta:
        table_name = "task_runs"


RUN_STATUSES = (SCHEDULED, RUNNING) + RUN_FINAL


def run_status_is(run_model, status):
    """``task_runs.status = '<status>'`` with the value written into the SQL, not bound:
    SQLite and PostgreSQL use the partial indexes on task_runs (claim: scheduled runs;
    runner: running runs) only for a query that names their predicate."""
    if status not in RUN_STATUSES:
        raise ValueError("not a run status: %r" % (status,))
    return run_model.status == pw.SQL("'%s'" % status)


class Runner(BaseModel):
    host = pw.CharField()
    boot_id = pw.CharField(max_length=64)
    pid = pw.IntegerField()
    pid_create_time = pw.DoubleField()
    kind = pw.CharField(max_length=16, default=RUNNER)
    parent_id = pw.IntegerField(null=True)
    started_on = pw.DateTimeField()
    heartbeat_on = pw.DateTimeField()
    finished_on = pw.DateTimeField(null=True)
    status = pw.CharField(max_length=16, default=RUNNING)
    # 1..limit while a runner runs, NULL after; unique per host, so the limit (rule 5)
    # holds however many processes register at once.
    slot = pw.IntegerField(null=True)
    rss = pw.BigIntegerField(null=True)
    runs_done = pw.IntegerField(default=0)
    # "stopping: why" while it winds down its run stopping_run_id (TimescaleDB's
    # TERMINATING), since stopping_since (0018); why it exited once it has.
    exit_reason = pw.TextField(null=True)
    stopping_since = pw.DateTimeField(null=True)
    stopping_run_id = pw.IntegerField(null=True)
    # The version of the handler code this runner runs (0032, runner/versions.py); NULL for
    # an overseer and its maintainer, which run no handler.
    code_version = pw.CharField(max_length=64, null=True)

    class Meta:
        table_name = "task_runners"


class PeriodicTask(BaseModel):
    """A timer that submits tasks (the Docspell ADR's periodic_task, with Nuntium's owner,
    spacing and timebox). ``worker``/``marked`` say which scheduler is submitting it now."""
    name = pw.CharField(unique=True)
    enabled = pw.BooleanField(default=True)
    handler = pw.CharField()
    data = pw.TextField()
    priority = pw.IntegerField(default=0)
    submitter = pw.CharField(null=True)
    worker = pw.CharField(null=True)
    marked = pw.DateTimeField(null=True)
    timer = pw.CharField()
    # The zone a calendar timer that names none is evaluated in, fixed when it was defined
    # (see periodic.timer_zone); NULL for intervals and timers with a zone of their own.
    timezone = pw.CharField(max_length=64, null=True)
    # NULL when the timer will never elapse again.
    nextrun = pw.DateTimeField(null=True, index=True)
    created = pw.DateTimeField()
    owner = pw.CharField(null=True, index=True)
    catch_up = pw.CharField(max_length=8, default="once")
    max_runtime = pw.DoubleField(null=True)
    min_spacing = pw.DoubleField(null=True)
    max_retries = pw.IntegerField(null=True)
    # Where the definition came from: "config" rows are synced from the config file.
    source = pw.CharField(max_length=16, default="api")
    last_due = pw.DateTimeField(null=True)
    last_run = pw.DateTimeField(null=True)
    last_task_id = pw.IntegerField(null=True)
    last_status = pw.CharField(max_length=16, null=True)
    consecutive_failures = pw.IntegerField(default=0)
    submitted_count = pw.IntegerField(default=0)
    skipped_count = pw.IntegerField(default=0)
    crash_count = pw.IntegerField(default=0)
    consecutive_crashes = pw.IntegerField(default=0)
    # Lifetime counts of its tasks' runs (task_runs loses rows to rotation): runs that ended
    # success, error or timeout; successes; errors and timeouts that were not crashes.
    run_count = pw.IntegerField(default=0)
    success_count = pw.IntegerField(default=0)
    error_count = pw.IntegerField(default=0)
    updated_on = pw.DateTimeField()
    # Docspell's subject (a human title) and group_ (the tenant it belongs to).
    subject = pw.CharField(null=True)
    group_name = pw.CharField(null=True, index=True)
    # Nuntium's settings for interval timers; max_runtime and min_spacing hold what they mean.
    timebox = pw.CharField(max_length=8, null=True)
    tolerance = pw.DoubleField(null=True)
    dropped_count = pw.IntegerField(default=0)
    queue = pw.CharField(max_length=64, default=DEFAULT_QUEUE)
    # What an `every` timer's next due time counts from: "due" (a fixed grid) or "now" (the
    # scheduler's pass, Nuntium's nextRun = currentTime + interval).
    anchor = pw.CharField(max_length=8, default="due")
    # Its next task starts from the checkpoint of the previous one when that one ended
    # without success (Nuntium: the next instantiation proceeds from that point).
    resume = pw.BooleanField(default=False)
    # Temporal's jitter: each instance is due at its calendar time plus a stable offset in
    # [0, jitter) seconds; `nominal` is then the calendar time of `nextrun` (NULL: none, and
    # nextrun is its calendar time).
    jitter = pw.DoubleField(null=True)
    nominal = pw.DateTimeField(null=True)

    class Meta:
        table_name = "periodic_tasks"


class Queue(BaseModel):
    """A queue name that has been used; ``paused`` queues are not claimed from, on any host.
    ``host_limit``: the runners serving it at once on one host, set at run time (``queue
    limit``); NULL: the config's ``[queues.NAME] limit`` (0025)."""
    name = pw.CharField(max_length=64, primary_key=True)
    paused = pw.BooleanField(default=False)
    paused_on = pw.DateTimeField(null=True)
    updated_on = pw.DateTimeField()
    host_limit = pw.IntegerField(null=True)

    class Meta:
        table_name = "task_queues"


class RunnerQueue(BaseModel):
    """A queue a running runner serves. ``slot`` is 1..limit for a queue with a limit and
    unique per (host, queue): a queue's limit on a host is a database rule, like rule 5.
    ``config_limit``: the ``[queues.NAME] limit`` of the runner's config, which the claim
    holds the slot to while the queue has no ``host_limit`` of its own."""
    runner_id = pw.IntegerField(index=True)
    host = pw.CharField()
    queue = pw.CharField(max_length=64)
    slot = pw.IntegerField(null=True)
    config_limit = pw.IntegerField(null=True)

    class Meta:
        table_name = "task_runner_queues"


class Lease(BaseModel):
    """One lease (leadership.py): held by a runner row until expires_on, on the database's
    clock; no holder (NULL) once released."""
    name = pw.CharField(max_length=64, primary_key=True)
    # Declared before holder_id: peewee writes an UPDATE's assignments in field order, and
    # MySQL evaluates them left to right, each seeing the ones before; the renewal's
    # "keep taken_on if the holder is unchanged" must compare the old holder.
    taken_on = pw.DateTimeField(null=True)
    holder_id = pw.IntegerField(null=True)
    holder_kind = pw.CharField(max_length=16, null=True)
    host = pw.CharField(null=True)
    expires_on = pw.DateTimeField()

    class Meta:
        table_name = "task_leases"


class Step(BaseModel):
    """A step of a task that has run (run.step, and the sleeps and events of run.sleep and
    run.wait_for): its JSON result, stored once per (task, name) — the unique index is rule
    10's, the same in the transaction that records the step and any write of the step's."""
    task_id = pw.IntegerField()
    name = pw.CharField()
    kind = pw.CharField(max_length=16)
    run_id = pw.IntegerField(null=True)
    attempt = pw.IntegerField(null=True)
    result = pw.TextField(null=True)
    started_on = pw.DateTimeField(null=True)
    finished_on = pw.DateTimeField()

    class Meta:
        table_name = "task_steps"
        indexes = ((("task_id", "name"), True),)


class Event(BaseModel):
    """An event sent to a task (TaskQueue.send_event), kept until a run.wait_for of its name
    consumes it (consumed_on, by the run consumed_by)."""
    task_id = pw.IntegerField()
    name = pw.CharField()
    payload = pw.TextField(null=True)
    sent_on = pw.DateTimeField()
    consumed_on = pw.DateTimeField(null=True)
    consumed_by = pw.IntegerField(null=True)

    class Meta:
        table_name = "task_events"
        indexes = ((("task_id", "name"), False),)


class RateBucket(BaseModel):
    """A token bucket (runs/flow.py) of a queue (kind ``queue``) or a rate key (``key``):
    ``rate`` tokens a second up to ``burst``; ``tokens`` held at ``stamp`` (epoch seconds on
    the database's clock). The claim refills and spends it."""
    kind = pw.CharField(max_length=8)
    name = pw.CharField(max_length=255)
    rate = pw.DoubleField()
    burst = pw.DoubleField()
    tokens = pw.DoubleField()
    stamp = pw.DoubleField()
    updated_on = pw.DateTimeField()

    class Meta:
        table_name = "task_rate_buckets"
        primary_key = pw.CompositeKey("kind", "name")


class RateLimit(BaseModel):
    """A rate limit of a key or key prefix (``tenant:*``) set at run time; ``text`` as given
    (``25/s``)."""
    pattern = pw.CharField(max_length=255, primary_key=True)
    rate = pw.DoubleField()
    burst = pw.DoubleField()
    text = pw.CharField(max_length=64)
    updated_on = pw.DateTimeField()

    class Meta:
        table_name = "task_rate_limits"


class Tenant(BaseModel):
    """A tenant of a queue; ``served``: the sequence number of the claim that served it last
    (a fair claim serves the lowest)."""
    queue = pw.CharField(max_length=64)
    tenant = pw.CharField(max_length=255)
    served = pw.BigIntegerField(default=0)

    class Meta:
        table_name = "task_tenants"
        primary_key = pw.CompositeKey("queue", "tenant")


class Dependency(BaseModel):
    """An edge of the graph: the task `task_id` runs after `parent_id` succeeded;
    `satisfied` once that edge no longer holds it back (counted once, whatever happens to the
    parent later)."""
    task_id = pw.IntegerField()
    parent_id = pw.IntegerField()
    satisfied = pw.BooleanField(default=False)

    class Meta:
        table_name = "task_dependencies"
        indexes = ((("parent_id", "task_id"), True), (("task_id", "parent_id"), False))


class Workflow(BaseModel):
    """Tasks added together (`TaskQueue.add_workflow`, `chain`, `group`)."""
    name = pw.CharField(null=True)
    created_on = pw.DateTimeField()
    task_count = pw.IntegerField(default=0)

    class Meta:
        table_name = "task_workflows"


class Rerun(BaseModel):
    """An operator's re-run of an ended durable task from one of its steps (runs/control.py
    `rerun_from`): who asked, why, from which step, how many steps it dropped, and the run
    it created."""
    task_id = pw.IntegerField(index=True)
    from_step = pw.CharField()
    steps_dropped = pw.IntegerField()
    requested_by = pw.CharField(null=True)
    reason = pw.TextField(null=True)
    requested_on = pw.DateTimeField()
    run_id = pw.IntegerField(null=True)

    class Meta:
        table_name = "task_reruns"


MODELS = (Task, Run, Runner, PeriodicTask, Queue, RunnerQueue, Lease, Step, Event,
          RateBucket, RateLimit, Tenant, Dependency, Workflow, Rerun)


class BoundModels(NamedTuple):
    """The models of one database: subclasses of the templates above, bound to it."""
    Task: Type[Task]
    Run: Type[Run]
    Runner: Type[Runner]
    PeriodicTask: Type[PeriodicTask]
    Queue: Type[Queue]
    RunnerQueue: Type[RunnerQueue]
    Lease: Type[Lease]
    Step: Type[Step]
    Event: Type[Event]
    RateBucket: Type[RateBucket]
    RateLimit: Type[RateLimit]
    Tenant: Type[Tenant]
    Dependency: Type[Dependency]
    Workflow: Type[Workflow]
    Rerun: Type[Rerun]


def bind_models(database):
    """Subclasses of every model bound to `database` alone. peewee's own ``bind()`` changes
    the class for the whole process; a subclass per database keeps two stores apart (table
    names are not inherited, so each is restated)."""
    bound = {}
    for model in MODELS:
        meta = type("Meta", (), {"database": database, "table_name": model._meta.table_name})
        bound[model.__name__] = type(model.__name__, (model,), {
            "Meta": meta, "__module__": __name__})
    return BoundModels(**bound)
