"""The run state machine's SQL, in one place (Procrastinate's queries.sql, PgQueuer's query
builder): every statement that adds a task, claims, ends, gives back or cancels a run, for
each database, each with the race it closes. `lifecycle` decides which one runs when and
calls the hooks; `runner.batches` claims and ends many runs with the same statements;
`enqueue` validates what it adds with these INSERTs.

A claim and a success happen once per job: plain SQL (peewee's query building costs more
than the database's work). PostgreSQL: one statement of data-modifying CTEs each, and a busy
runner's success and its next claim in one (one round trip and commit per job). SQLite:
UPDATE ... RETURNING; MySQL: a locking SELECT of the runs joined to their tasks. A claim
reads one queue along the task_runs_claim index (queue, CLAIM_ORDER). The rarer ends
(failures, timeouts, cancels, give-backs) are peewee queries, the same on every database.

Rule 4 in every end: the run's UPDATE is conditional on its state (``status = 'running'``,
and ``runner_id`` for a runner's own end), so whoever comes late changes nothing and learns
it from the row count. Times are bound as values, already on the database's clock
(`Store.database_time`).
"""
import json
from datetime import datetime

from ..host.wakeup import NOTIFY_SQL
from ..store.db import executor
from ..store.models import CANCELLED, RUNNING, SCHEDULED

# -- the claim order (rule 2) ------------------------------------------------------------------

# Highest priority first, FIFO within a priority: the order of the task_runs_claim index, so
# a claim reads the next runs off the index without sorting the backlog. (column, descending)
CLAIM_ORDER = (("priority", True), ("scheduled_on", False), ("id", False))
CLAIM_COLUMNS = ", ".join(column for column, _ in CLAIM_ORDER)


def claim_order_sql(table=""):
    """CLAIM_ORDER as an ORDER BY list, its columns prefixed with `table` ("r.")."""
    return ", ".join(table + column + (" DESC" if desc else "") for column, desc in CLAIM_ORDER)


def claim_order_of(Run):
    """CLAIM_ORDER for a peewee query of runs."""
    return [getattr(Run, column).desc() if desc else getattr(Run, column)
            for column, desc in CLAIM_ORDER]


def in_claim_order(rows, width):
    """`rows` whose last columns are CLAIM_COLUMNS (RETURNING has no order), sorted in the
    claim order and cut to their first `width` columns. Stable sorts, last key first. A
    claim of one run returns no CLAIM_COLUMNS: it is only cut."""
    rows = list(rows)
    if len(rows) < 2:
        return [tuple(row[:width]) for row in rows]
    for index, (_, desc) in reversed(list(enumerate(CLAIM_ORDER))):
        rows.sort(key=lambda row: row[width + index], reverse=desc)
    return [tuple(row[:width]) for row in rows]


# -- what a success writes ---------------------------------------------------------------------

# Every statement that ends a run ``success`` (one, one with the next claim, many, and each
# database's) writes these, so a column to reset is added here once. Values: {at} (the end)
# and {results}. SQLite rewrites each index of a SET column even unchanged (a WAL page each):
# the columns in SQLITE_APART, NULL for most runs, it clears in a statement of their own when
# RETURNING shows a value.
RUN_SUCCESS = (("status", "'success'"), ("finished_on", "{at}"), ("updated_on", "{at}"),
               ("active_task_id", "NULL"), ("concurrency_slot", "NULL"), ("error_code", "NULL"),
               ("error_message", "NULL"), ("percent_completed", "100"), ("results", "{results}"))
TASK_SUCCESS = (("last_status", "'success'"), ("runs_failed", "0"), ("runs_crashed", "0"),
                ("next_run_on", "NULL"),
                ("finished_on", "{at}"), ("active_key", "NULL"), ("updated_on", "{at}"))
SQLITE_APART = ("concurrency_slot", "next_run_on", "active_key")
# The order the statements below bind the values in.
RUN_SUCCESS_VALUES, TASK_SUCCESS_VALUES = ("at", "at", "results"), ("at", "at")


def _assignments(columns, at="%s", results="%s", leave_out=()):
    """A SET list of `columns` with their values; refuses (at import) a list whose values
    would bind in another order than the statements pass them."""
    kept = [(column, value) for column, value in columns if column not in leave_out]
    names = tuple(value[1:-1] for _, value in kept if value.startswith("{"))
    if names not in (RUN_SUCCESS_VALUES, TASK_SUCCESS_VALUES):
        raise AssertionError("success values bound out of order: %s" % (names,))
    return ", ".join("%s = %s" % (column, value.format(at=at, results=results))
                     for column, value in kept)


def _sqlite_apart(columns):
    """The columns of SQLITE_APART in `columns`, and the expression RETURNING shows (NULL
    when all are)."""
    apart = [column for column, _ in columns if column in SQLITE_APART]
    return apart, apart[0] if len(apart) == 1 else "coalesce(%s)" % ", ".join(apart)


# -- the claimer is alive (DESIGN rule 11) -----------------------------------------------------

