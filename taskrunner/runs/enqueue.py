"""Adding tasks: the checks every new task passes, and how it is stored (with its first run
when it is due, so a runner can start it at once) with the catalogue's INSERTs (sql.py): one
row at a time, many rows at once, or PostgreSQL's task, run and NOTIFY in one statement;
through the store's connection or the application's own (`add_in_transaction`).

Times given here are aware datetimes (a naive one is refused: "naive means UTC" in Python
and "naive means local time" on the command line would otherwise disagree); ``now`` is the
store's naive UTC, on the database's clock (`Store.database_time`): whether a task is due
at once, and its place in the claim order, do not depend on the clock of the host adding it.
A `delay` (``taskrunner add --in``) counts from that ``now`` too, so a client whose clock is
off still gets its task that many seconds later by the database's clock.
"""
from datetime import datetime, timedelta, timezone

import peewee as pw

from . import debounce as debouncing, flow, graph, sql
from .. import tracing
from ..config import MAX_RETRIES_ZERO, check_queue_name, one_count_of_runs
from ..errors import InputError, StateError, check_text
from ..handler import check_handler_path, encode_data, load_handler
from ..store.models import DEFAULT_QUEUE, LARGEST_ID, SCHEDULED, utcnow
from ..host.wakeup import NOTIFY_SQL, notify_params
from ..timespan import parse_timespan

MAX_INT = 2 ** 31 - 1   # INTEGER columns on every database
BULK_ROWS = 500         # rows per INSERT: within every database's limit on bound parameters
DEBOUNCE_ATTEMPTS = 50  # tries of a debounced enqueue whose insert the unique index refused
TASK_OPTIONS = ("data", "scheduled_on", "delay", "max_retries", "max_attempts", "priority",
                "run_timeout", "unique_key", "queued_by", "max_runtime", "retry_backoff",
                "periodic_task_id", "queue", "concurrency_key", "concurrency_limit",
                "rate_key", "tenant", "after", "on_parent_failure", "debounce", "debounce_key",
                "debounce_max", "debounce_keep")


def utc_instant(value, name="scheduled_on"):
    """An aware datetime as the store's naive UTC; InputError for anything else."""
    if not isinstance(value, datetime):
        raise InputError("%s must be a datetime, not %r" % (name, value))
    if value.tzinfo is None or value.utcoffset() is None:
        raise InputError("%s must be timezone-aware (e.g. datetime.now(timezone.utc)); a "
                         "naive datetime is ambiguous" % name)
    return value.astimezone(timezone.utc).replace(tzinfo=None)


def _check_int(name, value, low, high):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError("%s must be an integer, not %r" % (name, value))
    if not low <= value <= high:
        raise InputError("%s must be between %d and %d" % (name, low, high))


def _span(name, value, zero=False):
    """A duration option as seconds: a number, or a span as the config writes it ('5min');
    positive, or also 0 with `zero` (as the config's check of the same key)."""
    if value is None:
        return None
    try:
        seconds = parse_timespan(value)
    except ValueError:
        seconds = -1.0
    if seconds < 0 or (seconds == 0 and not zero):
        raise InputError("%s must be a %s number of seconds or a time span like '5min' (at "
                         "most 100 years), not %r"
                         % (name, "non-negative" if zero else "positive", value))
    return seconds


