"""Adding tasks: the checks every new task passes, and the INSERTs that store it (with its
first run when it is due, so a runner can start it at once).

Times given here are aware datetimes (a naive one is refused: "naive means UTC" in Python
and "naive means local time" on the command line would otherwise disagree); ``now`` is the
store's naive UTC.
"""
import json
from datetime import datetime, timezone

import peewee as pw

from ..config import check_queue_name
from ..errors import InputError, StateError, check_text
from ..handler import check_handler_path, encode_data, load_handler
from ..store.models import DEFAULT_QUEUE, SCHEDULED, utcnow
from ..host.wakeup import NOTIFY_SQL, notify_params
from ..timespan import parse_timespan

MAX_INT = 2 ** 31 - 1   # INTEGER columns on every database
BULK_ROWS = 500         # rows per INSERT: within every database's limit on bound parameters
TASK_OPTIONS = ("data", "scheduled_on", "max_retries", "priority", "run_timeout", "unique_key",
                "queued_by", "max_runtime", "retry_backoff", "periodic_task_id", "queue",
                "concurrency_key", "concurrency_limit")


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
             concurrency_limit=None):
    """Validate one task and return the row to insert; InputError on bad input.
    `known_handlers`, a dict, skips loading a handler already loaded in this batch; without
    `import_handler` the path is checked but not imported (the overseer's scheduler).
    `subject` and `group` come from a periodic task's definition, checked there. `queue`:
    None for the handler class's ``queue``, else ``default``. A task with a
    `concurrency_key` gets its runs from `lifecycle.create_missing_runs` (which takes a
    slot of the key), never at insert."""
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
    now = now or utcnow()
    scheduled_on = now if scheduled_on is None else utc_instant(scheduled_on)
    _check_int("max_retries", max_retries, 1, MAX_INT)
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
    due = scheduled_on <= now and concurrency_key is None
    return {
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
        "updated_on": now,
    }


def is_due(row):
    return row["next_run_on"] is None


def first_run(task_id, row):
    return {"task_id": task_id, "created_on": row["queued_on"], "updated_on": row["queued_on"],
            "attempt": 1, "active_task_id": task_id, "priority": row["priority"],
            "scheduled_on": row["scheduled_on"], "status": SCHEDULED, "percent_completed": 0,
            "queue": row["queue"]}


def record_queues(store, names):
    """Inside the caller's transaction: a task_queues row for each queue name not seen
    before (how runners serving ``default`` find the queues nobody configured, and where
    pausing is stored). Names this store wrote already are skipped; the cache is filled
    after the commit (`remember_queues`), since a rollback takes the row away again."""
    Queue = store.Queue
    new = sorted(set(names) - store.known_queues)
    if new:
        now = utcnow()
        Queue.insert_many([{"name": name, "paused": False, "updated_on": now} for name in new]
                          ).on_conflict_ignore().execute()
    return new


def remember_queues(store, names):
    """After the commit of `record_queues`' transaction (not inside an outer one, which may
    still roll back): these names need no insert again."""
    if not store.db.in_transaction():
        store.known_queues.update(names)


def insert_task(store, row):
    """Store one validated row (and its first run when due), inside the caller's
    transaction; returns the task id. Plain SQL: peewee builds a node per value, which
    costs several times the inserts themselves."""
    record_queues(store, [row["queue"]])
    task_id = _insert_row_sql(store, store.Task, row)
    if is_due(row):
        _insert_row_sql(store, store.Run, first_run(task_id, row))
    return task_id


_INSERT_SQL = {}      # (backend, table, columns) -> (INSERT statement, the columns' fields)


def _insert_row_sql(store, model, row):
    """INSERT one row (a dict of field names) through the store's connection, errors raised
    as peewee's (a unique key's IntegrityError); returns its id."""
    key = (store.backend, model._meta.table_name, tuple(row))
    known = _INSERT_SQL.get(key)
    if known is None:
        fields, columns, marks = _columns(model, row, store.db.param)
        known = _INSERT_SQL[key] = ("INSERT INTO %s (%s) VALUES (%s)%s" % (
            model._meta.table_name, columns, marks,
            " RETURNING id" if store.backend == "postgresql" else ""), fields)
    sql, fields = known
    cursor = store.db.execute_sql(sql, _values(store.backend, _db_values(fields, row.values())))
    return cursor.fetchone()[0] if store.backend == "postgresql" else cursor.lastrowid