# In every claim, on the runner row's primary key (one lookup, evaluated once per statement): a
# runner declared dead claims nothing more. Race closed: a runner cut off from the database
# (its network, a stop) whose row another host marked dead meanwhile — its claim, sent before
# the verdict and delivered after the heal, found runs; they ran again elsewhere as RunnerDied
# while it executed them. A claim whose snapshot still saw the row ``running`` as the row was
# marked is the one left: the fleet's pass ends that run (liveness.end_orphaned_runs), and the
# runner's heartbeat finds its row dead and its run taken away.
RUNNER_ALIVE = "EXISTS (SELECT 1 FROM task_runners WHERE id = %s AND status = 'running')"
# A guarded claim (`claim(..., guarded=True)`) also checks what a runner's look reads before an
# ordinary claim: the queue is not paused, and no rate key has a limit (then the claim would
# be a flow claim). A runner the hub woke for a new run claims so at once, on the claim order
# of its last look, however old: what changed since makes the claim come back empty, and the
# runner looks, then claims again. Only on GUARDED_BACKENDS (see claim_statements).
GUARDED_BACKENDS = ("postgresql", "sqlite")
CLAIM_GUARD = ("NOT EXISTS (SELECT 1 FROM task_queues AS q WHERE q.name = task_runs.queue "
               "AND q.paused) AND NOT EXISTS (SELECT 1 FROM task_rate_buckets AS b "
               "WHERE b.kind = 'key')")


def _guard(guarded):
    return "\n        AND " + CLAIM_GUARD if guarded else ""


# -- PostgreSQL --------------------------------------------------------------------------------

# A claim locks the candidate run and its task row together, skipping the candidate when
# either is locked. Race closed: a task row another transaction holds (the application's
# SELECT ... FOR UPDATE, an admin's edit, a long migration) — a claim that locked the run alone
# then waited for the task row in its UPDATE, and the runner stopped with other work due. The
# task row is locked FOR NO KEY UPDATE, the lock the claim's UPDATE of it takes anyway (a
# success's FOR KEY SHARE of it does not conflict).
PG_SKIP_LOCKED = "FOR UPDATE OF task_runs SKIP LOCKED FOR NO KEY UPDATE OF t SKIP LOCKED"


def _pg_claim_ctes(limit, guarded=False):
    # The claim order comes back only where in_claim_order has rows to sort: one run needs
    # none of it (3 columns fewer to copy, send and parse per job).
    order = limit > 1
    return """
    next AS (
        SELECT task_runs.id FROM task_runs JOIN task_queue AS t ON t.id = task_runs.task_id
        WHERE task_runs.status = 'scheduled' AND task_runs.queue = %%s
            AND %s%s
        ORDER BY %s LIMIT %d %s),
    claimed AS (
        UPDATE task_runs AS r SET status = 'running', runner_id = %%s, started_on = %%s,
            updated_on = %%s
        FROM next WHERE r.id = next.id RETURNING r.id, r.task_id, r.attempt%s),
    claimed_task AS (
        UPDATE task_queue AS t SET last_status = 'running', updated_on = %%s FROM claimed
        WHERE t.id = claimed.task_id
        RETURNING claimed.id, claimed.task_id, claimed.attempt, t.handler, t.data,
            t.max_runtime, t.periodic_task_id%s)""" % (
        RUNNER_ALIVE % "%s", _guard(guarded), claim_order_sql("task_runs."), int(limit),
        PG_SKIP_LOCKED,
        "".join(", r." + c for c, _ in CLAIM_ORDER if c != "id") if order else "",
        "".join(", claimed." + c for c, _ in CLAIM_ORDER) if order else "")


# A task with dependents (task_queue.dependents > 0) releases them in its success's
# transaction (graph.release). The one-statement successes below are PostgreSQL's outside a
# transaction: they end no run of such a task, and return its count of dependents instead,
# for the caller to end it in a transaction (end_success). The count is read under a KEY SHARE
# lock of the task row, so it is the latest: an add of a dependent (which locks the row FOR
# UPDATE) either committed before — the count shows it — or waits and then finds the parent
# succeeded. Race closed: a dependent added as its parent's success statement started, whose
# edge that statement's snapshot could not see. KEY SHARE conflicts with no other writer of
# the row (a timeout, a cancel), so it adds no lock wait and no deadlock. The task is named by
# its id (the runner's claimed run carries it), not found through the run: one index lookup
# per job fewer than a join of task_runs.
PG_GUARD_CTE = """
    guard AS (
        SELECT dependents FROM task_queue WHERE id = %s FOR KEY SHARE),"""


def _pg_success_ctes(guarded):
    return (PG_GUARD_CTE if guarded else "") + """
    ended AS (
        UPDATE task_runs SET %s
        WHERE id = %%s AND status = 'running' AND runner_id = %%s%s RETURNING task_id),
    ended_task AS (
        UPDATE task_queue AS t SET %s
        FROM ended WHERE t.id = ended.task_id RETURNING t.id, t.dependents)""" % (
        _assignments(RUN_SUCCESS),
        " AND (SELECT dependents FROM guard) = 0" if guarded else "",
        _assignments(TASK_SUCCESS))


# Parameters: the guard's (task_id); the claim's (queue, runner_id, runner_id, at, at, at); the
# success's (at, at, results, run_id, runner_id, at, at). Returns (runs ended, the task's
# dependents).
PG_SUCCESS = ("WITH" + _pg_success_ctes(True) + " SELECT (SELECT count(*) FROM ended_task), "
              "(SELECT dependents FROM guard)")
# Inside a transaction: no guard; the caller releases the dependents after it (RETURNING
# shows the latest count, the row being locked by the UPDATE).
PG_SUCCESS_IN_TRANSACTION = ("WITH" + _pg_success_ctes(False)
                             + " SELECT count(*), max(dependents) FROM ended_task")
# Every data-modifying CTE runs to completion whether or not the final SELECT reads it: the
# success happens even when the claim finds nothing, and the reverse.
PG_SUCCESS_AND_CLAIM = ("WITH" + _pg_success_ctes(True) + "," + _pg_claim_ctes(1) + """
    SELECT (SELECT count(*) FROM ended_task), (SELECT dependents FROM guard), c.*
    FROM (VALUES (1)) AS one LEFT JOIN claimed_task AS c ON true""")