def task_row(config, handler, data=None, scheduled_on=None, max_retries=None, priority=0,
             run_timeout=None, unique_key=None, queued_by=None, max_runtime=None,
             retry_backoff=None, periodic_task_id=None, now=None, known_handlers=None,
             import_handler=True, subject=None, group=None, queue=None, concurrency_key=None,
             concurrency_limit=None, rate_key=None, tenant=None, on_parent_failure=None,
             delay=None, debounce=None, debounce_key=None, debounce_max=None,
             debounce_keep=None, max_attempts=None):
    """Validate one task and return the row to insert; InputError on bad input. `delay`
    (seconds or a span, instead of `scheduled_on`): due that long after `now`.
    `known_handlers`, a dict, skips loading a handler already loaded in this batch; without
    `import_handler` the path is checked but not imported (the overseer's scheduler).
    `subject` and `group` come from a periodic task's definition, checked there. `queue`:
    None for the handler class's ``queue``, else ``default``. A task with a
    `concurrency_key` gets its runs from `lifecycle.create_missing_runs` (which takes a
    slot of the key), never at insert. `rate_key`: the key whose rate limit its runs spend;
    `tenant`: the value a fair queue round-robins between (runs/flow.py). `debounce` (seconds
    or a span) with `debounce_key`, `debounce_max`, `debounce_keep`: the row of a new debounce
    window (runs/debounce.py), stored by `_add_debounced`. `max_attempts`: `max_retries` by
    its clear name (runs in all; config.one_count_of_runs)."""
    defaults = config.task
    cls = None
    if not import_handler:
        check_handler_path(handler, config.handlers.allow)
    elif known_handlers is not None and handler in known_handlers:
        cls = known_handlers[handler]
    else:
        cls = load_handler(handler, config.handlers.allow)
        if known_handlers is not None:
            known_handlers[handler] = cls
    if queue is None:
        queue = getattr(cls, "queue", None) or DEFAULT_QUEUE
        check_queue_name(queue, "%s.queue" % handler)
    else:
        check_queue_name(queue)
    text = encode_data(data, defaults.max_data_size)
    if cls is not None:
        cls.check_data(data)
    now = now or utcnow()
    window = None
    if debounce is not None:
        if scheduled_on is not None or delay is not None or unique_key is not None:
            raise InputError("debounce sets when the task runs: it cannot be combined with "
                             "scheduled_on, delay or unique_key")
        window = debouncing.window(handler, now, _span("debounce", debounce), debounce_key,
                                   _span("debounce_max", debounce_max), debounce_keep or "last")
        scheduled_on = window["scheduled_on"]
    elif debounce_key is not None or debounce_max is not None or debounce_keep is not None:
        debouncing.check_unused(debounce_key, debounce_max, debounce_keep)
    if delay is not None:
        if scheduled_on is not None:
            raise InputError("give scheduled_on or delay, not both")
        try:
            scheduled_on = now + timedelta(seconds=_span("delay", delay, zero=True))
        except OverflowError:
            raise InputError("delay %r is too far in the future" % (delay,)) from None
    elif window is None:
        scheduled_on = now if scheduled_on is None else utc_instant(scheduled_on)
    if max_retries == 0 and not isinstance(max_retries, bool):
        raise InputError(MAX_RETRIES_ZERO)
    max_retries = one_count_of_runs(max_retries, max_attempts)
    _check_int("max_retries" if max_attempts is None else "max_attempts", max_retries, 1,
               MAX_INT)
    _check_int("priority", priority, -MAX_INT, MAX_INT)
    run_timeout = _span("run_timeout", run_timeout)
    max_runtime = _span("max_runtime", max_runtime)
    # 0: retry at once, as [task] retry_backoff = 0 allows.
    retry_backoff = _span("retry_backoff", retry_backoff, zero=True)
    check_text("unique_key", unique_key, empty=False)
    check_text("queued_by", queued_by)
    check_text("concurrency_key", concurrency_key, empty=False)
    _check_int("concurrency_limit", concurrency_limit, 1, MAX_INT)
    if concurrency_limit is not None and concurrency_key is None:
        raise InputError("concurrency_limit needs a concurrency_key")
    flow.check_task_options(rate_key, tenant)
    graph.check_policy(on_parent_failure)
    due = scheduled_on <= now and concurrency_key is None
    row = {
        "queued_on": now, "queued_by": queued_by, "scheduled_on": scheduled_on,
        "handler": handler, "data": text, "priority": priority or 0,
        "last_status": SCHEDULED,
        "max_retries": max_retries if max_retries is not None else defaults.max_retries,
        "runs_failed": 0, "run_count": 1 if due else 0,
        "run_timeout": float(run_timeout or defaults.run_timeout),
        "max_runtime": max_runtime, "retry_backoff": retry_backoff,
        "unique_key": unique_key, "active_key": unique_key,
        "periodic_task_id": periodic_task_id, "subject": subject, "group_name": group,
        "queue": queue, "concurrency_key": concurrency_key,
        "concurrency_limit": (concurrency_limit or 1) if concurrency_key is not None else None,
        "next_run_on": None if due else scheduled_on,
        "updated_on": now, "rate_key": rate_key, "tenant": tenant,
        # "cancel" is the default, stored as NULL.
        "on_parent_failure": "run" if on_parent_failure == "run" else None,
    }
    if tracing.active():
        row["trace_context"] = tracing.enqueued(handler, queue)
    if window is not None:
        row.update(window)
    return row