def _columns(model, names, param):
    """The fields of `names` in `model`, their column list and as many placeholders."""
    fields = [model._meta.fields[name] for name in names]
    return fields, ", ".join(f.column_name for f in fields), ", ".join([param] * len(fields))


def _db_values(fields, values):
    return [f.db_value(value) for f, value in zip(fields, values)]


_ONE_STATEMENT = {}     # (columns, due, notify) -> (the statement, the task's and run's fields)


def _insert_in_one_statement(store, row):
    """PostgreSQL: the task, its first run when due, and the NOTIFY to other hosts, in one
    statement of data-modifying CTEs; returns the task id. An `add_task` is then one round
    trip, as Procrastinate's defer is, where BEGIN, two INSERTs, the NOTIFY and COMMIT were
    five (what a web request queueing work waits for). Every data-modifying CTE runs to
    completion, and the NOTIFY is read by the final SELECT, so all happen or none."""
    due = is_due(row)
    notify = due and store.notifies       # a task not due yet wakes nobody
    # The run's columns but the two the CTE fills with the task's id.
    run = {name: value for name, value in first_run(None, row).items()
           if name not in ("task_id", "active_task_id")} if due else {}
    key = (tuple(row), due, notify)
    known = _ONE_STATEMENT.get(key)
    if known is None:
        Task, Run = store.Task, store.Run
        task_fields, columns, marks = _columns(Task, row, "%s")
        sql = "WITH task AS (INSERT INTO %s (%s) VALUES (%s) RETURNING id)" % (
            Task._meta.table_name, columns, marks)
        run_fields, columns, marks = _columns(Run, run, "%s")
        if due:
            sql += ", run AS (INSERT INTO %s (%s, %s, %s) SELECT id, id, %s FROM task)" % (
                Run._meta.table_name, Run.task_id.column_name, Run.active_task_id.column_name,
                columns, marks)
        if notify:
            sql += ", news AS (%s AS sent)" % NOTIFY_SQL
        sql += " SELECT id FROM task" + (" CROSS JOIN news" if notify else "")
        known = _ONE_STATEMENT[key] = (sql, task_fields, run_fields)
    sql, task_fields, run_fields = known
    params = _db_values(task_fields, row.values()) + _db_values(run_fields, run.values())
    if notify:
        params += notify_params(1, row["queue"], store.origin)
    return store.db.execute_sql(sql, params).fetchone()[0]


def _add_unique(store, row):
    """Insert a task with a unique_key, or find the live task holding the key: (its id,
    whether it was inserted).
    Race closed: two adds of one key — the unique index on active_key lets one insert win;
    the other reads the winner's id (and tries again if that task ended meanwhile)."""
    Task = store.Task
    for _ in range(5):
        try:
            task_id = store.write_and_wake(lambda: insert_task(store, row),
                                           lambda _: int(is_due(row)), row["queue"])
            remember_queues(store, [row["queue"]])
            return task_id, True
        except pw.IntegrityError:
            existing = Task.select(Task.id).where(Task.active_key == row["unique_key"]).first()
            if existing is not None:
                return existing.id, False
    raise StateError("unique_key %r is contended; try again" % row["unique_key"])


def add_task(store, handler, now=None, connection=None, **options):
    """Queue one task and return its id. With `unique_key`, adding a key that a not-yet-final
    task holds stores nothing and returns that task's id. With `connection`, the caller's
    open DB-API connection writes it inside the caller's transaction (`add_in_transaction`)."""
    row = task_row(store.config, handler, now=now, **options)
    if connection is not None:
        return add_in_transaction(store, connection, [row])[0]
    return _store_row(store, row)[0]