# Successes of one runner, each with its own end time and results, in one statement, inside
# the caller's transaction: the ids of the runs ended, and their tasks' dependents.
PG_SUCCESSES = """
    WITH done AS (
        SELECT * FROM unnest(%%s::bigint[], %%s::timestamp[], %%s::text[])
            AS d(id, finished_on, results)),
    ended AS (
        UPDATE task_runs AS r SET %s
        FROM done WHERE r.id = done.id AND r.status = 'running' AND r.runner_id = %%s
        RETURNING r.id, r.task_id, done.finished_on),
    ended_task AS (
        UPDATE task_queue AS t SET %s
        FROM ended WHERE t.id = ended.task_id RETURNING t.id, t.dependents)
    SELECT ended.id, ended.task_id, ended_task.dependents FROM ended
    JOIN ended_task ON ended_task.id = ended.task_id""" % (
    _assignments(RUN_SUCCESS, "done.finished_on", "done.results"),
    _assignments(TASK_SUCCESS, "ended.finished_on"))

# -- SQLite ------------------------------------------------------------------------------------

def _sqlite_claim(limit, guarded=False):
    # One run: "id = (...)", as "IN" builds an ephemeral list first (3 us more per claim).
    return ("""
    UPDATE task_runs SET status = 'running', runner_id = ?, started_on = ?, updated_on = ?
    WHERE id %s (SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = ?
                 ORDER BY %s LIMIT %d)
        AND %s%s
    RETURNING id, task_id, attempt%s""" % ("=" if limit == 1 else "IN", claim_order_sql(),
                                           int(limit), RUNNER_ALIVE % "?", _guard(guarded),
                                           ", " + CLAIM_COLUMNS if limit > 1 else ""), """
    UPDATE task_queue SET last_status = 'running', updated_on = ? WHERE id = ?
    RETURNING handler, data, max_runtime, periodic_task_id""")


_RUN_APART, _RUN_SHOWS = _sqlite_apart(RUN_SUCCESS)
_TASK_APART, _TASK_SHOWS = _sqlite_apart(TASK_SUCCESS)
SQLITE_SUCCESS = (
    "UPDATE task_runs SET %s WHERE id = ? AND status = 'running' AND runner_id = ? "
    "RETURNING %s" % (_assignments(RUN_SUCCESS, "?", "?", SQLITE_APART), _RUN_SHOWS),
    "UPDATE task_runs SET %s WHERE id = ?" % ", ".join(c + " = NULL" for c in _RUN_APART),
    "UPDATE task_queue SET %s WHERE id = ? RETURNING %s, dependents" % (
        _assignments(TASK_SUCCESS, "?", leave_out=SQLITE_APART), _TASK_SHOWS),
    "UPDATE task_queue SET %s WHERE id = ?" % ", ".join(c + " = NULL" for c in _TASK_APART))

# -- MySQL -------------------------------------------------------------------------------------

# The candidates and their tasks locked and read at once (InnoDB locks the joined task rows
# too, which the claim updates anyway), then both marked.
def _mysql_claim(limit):
    return """
    SELECT r.id, r.task_id, r.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id
    FROM task_runs AS r JOIN task_queue AS t ON t.id = r.task_id
    WHERE r.status = 'scheduled' AND r.queue = %%s
        AND %s
    ORDER BY %s LIMIT %d
    FOR UPDATE SKIP LOCKED""" % (RUNNER_ALIVE % "%s", claim_order_sql("r."), int(limit))


# The locking read skips a run whose run or task row is locked. The UPDATEs that follow name
# the primary key (FORCE INDEX): on a small table InnoDB would rather scan it, locking every
# row it reads, and wait for a row another transaction holds (a task row the application
# locked, the run another claimer took) — the wait the SKIP LOCKED was there to avoid.
MYSQL_START = ("UPDATE task_runs FORCE INDEX (PRIMARY) SET status = 'running', runner_id = %%s, "
               "started_on = %%s, updated_on = %%s WHERE id IN (%s)",
               "UPDATE task_queue FORCE INDEX (PRIMARY) SET last_status = 'running', "
               "updated_on = %%s WHERE id IN (%s)")
# The whole SET, unlike SQLite's: InnoDB leaves the index entries of a column set to the value
# it had. The task's UPDATE matches a task without dependents only (an UPDATE reads the
# latest row, under its lock): when it changes nothing, the task has some, and the third
# statement ends it before they are released (graph.release).
MYSQL_SUCCESS = (
    "UPDATE task_runs SET %s WHERE id = %%s AND status = 'running' AND runner_id = %%s"
    % _assignments(RUN_SUCCESS),
    "UPDATE task_queue SET %s WHERE id = %%s AND dependents = 0" % _assignments(TASK_SUCCESS),
    "UPDATE task_queue SET %s WHERE id = %%s" % _assignments(TASK_SUCCESS))

# -- flow control in the claim (runs/flow.py) --------------------------------------------------
# A claim of a queue with a rate, of any queue while some key has a rate limit, or of a fair
# queue is one of these; any other claim is the plain one above, unchanged. Named parameters:
# q (queue), runner, at (the claim's time), e (the same on the database's clock in epoch
# seconds: a bucket's arithmetic is plain numbers on every database). A flow claim takes one
# run. Races closed, besides the plain claim's:
# - two claimers spending one token: the spend is an UPDATE of the bucket row conditional on
#   a token being there when it runs (PostgreSQL re-evaluates it on the row's latest version
#   after waiting for its lock; SQLite holds the write lock; MySQL locks the row first), and
#   the run is claimed only when its spend succeeded;
# - a token spent for nothing: PostgreSQL spends the queue's token only once `next` locked a
#   run; a run lost to its key's empty bucket after the queue's token was spent (the key's
#   last token taken meanwhile) wastes that token, which only slows the queue down.