def is_due(row):
    """Whether the row gets its first run as it is added (not delayed, waiting for a slot
    of its concurrency key, or waiting for its parents)."""
    return row["next_run_on"] is None and row["run_count"] == 1


def first_run(task_id, row):
    return {"task_id": task_id, "created_on": row["queued_on"], "updated_on": row["queued_on"],
            "attempt": 1, "active_task_id": task_id, "priority": row["priority"],
            "scheduled_on": row["scheduled_on"], "status": SCHEDULED, "percent_completed": 0,
            "queue": row["queue"], "rate_key": row["rate_key"], "tenant": row["tenant"]}


def record_queues(store, names, execute=None):
    """Inside the caller's transaction: a task_queues row for each queue name not seen
    before (how runners serving ``default`` find the queues nobody configured, and where
    pausing is stored). Names this store wrote already are skipped; the cache is filled
    after the commit (`remember_queues`), since a rollback takes the row away again.
    `execute`: the caller's connection (`add_in_transaction`) instead of the store's."""
    Queue = store.Queue
    new = sorted(set(names) - store.known_queues)
    if new:
        execute = execute or store.db.execute_sql
        now, fields = utcnow(), (Queue.name, Queue.paused, Queue.updated_on)
        for name in new:
            execute(sql.INSERT_QUEUE[store.backend], sql.bind(store.backend, fields,
                                                              (name, False, now)))
    return new


def remember_queues(store, names):
    """After the commit of `record_queues`' transaction (not inside an outer one, which may
    still roll back): these names need no insert again."""
    if not store.db.in_transaction():
        store.known_queues.update(names)


def insert_tasks(store, rows, execute=None):
    """Store validated rows (and the first run of each due one), inside the caller's
    transaction, one row at a time; returns the task ids. `execute`: the caller's connection
    instead of the store's (errors then are its driver's, not peewee's)."""
    record_queues(store, [row["queue"] for row in rows], execute)
    flow.record_rows(store, rows, execute)
    return [_insert_task(store, row, execute or store.db.execute_sql) for row in rows]


def _insert_task(store, row, execute):
    task_id = _insert(store.backend, execute, store.Task, row)
    if is_due(row):
        _insert(store.backend, execute, store.Run, first_run(task_id, row))
    return task_id


def _insert(backend, execute, model, row):
    """INSERT one row (a dict of field names); returns its id."""
    statement, fields = sql.insert_row(backend, model, tuple(row))
    cursor = execute(statement, sql.bind(backend, fields, row.values()))
    return cursor.fetchone()[0] if backend == "postgresql" else cursor.lastrowid


def _add_in_one_statement(store, row):
    """PostgreSQL: the task, its first run when due, and the NOTIFY to other hosts, in one
    statement (sql.insert_task_and_run); returns the task id. A task not due yet wakes
    nobody."""
    statement, params = _one_statement(store, row)
    return store.db.execute_sql(statement, params).fetchone()[0]


def _one_statement(store, row):
    """(statement, parameters) of `_add_in_one_statement`."""
    due = is_due(row)
    notify = due and store.notifies
    # The run's columns but the two the statement fills with the task's id.
    run = {name: value for name, value in first_run(None, row).items()
           if name not in ("task_id", "active_task_id")} if due else {}
    statement, task_fields, run_fields = sql.insert_task_and_run(
        store.Task, store.Run, tuple(row), tuple(run), notify)
    params = sql.bind("postgresql", task_fields, row.values()) + \
        sql.bind("postgresql", run_fields, run.values())
    if notify:
        params += notify_params(1, row["queue"], store.origin)
    return statement, params