def add_task_created(store, handler, now=None, **options):
    """As add_task (no `connection`): (the task id, whether a task was stored) — False when
    a live task held the unique_key and its id is returned (``taskrunner add --json``)."""
    return _store_row(store, task_row(store.config, handler, now=now, **options))


def _store_row(store, row):
    if row["unique_key"] is not None:
        return _add_unique(store, row)
    if store.backend == "postgresql" and row["queue"] in store.known_queues \
            and not store.db.in_transaction():
        task_id = store.statement(lambda: _insert_in_one_statement(store, row))
        if is_due(row):
            store.wake_local(1, row["queue"])
        return task_id, True
    task_id = store.write_and_wake(lambda: insert_task(store, row),
                                   lambda _: int(is_due(row)), row["queue"])
    remember_queues(store, [row["queue"]])
    return task_id, True


def add_tasks(store, tasks, now=None, connection=None):
    """Queue many tasks (dicts of add_task's arguments). All are validated before anything
    is stored; those without a unique_key are stored in one transaction, those with one each
    as add_task() stores them (with `connection`: all in the caller's transaction). Returns
    their ids in order."""
    now = now or utcnow()
    seen = {}
    rows = []
    for spec in tasks:
        if not isinstance(spec, dict) or not isinstance(spec.get("handler"), str):
            raise InputError("invalid task %r: expected a dict with a 'handler'" % (spec,))
        unknown = set(spec) - set(TASK_OPTIONS) - {"handler"}
        if unknown:
            raise InputError("invalid task: unknown key %s" % ", ".join(sorted(unknown)))
        rows.append(task_row(store.config, now=now, known_handlers=seen, **spec))
    if connection is not None:
        return add_in_transaction(store, connection, rows)
    plain_rows = [row for row in rows if row["unique_key"] is None]
    plain = store.write(lambda: _insert_many_and_wake(store, plain_rows)) if plain_rows else []
    remember_queues(store, [row["queue"] for row in plain_rows])
    ids, plain_ids = [], iter(plain)
    for row in rows:
        ids.append(next(plain_ids) if row["unique_key"] is None
                   else _add_unique(store, row)[0])
    return ids


def _insert_many_and_wake(store, rows):
    """_insert_many, then news of the due runs for each queue: as many runners woken."""
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
        return [insert_task(store, row) for row in rows]
    record_queues(store, [row["queue"] for row in rows])
    ids = []
    for start in range(0, len(rows), BULK_ROWS):
        chunk = rows[start:start + BULK_ROWS]
        chunk_ids = _insert_values(store, store.Task, chunk, returning=True)
        runs = [first_run(task_id, row) for task_id, row in zip(chunk_ids, chunk) if is_due(row)]
        if runs:
            _insert_values(store, store.Run, runs)
        ids.extend(chunk_ids)
    return ids


def _insert_values(store, model, rows, returning=False):
    """One multi-row INSERT of `rows` (dicts with the same keys), as plain SQL: peewee builds
    a node per value, which costs more than the insert itself. With `returning`, the new ids
    in row order (they are assigned in row order within one statement; RETURNING's own order
    is not promised everywhere, hence the sort)."""
    fields = [model._meta.fields[name] for name in rows[0]]
    table, columns = model._meta.table_name, ", ".join(f.column_name for f in fields)
    if store.backend == "postgresql":
        # psycopg parses each of thousands of placeholders in Python; one JSON parameter
        # expanded by the server costs a fraction of that.
        sql = "INSERT INTO %s (%s) SELECT %s FROM json_populate_recordset(NULL::%s, %%s)" % (
            table, columns, columns, table)
        params = [json.dumps([{f.column_name: f.db_value(row[f.name]) for f in fields}
                              for row in rows], default=str)]
    else:
        values = "(%s)" % ", ".join([store.db.param] * len(fields))
        sql = "INSERT INTO %s (%s) VALUES %s" % (table, columns, ", ".join([values] * len(rows)))
        params = [f.db_value(row[f.name]) for row in rows for f in fields]
    if not returning:
        store.db.execute_sql(sql, params)
        return None
    return sorted(row[0] for row in store.db.execute_sql(sql + " RETURNING id", params))