def _refill(backend, b=""):
    """A bucket's tokens now: refilled at `rate` since `stamp`, up to `burst`."""
    least, greatest = ("min", "max") if backend == "sqlite" else ("LEAST", "GREATEST")
    return "%s(%sburst, %stokens + %s(0, {e} - %sstamp) * %srate)" % (
        least, b, b, greatest, b, b)


def _params(backend, text):
    """`text` with {name} placeholders written for `backend`'s driver (named parameters)."""
    mark = ":%s" if backend == "sqlite" else "%%(%s)s"
    return text.replace("%", "%%" if backend != "sqlite" else "%").format(
        **{n: mark % n for n in ("q", "runner", "at", "e", "key", "tenant")})


def _key_filter(backend, column):
    """`column`'s run has no rate key, or one whose bucket holds a token now."""
    return ("({c} IS NULL OR {c} NOT IN (SELECT name FROM task_rate_buckets WHERE kind = 'key' "
            "AND %s < 1))" % _refill(backend)).replace("{c}", column)


def _fair_pick(backend, keys):
    """The queue's tenant served longest ago that has a scheduled run (claimable now)."""
    waiting = ("SELECT 1 FROM task_runs AS w WHERE w.status = 'scheduled' AND w.queue = "
               "f.queue AND w.tenant = f.tenant%s" % (
                   " AND " + _key_filter(backend, "w.rate_key") if keys else ""))
    # MariaDB turns an EXISTS into a semi-join it materializes by scanning task_runs; a
    # scalar subquery stays a lookup of task_runs_fair per tenant.
    waiting = "(%s LIMIT 1) IS NOT NULL" % waiting if backend == "mysql" \
        else "EXISTS (%s)" % waiting
    return ("(SELECT f.tenant FROM task_tenants AS f WHERE f.queue = {q} AND %s "
            "ORDER BY f.served, f.tenant LIMIT 1)" % waiting)


def _spend(backend, kind, name, b=""):
    """UPDATE of one bucket taking a token, when it has one."""
    refill = _refill(backend, b)
    return ("UPDATE task_rate_buckets%s SET tokens = %s - 1, stamp = %s(%sstamp, {e}), "
            "updated_on = {at} WHERE %skind = '%s' AND %sname = %s AND %s >= 1" % (
                " AS b" if b else "", refill, "max" if backend == "sqlite" else "GREATEST", b, b,
                kind, b, name, refill))


def _served(backend, tenant):
    """UPDATE of the tenant just served: the queue's next sequence number."""
    highest = "SELECT coalesce(max(served), 0) + 1 FROM task_tenants WHERE queue = {q}"
    if backend == "mysql":          # MySQL reads the table it updates only through a copy
        highest = "SELECT m FROM (SELECT coalesce(max(served), 0) + 1 AS m FROM task_tenants " \
                  "WHERE queue = {q}) AS x"
    return "UPDATE task_tenants SET served = (%s) WHERE queue = {q} AND tenant = %s" % (
        highest, tenant)


def _pg_flow_claim(rate, keys, fair):
    ctes = []
    if fair:
        ctes.append("pick AS %s" % _fair_pick("postgresql", keys))
    ctes.append("""next AS (
        SELECT task_runs.id, task_runs.rate_key, task_runs.tenant
        FROM task_runs JOIN task_queue AS t ON t.id = task_runs.task_id
        WHERE task_runs.status = 'scheduled' AND task_runs.queue = {q}
            %s%s AND %s
        ORDER BY %s LIMIT 1 %s)""" % (
        "AND task_runs.tenant = (SELECT tenant FROM pick) " if fair else "",
        "AND " + _key_filter("postgresql", "task_runs.rate_key") if keys else "",
        RUNNER_ALIVE % "{runner}", claim_order_sql("task_runs."), PG_SKIP_LOCKED))
    allowed = ""
    if rate:
        ctes.append("queue_token AS (%s AND EXISTS (SELECT 1 FROM next) RETURNING 1)"
                    % _spend("postgresql", "queue", "{q}"))
        allowed += " AND EXISTS (SELECT 1 FROM queue_token)"
    if keys:
        ctes.append("key_token AS (%s RETURNING b.name)" % _spend(
            "postgresql", "key", "(SELECT rate_key FROM next)", "b."))
        allowed += (" AND (next.rate_key IS NULL OR EXISTS (SELECT 1 FROM key_token) OR NOT "
                    "EXISTS (SELECT 1 FROM task_rate_buckets AS k WHERE k.kind = 'key' AND "
                    "k.name = next.rate_key))")
    ctes.append("""claimed AS (
        UPDATE task_runs AS r SET status = 'running', runner_id = {runner}, started_on = {at},
            updated_on = {at}
        FROM next WHERE r.id = next.id%s RETURNING r.id, r.task_id, r.attempt, r.tenant)"""
                % allowed)
    ctes.append("""claimed_task AS (
        UPDATE task_queue AS t SET last_status = 'running', updated_on = {at} FROM claimed
        WHERE t.id = claimed.task_id
        RETURNING claimed.id, claimed.task_id, claimed.attempt, t.handler, t.data,
            t.max_runtime, t.periodic_task_id)""")
    if fair:
        ctes.append("served AS (%s AND EXISTS (SELECT 1 FROM claimed) RETURNING 1)"
                    % _served("postgresql", "(SELECT tenant FROM claimed)"))
    return _params("postgresql", "WITH " + ",\n    ".join(ctes) + " SELECT * FROM claimed_task")