def _add_unique(store, row):
    """Insert a task with a unique_key, or find the live task holding the key: (its id,
    whether it was inserted).
    Race closed: two adds of one key — the unique index on active_key lets one insert win;
    the other reads the winner's id (and tries again if that task ended meanwhile)."""
    Task = store.Task
    for _ in range(5):
        try:
            task_id = store.write_and_wake(lambda: insert_tasks(store, [row])[0],
                                           lambda _: int(is_due(row)), row["queue"])
            remember_queues(store, [row["queue"]])
            remember_flow(store, [row])
            return task_id, True
        except pw.IntegrityError:
            existing = Task.select(Task.id).where(Task.active_key == row["unique_key"]).first()
            if existing is not None:
                return existing.id, False
    raise StateError("unique_key %r is contended; try again" % row["unique_key"])


def _add_debounced(store, row):
    """Land `row`, a new debounce window's task, in the open window of its key (its id,
    False), or insert it as the next window's task (its id, True). Races closed: see
    debounce.land; an insert the unique index refuses starts over, and lands in the window
    that won."""
    row = dict(row)
    keep = row.pop(debouncing.KEEP_OPTION)
    # Each refused insert is another enqueue's new window committed meanwhile; under a stream
    # of windows shorter than the enqueues' lock waits, one enqueue may lose a few in a row
    # (PostgreSQL drops a holder row that changed while it waited for its lock, and the
    # statement cannot see the row inserted since).

    def step():
        task_id = debouncing.land(store, row, keep)
        if task_id is not None:
            return task_id, False
        return insert_tasks(store, [row])[0], True
    for _ in range(DEBOUNCE_ATTEMPTS):
        try:
            task_id, created = store.write(step)
        except pw.IntegrityError:
            continue
        if created:
            remember_queues(store, [row["queue"]])
            remember_flow(store, [row])
        return task_id, created
    raise StateError("debounce_key %r is contended; try again" % row["debounce_key"])


def add_task(store, handler, now=None, connection=None, **options):
    """Queue one task and return its id. With `unique_key`, adding a key that a not-yet-final
    task holds stores nothing and returns that task's id. With `connection`, the caller's
    open DB-API connection writes it inside the caller's transaction (`add_in_transaction`)."""
    after = options.pop("after", None)
    if after is not None:
        if connection is not None:
            raise InputError("after= cannot be combined with connection=")
        return add_graph(store, [dict(options, handler=handler, after=after)], now=now)[1][0]
    raw = None if connection is None else application_connection(store, connection)
    row = task_row(store.config, handler, now=_database_time(store, now, raw), **options)
    if raw is not None:
        return add_in_transaction(store, raw, [row])[0]
    return _store_row(store, row)[0]


def add_task_created(store, handler, now=None, **options):
    """As add_task (no `connection`): (the task id, whether a task was stored) — False when
    a live task held the unique_key and its id is returned (``taskrunner add --json``)."""
    return _store_row(store, task_row(store.config, handler, now=store.database_time(now),
                                      **options))


def _store_row(store, row):
    if row["unique_key"] is not None:
        return _add_unique(store, row)
    if "debounce_open" in row:
        return _add_debounced(store, row)
    if store.backend == "postgresql" and row["queue"] in store.known_queues \
            and not store.db.in_transaction() and flow_known(store, row):
        task_id = store.statement(lambda: _add_in_one_statement(store, row))
        if is_due(row):
            store.wake_local(1, row["queue"])
        return task_id, True
    task_id = store.write_and_wake(lambda: insert_tasks(store, [row])[0],
                                   lambda _: int(is_due(row)), row["queue"])
    remember_queues(store, [row["queue"]])
    remember_flow(store, [row])
    return task_id, True