# -- inside the application's transaction -----------------------------------------------------

# The DB-API driver of a connection (by the module its class comes from) and its backend.
DRIVERS = {"sqlite3": "sqlite", "psycopg": "postgresql", "pymysql": "mysql"}
INSERT_QUEUE = {"sqlite": "INSERT OR IGNORE INTO task_queues (name, paused, updated_on) "
                          "VALUES (?, ?, ?)",
                "postgresql": "INSERT INTO task_queues (name, paused, updated_on) "
                              "VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                "mysql": "INSERT IGNORE INTO task_queues (name, paused, updated_on) "
                         "VALUES (%s, %s, %s)"}


def dbapi_connection(connection):
    """The DB-API connection behind `connection`: itself, a SQLAlchemy ``Connection``'s, or
    a Django ``connection``'s (connected first)."""
    if hasattr(connection, "ensure_connection"):          # django.db.connection
        connection.ensure_connection()
        return connection.connection
    proxied = getattr(connection, "connection", None)     # sqlalchemy Connection
    driver = getattr(proxied, "driver_connection", None)
    return driver if driver is not None else connection


def add_in_transaction(store, connection, rows):
    """Insert validated task rows (and the first run of each due one) with the caller's
    connection, inside the transaction it has open: they commit or roll back with it. The
    store's own connection is not used. PostgreSQL: a NOTIFY in the same transaction wakes
    runners on every host when it commits; elsewhere the caller wakes this host's runners
    after the commit (`TaskQueue.wake`), or they find the tasks within poll_interval.
    A unique_key held by a live task returns that task's id; a unique_key added by another
    transaction at the same moment raises the driver's IntegrityError (the caller's
    transaction is then aborted, as after any constraint violation)."""
    raw = dbapi_connection(connection)
    backend = DRIVERS.get(type(raw).__module__.split(".")[0])
    if backend != store.backend:
        raise InputError("connection= must be a %s connection to the queue's database, not %s"
                         % (store.backend, type(raw).__module__ + "." + type(raw).__name__))
    param = "?" if backend == "sqlite" else "%s"
    cursor = raw.cursor()
    try:
        now = utcnow()
        for name in sorted({row["queue"] for row in rows} - store.known_queues):
            cursor.execute(INSERT_QUEUE[backend], _values(backend, [name, False, now]))
        ids = [_insert_row(store, cursor, backend, param, row) for row in rows]
        if store.notifies:
            # Every hub acts on these, this host's too: the caller may not call wake().
            for queue, count in due_by_queue(rows).items():
                cursor.execute(NOTIFY_SQL, notify_params(count, queue))
    finally:
        cursor.close()
    return ids


def _insert_row(store, cursor, backend, param, row):
    if row["unique_key"] is not None:
        cursor.execute("SELECT id FROM task_queue WHERE active_key = %s" % param,
                       (row["unique_key"],))
        existing = cursor.fetchone()
        if existing is not None:
            return existing[0]
    task_id = _insert_one(store.Task, cursor, backend, param, row)
    if is_due(row):
        _insert_one(store.Run, cursor, backend, param, first_run(task_id, row))
    return task_id


def _insert_one(model, cursor, backend, param, row):
    fields = [model._meta.fields[name] for name in row]
    sql = "INSERT INTO %s (%s) VALUES (%s)" % (
        model._meta.table_name, ", ".join(f.column_name for f in fields),
        ", ".join([param] * len(fields)))
    values = _values(backend, [f.db_value(row[f.name]) for f in fields])
    if backend == "postgresql":
        cursor.execute(sql + " RETURNING id", values)
        return cursor.fetchone()[0]
    cursor.execute(sql, values)
    return cursor.lastrowid


def _values(backend, values):
    """SQLite: datetimes as the text peewee stores (Python 3.12 deprecates sqlite3's own
    adapter)."""
    if backend != "sqlite":
        return values
    return [v.isoformat(" ") if isinstance(v, datetime) else v for v in values]