def _sqlite_flow_claim(rate, keys, fair):
    """(the claim of the run, the spends that follow it): under SQLite's write lock the
    candidate's buckets cannot change between the two."""
    run = """
    UPDATE task_runs SET status = 'running', runner_id = {runner}, started_on = {at},
        updated_on = {at}
    WHERE id = (SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = {q}
                 %s%s ORDER BY %s LIMIT 1)
        AND %s%s
    RETURNING id, task_id, attempt, rate_key, tenant""" % (
        "AND tenant = %s " % _fair_pick("sqlite", keys) if fair else "",
        "AND " + _key_filter("sqlite", "rate_key") if keys else "",
        claim_order_sql(), RUNNER_ALIVE % "{runner}",
        " AND EXISTS (SELECT 1 FROM task_rate_buckets WHERE kind = 'queue' AND name = {q} "
        "AND %s >= 1)" % _refill("sqlite") if rate else "")
    return tuple(_params("sqlite", text) for text in (
        run, _spend("sqlite", "queue", "{q}"), _spend("sqlite", "key", "{key}"),
        _served("sqlite", "{tenant}")))


def _mysql_flow_claim(rate, keys, fair):
    """(the queue bucket's check, locking its row; the locking read of the run; the spends)."""
    run = """
    SELECT r.id, r.task_id, r.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id,
        r.rate_key, r.tenant
    FROM task_runs AS r JOIN task_queue AS t ON t.id = r.task_id
    WHERE r.status = 'scheduled' AND r.queue = {q}
        %s%s AND %s
    ORDER BY %s LIMIT 1
    FOR UPDATE SKIP LOCKED""" % (
        "AND r.tenant = %s " % _fair_pick("mysql", keys) if fair else "",
        "AND " + _key_filter("mysql", "r.rate_key") if keys else "",
        RUNNER_ALIVE % "{runner}", claim_order_sql("r."))
    check = ("SELECT %s >= 1 FROM task_rate_buckets WHERE kind = 'queue' AND name = {q} "
             "FOR UPDATE" % _refill("mysql"))
    return tuple(_params("mysql", text) for text in (
        check, run, _spend("mysql", "queue", "{q}"), _spend("mysql", "key", "{key}"),
        _served("mysql", "{tenant}")))


_FLOW_CLAIMS = {}     # (backend, rate, keys, fair) -> the statement(s) of a flow claim


def flow_claim_statements(backend, rate, keys, fair):
    """The statement(s) of a claim of one run of a queue under flow control: its `rate`
    (token bucket), the rate limits of keys (`keys`), fairness between tenants (`fair`)."""
    key = (backend, bool(rate), bool(keys), bool(fair))
    if key not in _FLOW_CLAIMS:
        build = {"postgresql": _pg_flow_claim, "sqlite": _sqlite_flow_claim}.get(
            backend, _mysql_flow_claim)
        _FLOW_CLAIMS[key] = build(*key[1:])
    return _FLOW_CLAIMS[key]


def epoch_seconds(at):
    """A naive UTC datetime as seconds since the epoch (a bucket's stamp)."""
    return (at - EPOCH).total_seconds()


EPOCH = datetime(1970, 1, 1)


def flow_claim(store, runner_id, queue, at, rate, keys, fair):
    """The claim of one run of `queue` under flow control (flow_claim_statements), inside
    the caller's write transaction but on PostgreSQL (one statement). A fair claim that finds
    no tenant with a run (only runs without a tenant, or its tenant's run locked by another
    claimer) claims as the queue would without fairness. A list of at most one row, as
    `claim`'s."""
    execute, backend = store.db.execute_sql, store.backend
    statements = flow_claim_statements(backend, rate, keys, fair)
    stamp = at.isoformat(" ") if backend == "sqlite" else at
    values = {"q": queue, "runner": runner_id, "at": stamp, "e": epoch_seconds(at)}
    if backend == "postgresql":
        rows = [tuple(row) for row in execute(statements, values)]
    elif backend == "sqlite":
        claim_run, spend_queue, spend_key, served = statements
        row = execute(claim_run, values).fetchone()
        rows = []
        if row is not None:
            if rate:
                execute(spend_queue, values)
            if keys and row[3] is not None:
                execute(spend_key, dict(values, key=row[3]))
            if fair and row[4] is not None:
                execute(served, dict(values, tenant=row[4]))
            task = execute(_sqlite_claim(1)[1], (stamp, row[1])).fetchone()
            rows = [tuple(row[:3]) + tuple(task)]
    else:
        rows = _mysql_flow_claim_rows(store, statements, values, rate, keys, fair)
    if not rows and fair:
        return flow_claim(store, runner_id, queue, at, rate, keys, False) \
            if (rate or keys) else claim(store, runner_id, queue, at)
    return rows


def _mysql_flow_claim_rows(store, statements, values, rate, keys, fair):
    execute = store.db.execute_sql
    check, claim_run, spend_queue, spend_key, served = statements
    if rate:
        allowed = execute(check, values).fetchone()
        if allowed is not None and not allowed[0]:
            return []
    row = execute(claim_run, values).fetchone()
    if row is None:
        return []
    if keys and row[7] is not None and not execute(spend_key, dict(values, key=row[7])
                                                   ).rowcount:
        Bucket = store.RateBucket
        if Bucket.select().where((Bucket.kind == "key") & (Bucket.name == row[7])).exists():
            return []         # its key's last token went to another claimer meanwhile
    if rate:
        execute(spend_queue, values)
    if fair and row[8] is not None:
        execute(served, dict(values, tenant=row[8]))
    execute(MYSQL_START[0] % "%s", (values["runner"], values["at"], values["at"], row[0]))
    execute(MYSQL_START[1] % "%s", (values["at"], row[1]))
    return [tuple(row[:CLAIMED_WIDTH])]