def flow_known(store, row):
    """Whether `row`'s rate key and tenant need no row written first (flow.record_rows)."""
    return (row["rate_key"] is None or row["rate_key"] in store.known_rate_keys) and \
        (row["tenant"] is None or (row["queue"], row["tenant"]) in store.known_tenants)


def remember_flow(store, rows):
    """After the commit: the rate keys and tenants of `rows` have their rows."""
    flow.remember(store, ({r["rate_key"] for r in rows if r["rate_key"] is not None},
                          {(r["queue"], r["tenant"]) for r in rows if r["tenant"] is not None}))


def add_tasks(store, tasks, now=None, connection=None):
    """Queue many tasks (dicts of add_task's arguments). All are validated before anything
    is stored; those without a unique_key are stored in one transaction, those with one each
    as add_task() stores them (with `connection`: all in the caller's transaction). Returns
    their ids in order."""
    tasks = [check_spec(spec) for spec in tasks]
    if any(spec.get("after") is not None for spec in tasks):
        if connection is not None:
            raise InputError("after= cannot be combined with connection=")
        return add_graph(store, tasks, now=now)[1]
    raw = None if connection is None else application_connection(store, connection)
    now = _database_time(store, now, raw)
    seen = {}
    rows = [task_row(store.config, now=now, known_handlers=seen, **spec) for spec in tasks]
    if raw is not None:
        return add_in_transaction(store, raw, rows)
    plain_rows = [row for row in rows if _plain(row)]
    plain = store.write(lambda: insert_many_and_wake(store, plain_rows)) if plain_rows else []
    remember_queues(store, [row["queue"] for row in plain_rows])
    remember_flow(store, plain_rows)
    ids, plain_ids = [], iter(plain)
    for row in rows:
        ids.append(next(plain_ids) if _plain(row) else _store_row(store, row)[0])
    return ids


def _plain(row):
    """Whether `row` is stored with the others of its add (no unique key, no debounce)."""
    return row["unique_key"] is None and "debounce_open" not in row


def check_spec(spec, extra=()):
    """A task spec (a dict of add_task's arguments with its "handler"), or InputError."""
    if not isinstance(spec, dict) or not isinstance(spec.get("handler"), str):
        raise InputError("invalid task %r: expected a dict with a 'handler'" % (spec,))
    unknown = set(spec) - set(TASK_OPTIONS) - {"handler"} - set(extra)
    if unknown:
        raise InputError("invalid task: unknown key %s" % ", ".join(sorted(unknown)))
    return spec


def _parent_list(after, keys):
    """`after` of a spec as parents for graph.plan: task ids, and ("row", j)
    for the key of an earlier spec of the same add."""
    if isinstance(after, (int, str)) and not isinstance(after, bool):
        after = [after]
    if not isinstance(after, (list, tuple)):
        raise InputError("after must be a list of task ids, not %r" % (after,))
    parents = []
    for parent in after:
        if isinstance(parent, str) and parent in keys:     # only the keys before it
            parents.append(("row", keys[parent]))
        elif isinstance(parent, int) and not isinstance(parent, bool) and \
                0 < parent <= LARGEST_ID:
            parents.append(parent)
        else:
            raise InputError("after: %r is neither a task id nor the key of a task added "
                             "before it" % (parent,))
    if len(set(parents)) < len(parents):
        raise InputError("after: a task is named twice")
    return parents


# The columns graph.plan may write in some rows of an add and not in others.
GRAPH_COLUMNS = ("dependents", "waiting_parents", "finished_on", "last_error_code",
                 "last_error_message")


def add_graph(store, specs, workflow=None, now=None):
    """Queue `specs` (dicts of add_task's arguments, with "after": ids of existing tasks and
    the "key" of earlier specs) in one write transaction, with their edges: a task whose
    parents have not all succeeded waits without a run (graph.py). `workflow`: None, or
    the name of a new workflow they form ("" for none); without it the tasks join their
    first parent's workflow. Returns (the workflow id or None, the task ids in order)."""
    now = store.database_time(now)
    keys, rows, parents, seen = {}, [], [], {}
    for index, spec in enumerate(specs):
        spec = dict(check_spec(spec, ("key",)))
        key = spec.pop("key", None)
        after = spec.pop("after", None)
        parents.append(_parent_list(after, keys) if after is not None else [])
        if key is not None:
            if not isinstance(key, str) or key in keys:
                raise InputError("key %r: a key is a string, unique within the tasks added "
                                 "together" % (key,))
            keys[key] = index
        row = task_row(store.config, now=now, known_handlers=seen, **spec)
        if row["unique_key"] is not None and (parents[-1] or workflow is not None):
            raise InputError("unique_key cannot be used for tasks of a workflow or with after")
        if "debounce_open" in row:
            raise InputError("debounce cannot be used for tasks of a workflow or with after")
        rows.append(row)
    existing = [p for after in parents for p in after if not isinstance(p, tuple)]

    def step():
        states = graph.parent_states(store, existing)
        edges = graph.plan(rows, parents, states, now)
        workflow_id = None
        if workflow is not None:
            workflow_id = store.Workflow.insert(name=workflow or None, created_on=now,
                                                task_count=len(rows)).execute()
        elif existing:
            workflow_id = graph.workflow_of(store, existing)
        for row in rows:        # one set of columns for the multi-row INSERTs
            row["workflow_id"] = workflow_id
            for name in GRAPH_COLUMNS:
                row.setdefault(name, None)
            row["dependents"] = row["dependents"] or 0
        ids = insert_many_and_wake(store, rows)
        graph.insert_edges(store, edges, ids)
        return workflow_id, ids
    result = store.write(step)
    remember_queues(store, [row["queue"] for row in rows])
    return result


def insert_many_and_wake(store, rows):
    """Inside the caller's write transaction: insert validated task rows (`task_row`) in
    multi-row INSERTs (`_insert_many`), then news of the due runs for each queue, as many
    runners woken after the commit; returns the task ids in order. The periodic scheduler
    submits its due tasks through here, a batch per transaction. The queue names are the
    caller's to `remember_queues` after the commit."""
    ids = _insert_many(store, rows)
    for queue, count in due_by_queue(rows).items():
        store.wake_after_commit(count, queue)
    return ids


def due_by_queue(rows):
    """{queue: how many of `rows` have a run due now}."""
    counts = {}
    for row in rows:
        if is_due(row):
            counts[row["queue"]] = counts.get(row["queue"], 0) + 1
    return counts


def _insert_many(store, rows):
    """Insert task rows (and the first run of each due one) in multi-row INSERTs, inside the
    caller's transaction; returns the task ids in order. Without INSERT ... RETURNING (MySQL),
    row by row."""
    if not store.insert_returning():
        return insert_tasks(store, rows)
    record_queues(store, [row["queue"] for row in rows])
    flow.record_rows(store, rows)
    ids = []
    for start in range(0, len(rows), BULK_ROWS):
        chunk = rows[start:start + BULK_ROWS]
        statement, params = sql.insert_rows(store.backend, store.Task, chunk)
        chunk_ids = sorted(row[0] for row in store.db.execute_sql(statement + " RETURNING id",
                                                                  params))
        runs = [first_run(task_id, row) for task_id, row in zip(chunk_ids, chunk) if is_due(row)]
        if runs:
            store.db.execute_sql(*sql.insert_rows(store.backend, store.Run, runs))
        ids.extend(chunk_ids)
    return ids


# -- inside the application's transaction -----------------------------------------------------

# The DB-API driver of a connection (by the module its class comes from) and its backend.
DRIVERS = {"sqlite3": "sqlite", "psycopg": "postgresql", "pymysql": "mysql"}


def dbapi_connection(connection):
    """The DB-API connection behind `connection`: itself, a SQLAlchemy ``Connection``'s, or
    a Django ``connection``'s (connected first)."""
    if hasattr(connection, "ensure_connection"):          # django.db.connection
        connection.ensure_connection()
        return connection.connection
    proxied = getattr(connection, "connection", None)     # sqlalchemy Connection
    driver = getattr(proxied, "driver_connection", None)
    return driver if driver is not None else connection