# -- a batch's share of the backlog -----------------------------------------------------------

# The runners running now (every host's), and the scheduled runs of one queue, counted up to a
# cap off the claim index (an index-only read of at most the cap's entries, however long the
# backlog).
_BACKLOG = ("SELECT (SELECT count(*) FROM task_runners WHERE status = 'running' AND kind = "
            "'runner'), (SELECT count(*) FROM (SELECT 1 FROM task_runs WHERE status = "
            "'scheduled' AND queue = {p} LIMIT {p}) AS backlog)")
BACKLOG = {"sqlite": _BACKLOG.format(p="?"), "postgresql": _BACKLOG.format(p="%s"),
           "mysql": _BACKLOG.format(p="%s")}
# The most runners a share is counted for: the backlog is read up to `want` times this.
SHARE_OF = 64


def backlog_share(store, queue, want):
    """How many of `queue`'s scheduled runs a batched runner takes, at most `want`: its share
    of them among the runners running now, rounded up — all of `want` while the backlog
    is at least `want` per runner, one when there are no more runs than runners. So a few
    runs added at once go to as many runners instead of the first one woken, and a batch
    shrinks as the backlog drains (no runner holds runs the others could start)."""
    runners, backlog = store.db.execute_sql(BACKLOG[store.backend],
                                            (queue, want * SHARE_OF)).fetchone()
    return max(1, min(want, -(-backlog // max(1, runners))))


# -- claiming ----------------------------------------------------------------------------------

_CLAIMS = {}      # (backend, limit) -> the statement(s) of a claim of up to `limit` runs


def claim_statements(backend, limit, guarded=False):
    """The statement(s) that claim up to `limit` runs of one queue on `backend`: a single
    claim is the claim of many with a limit of 1 (LIMIT is written into the statement, as
    the planner then knows it reads a few rows off the index). `guarded`: see CLAIM_GUARD;
    not on MySQL, whose locking read would lock (or skip) the rows the guard reads too."""
    if guarded and backend not in GUARDED_BACKENDS:
        raise ValueError("no guarded claim on %s" % backend)
    key = (backend, limit, guarded)
    if key not in _CLAIMS:
        _CLAIMS[key] = ("WITH" + _pg_claim_ctes(limit, guarded) + " SELECT * FROM claimed_task"
                        if backend == "postgresql" else _sqlite_claim(limit, guarded)
                        if backend == "sqlite" else _mysql_claim(limit))
    return _CLAIMS[key]


CLAIMED_WIDTH = 7     # run id, task id, attempt, handler, data, max_runtime, periodic_task_id


def claim(store, runner_id, queue, at, limit=1, flow=None, guarded=False):
    """Up to `limit` scheduled runs of `queue` become ``running`` under `runner_id` (and
    their tasks), in the claim order: a list of (run id, task id, attempt, handler, data,
    max_runtime, periodic_task_id). Inside the caller's write transaction, but on PostgreSQL
    (one statement).
    Race closed: two runners taking the same run — PostgreSQL and MySQL lock the candidates
    FOR UPDATE SKIP LOCKED, so a concurrent claimer passes over them instead of waiting, and
    lock each candidate's task row with it (PG_SKIP_LOCKED; MySQL's join), so a task row
    another transaction holds makes the claim pass over that task, not wait for it;
    SQLite takes the write lock up front (BEGIN IMMEDIATE), so the select and the update
    are one step.
    `flow`: (rate, keys, fair) of a queue under flow control (`flow_claim`, one run).
    `guarded`: the queue must not be paused, nor any rate key limited (CLAIM_GUARD; not
    with `flow`)."""
    if flow is not None and any(flow):
        return flow_claim(store, runner_id, queue, at, *flow)
    execute, statements = executor(store.db), claim_statements(store.backend, limit, guarded)
    if store.backend == "postgresql":
        return in_claim_order(execute(statements, (queue, runner_id, runner_id, at, at, at)),
                              CLAIMED_WIDTH)
    if store.is_sqlite:
        claim_runs, claim_task = statements
        stamp = at.isoformat(" ")         # bound as text once
        runs = in_claim_order(execute(claim_runs, (runner_id, stamp, stamp, queue, runner_id)),
                              3)
        return [run + execute(claim_task, (stamp, run[1])).fetchone() for run in runs]
    rows = execute(statements, (queue, runner_id)).fetchall()
    if rows:
        marks = ", ".join(["%s"] * len(rows))
        execute(MYSQL_START[0] % marks, (runner_id, at, at, *[r[0] for r in rows]))
        execute(MYSQL_START[1] % marks, (at, *[r[1] for r in rows]))
    return [tuple(row) for row in rows]


# What end_success answers besides True (ended) and False (not: rule 4): the run ended and its
# task has dependents, for the caller to release in the same transaction (graph.release).
RELEASE = "release"


def end_success_and_claim(store, run_id, task_id, runner_id, results, at, queue):
    """PostgreSQL, one statement: `end_success_alone` of a runner's run (of the task
    `task_id`) and the `claim` of its next from `queue`, with the races both close. Returns
    (True, False or None as end_success_alone, the claimed row or None)."""
    row = store.db.execute_sql(PG_SUCCESS_AND_CLAIM, (
        task_id, at, at, results, run_id, runner_id, at, at, queue, runner_id, runner_id,
        at, at, at)).fetchone()
    ended = True if row[0] > 0 else None if row[1] else False
    return ended, None if row[2] is None else tuple(row[2:2 + CLAIMED_WIDTH])


# -- ending ------------------------------------------------------------------------------------

def end_success_alone(store, run_id, task_id, runner_id, results, at):
    """PostgreSQL, one statement and its own transaction: the run ``success`` and its task,
    as `end_success`, unless the task has dependents. Returns True (ended), False (not: rule
    4), or None: the task has dependents — not ended; end it in a transaction
    (`end_success`, then graph.release)."""
    ended, dependents = store.db.execute_sql(
        PG_SUCCESS, (task_id, at, at, results, run_id, runner_id, at, at)).fetchone()
    return True if ended > 0 else None if dependents else False


def end_success(store, run_id, task_id, runner_id, results, at):
    """Inside the caller's transaction: the run ``success`` and its task, RUN_SUCCESS and
    TASK_SUCCESS. Returns False (not ended), True, or RELEASE (ended, and the task has
    dependents to release in this transaction).
    Race closed: a runner finishing a run someone timed out meanwhile (rule 4) — WHERE
    status = 'running' AND runner_id = ?, and the task is written only when the run was."""
    execute = executor(store.db)
    if store.backend == "postgresql":
        ended, dependents = execute(PG_SUCCESS_IN_TRANSACTION, (
            at, at, results, run_id, runner_id, at, at)).fetchone()
        return False if not ended else RELEASE if dependents else True
    if store.is_sqlite:
        end_run, clear_run, end_task, clear_task = SQLITE_SUCCESS
        at = at.isoformat(" ")
        shown = execute(end_run, (at, at, results, run_id, runner_id)).fetchone()
        if shown is None:
            return False
        if shown[0] is not None:
            execute(clear_run, (run_id,))
        task = execute(end_task, (at, at, task_id)).fetchone()
        if task is not None and task[0] is not None:
            execute(clear_task, (task_id,))
        return RELEASE if task is not None and task[1] else True
    if not execute(MYSQL_SUCCESS[0], (at, at, results, run_id, runner_id)).rowcount:
        return False
    if execute(MYSQL_SUCCESS[1], (at, at, task_id)).rowcount:
        return True
    execute(MYSQL_SUCCESS[2], (at, at, task_id))
    return RELEASE


def end_successes(store, runner_id, done):
    """Inside the caller's write transaction: `end_success` of each of `done`, (run id, task
    id, results, at) of runs of `runner_id`, under the same condition (rule 4); PostgreSQL
    in one statement. Returns {run id ended: its task id if it has dependents to release in
    this transaction, else None}."""
    if store.backend == "postgresql":
        ids, _, results, ats = zip(*done)
        return {row[0]: row[1] if row[2] else None for row in store.db.execute_sql(
            PG_SUCCESSES, (list(ids), list(ats), list(results), runner_id))}
    ended = {}
    for run_id, task_id, results, at in done:
        outcome = end_success(store, run_id, task_id, runner_id, results, at)
        if outcome:
            ended[run_id] = task_id if outcome == RELEASE else None
    return ended


def end_running(store, run_id, runner_id, status, at, error_code=None, error_message=None,
                results=None, traceback=None):
    """A ``running`` run (of `runner_id`, when given: a runner ending its own) ends with
    `status`: error, timeout, cancelled, or requeued (handed back: it runs again). Returns
    whether it did.
    Race closed: a runner that comes back late, or two processes noticing one death or one
    timeout (rule 4) — the UPDATE matches only a run still ``running`` (under that runner),
    so exactly one end counts."""
    Run = store.Run
    values = {Run.status: status, Run.finished_on: at, Run.updated_on: at,
              Run.active_task_id: None, Run.concurrency_slot: None, Run.error_code: error_code,
              Run.error_message: error_message}
    if results is not None:
        values[Run.results] = results
    if traceback is not None:
        values[Run.traceback] = traceback
    condition = (Run.id == run_id) & (Run.status == RUNNING)
    if runner_id is not None:
        condition &= Run.runner_id == runner_id
    return Run.update(values).where(condition).execute() > 0


def cancel_scheduled(store, run_id, at):
    """A ``scheduled`` run ends ``cancelled``; returns whether it did.
    Race closed: a cancel against a runner claiming the run — WHERE status = 'scheduled':
    once claimed, the run is the runner's to end (it is asked to stop instead)."""
    Run = store.Run
    return Run.update(status=CANCELLED, finished_on=at, updated_on=at, active_task_id=None,
                      concurrency_slot=None).where(
        (Run.id == run_id) & (Run.status == SCHEDULED)).execute() > 0


def ask_to_stop(store, run_id, at):
    """An operator's cancel of a ``running`` run: its runner sees it and ends the run
    ``cancelled`` (the run stays its runner's to end). Returns whether the run was running.
    Race closed: the run ending meanwhile — WHERE status = 'running'."""
    Run = store.Run
    return Run.update(cancel_requested_on=at).where(
        (Run.id == run_id) & (Run.status == RUNNING)).execute() > 0


def give_back(store, run_id, task_id, runner_id, at):
    """A ``running`` run of `runner_id` goes back to ``scheduled``, unstarted (not a failure,
    not a new attempt), and its task with it. Returns whether it did.
    Race closed: giving back a run someone timed out meanwhile (rule 4) — WHERE status =
    'running' AND runner_id = ?, and the task is written only when the run was."""
    Task, Run = store.Task, store.Run
    if not Run.update(status=SCHEDULED, runner_id=None, started_on=None, updated_on=at).where(
            (Run.id == run_id) & (Run.status == RUNNING) & (Run.runner_id == runner_id)
    ).execute():
        return False
    Task.update(last_status=SCHEDULED, updated_on=at).where(Task.id == task_id).execute()
    return True


def end_task(store, task_id, status, at, **values):
    """The task ends: final with `status` (``success`` is `end_success`'s; cancelled, or a
    failure given up), no next run, its unique_key free, waiting for no concurrency slot.
    `values`: more columns to write (a failure's counts and error)."""
    Task = store.Task
    Task.update(last_status=status, next_run_on=None, finished_on=at, active_key=None,
                waiting_key=None, updated_on=at, **values).where(Task.id == task_id).execute()


# -- adding tasks ------------------------------------------------------------------------------
# A task, and its first run when it is due, as plain SQL: peewee builds a node per value,
# which costs several times the inserts themselves. Rule 1 needs no statement of its own: a
# first run carries active_task_id, under its unique index. Every INSERT of a task or a run
# is one of these three, through the store's connection or the caller's (a task added inside
# the application's transaction).

def columns(model, names, param):
    """The fields of `names` in `model`, their column list and as many placeholders."""
    fields = [model._meta.fields[name] for name in names]
    return fields, ", ".join(f.column_name for f in fields), ", ".join([param] * len(fields))


def bind(backend, fields, values):
    """The values of `fields` as the driver binds them; SQLite's datetimes as the text
    peewee stores (Python 3.12 deprecates sqlite3's own adapter)."""
    values = [f.db_value(value) for f, value in zip(fields, values)]
    if backend != "sqlite":
        return values
    return [v.isoformat(" ") if isinstance(v, datetime) else v for v in values]


_INSERT_ROW = {}      # (backend, table, names) -> (the statement, its fields)


def insert_row(backend, model, names):
    """INSERT of one row of `model` with the fields `names`: (statement, fields). PostgreSQL
    returns the id (RETURNING), the others give the driver's lastrowid."""
    key = (backend, model._meta.table_name, names)
    if key not in _INSERT_ROW:
        fields, listed, marks = columns(model, names, "?" if backend == "sqlite" else "%s")
        _INSERT_ROW[key] = ("INSERT INTO %s (%s) VALUES (%s)%s" % (
            model._meta.table_name, listed, marks,
            " RETURNING id" if backend == "postgresql" else ""), fields)
    return _INSERT_ROW[key]


def insert_rows(backend, model, rows):
    """One INSERT of `rows` (dicts with the same keys) of `model`: (statement, parameters),
    RETURNING nothing (append " RETURNING id" where INSERT ... RETURNING works: the ids come
    in row order within one statement, though RETURNING's own order is not promised)."""
    fields = [model._meta.fields[name] for name in rows[0]]
    table, listed = model._meta.table_name, ", ".join(f.column_name for f in fields)
    if backend == "postgresql":
        # psycopg parses each of thousands of placeholders in Python; one JSON parameter
        # expanded by the server costs a fraction of that.
        return ("INSERT INTO %s (%s) SELECT %s FROM json_populate_recordset(NULL::%s, %%s)"
                % (table, listed, listed, table),
                [json.dumps([{f.column_name: f.db_value(row[f.name]) for f in fields}
                             for row in rows], default=str)])
    values = "(%s)" % ", ".join(["?" if backend == "sqlite" else "%s"] * len(fields))
    return ("INSERT INTO %s (%s) VALUES %s" % (table, listed, ", ".join([values] * len(rows))),
            [v for row in rows for v in bind(backend, fields, [row[f.name] for f in fields])])


_ADD = {}     # (task names, run names, notify) -> (the statement, task fields, run fields)


def insert_task_and_run(Task, Run, task_names, run_names, notify):
    """PostgreSQL: the task, its first run when due (`run_names`: its fields but the two
    that take the task's id) and the NOTIFY to other hosts, in one statement of
    data-modifying CTEs that returns the task id; (statement, task fields, run fields). An
    add is then one round trip, as Procrastinate's defer is, where BEGIN, two INSERTs, the
    NOTIFY and COMMIT were five. Every data-modifying CTE runs to completion, and the NOTIFY
    is read by the final SELECT, so all happen or none."""
    key = (task_names, run_names, notify)
    if key not in _ADD:
        task_fields, listed, marks = columns(Task, task_names, "%s")
        statement = "WITH task AS (INSERT INTO %s (%s) VALUES (%s) RETURNING id)" % (
            Task._meta.table_name, listed, marks)
        run_fields, listed, marks = columns(Run, run_names, "%s")
        if run_names:
            statement += ", run AS (INSERT INTO %s (%s, %s, %s) SELECT id, id, %s FROM task)" \
                % (Run._meta.table_name, Run.task_id.column_name,
                   Run.active_task_id.column_name, listed, marks)
        if notify:
            statement += ", news AS (%s AS sent)" % NOTIFY_SQL
        statement += " SELECT id FROM task" + (" CROSS JOIN news" if notify else "")
        _ADD[key] = (statement, task_fields, run_fields)
    return _ADD[key]


# The row of a queue first seen (its name is how runners serving ``default`` find it, and
# where pausing is stored). Race closed: two adds of a new queue's first tasks — the name is
# the key, and the second insert does nothing.
INSERT_QUEUE = {"sqlite": "INSERT OR IGNORE INTO task_queues (name, paused, updated_on) "
                          "VALUES (?, ?, ?)",
                "postgresql": "INSERT INTO task_queues (name, paused, updated_on) "
                              "VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                "mysql": "INSERT IGNORE INTO task_queues (name, paused, updated_on) "
                         "VALUES (%s, %s, %s)"}