def application_connection(store, connection):
    """The DB-API connection behind the application's `connection`; InputError unless it is
    one to the queue's kind of database."""
    raw = dbapi_connection(connection)
    if DRIVERS.get(type(raw).__module__.split(".")[0]) != store.backend:
        raise InputError("connection= must be a %s connection to the queue's database, not %s"
                         % (store.backend, type(raw).__module__ + "." + type(raw).__name__))
    return raw


def _database_time(store, now, raw):
    """store.database_time(now); with the application's connection `raw`, the server's clock
    is read through it when it must be read (the store's own connection stays unused)."""
    if raw is None:
        return store.database_time(now)

    def read(statement):
        cursor = raw.cursor()
        try:
            cursor.execute(statement)
            return cursor.fetchone()[0]
        finally:
            cursor.close()
    return store.database_time(now, read)


def add_in_transaction(store, raw, rows):
    """Insert validated task rows (and the first run of each due one) with the application's
    connection, inside the transaction it has open: they commit or roll back with it. The
    store's own connection is not used. PostgreSQL: a NOTIFY in the same transaction wakes
    runners on every host when it commits; elsewhere the caller wakes this host's runners
    after the commit (`TaskQueue.wake`), or they find the tasks within poll_interval.
    A unique_key held by a live task returns that task's id; a unique_key added by another
    transaction at the same moment raises the driver's IntegrityError (the caller's
    transaction is then aborted, as after any constraint violation). `raw`: the
    application's DB-API connection (application_connection)."""
    _no_debounce(rows)
    cursor = raw.cursor()

    def execute(statement, params):
        cursor.execute(statement, params)
        return cursor
    try:
        record_queues(store, [row["queue"] for row in rows], execute)
        flow.record_rows(store, rows, execute)
        ids = []
        for row in rows:
            existing = None
            if row["unique_key"] is not None:
                cursor.execute("SELECT id FROM task_queue WHERE active_key = %s"
                               % ("?" if store.is_sqlite else "%s"), (row["unique_key"],))
                existing = cursor.fetchone()
            ids.append(existing[0] if existing else _insert_task(store, row, execute))
        if store.notifies:
            # Every hub acts on these, this host's too: the caller may not call wake().
            for queue, count in due_by_queue(rows).items():
                cursor.execute(NOTIFY_SQL, notify_params(count, queue))
    finally:
        cursor.close()
    return ids


def _no_debounce(rows):
    """InputError for a debounced row added in the application's transaction: landing in a
    window may need a second try after the unique index refused an insert, which would
    abort the application's transaction."""
    if any("debounce_open" in row for row in rows):
        raise InputError("debounce cannot be combined with connection=")


async def add_in_transaction_async(store, connection, rows):
    """`add_in_transaction` with an async driver's connection: psycopg's
    ``AsyncConnection`` on the queue's PostgreSQL database, the one async driver whose
    transaction taskrunner can share. Each task (with its first run and its NOTIFY) is one
    statement of the catalogue, as `_add_in_one_statement`."""
    import psycopg
    if store.backend != "postgresql" or not isinstance(connection, psycopg.AsyncConnection):
        raise InputError("connection= of an async add must be a psycopg AsyncConnection to "
                         "the queue's PostgreSQL database, not %s" % type(connection).__name__)
    _no_debounce(rows)
    queues = []
    record_queues(store, [row["queue"] for row in rows],
                  lambda statement, params: queues.append((statement, params)))
    flow.record_rows(store, rows, lambda statement, params: queues.append((statement, params)))
    ids = []
    async with connection.cursor() as cursor:
        for statement, params in queues:
            await cursor.execute(statement, params)
        for row in rows:
            if row["unique_key"] is not None:
                await cursor.execute("SELECT id FROM task_queue WHERE active_key = %s",
                                     (row["unique_key"],))
                existing = await cursor.fetchone()
                if existing is not None:
                    ids.append(existing[0])
                    continue
            await cursor.execute(*_one_statement(store, row))
            ids.append((await cursor.fetchone())[0])
    return ids
