"""What every database's catalogue shares: the claim order, what a success writes, the check
that the claimer is alive, a guarded claim's guard, and the pieces of a flow-controlled claim
(token buckets, fairness between tenants). Each catalogue (postgresql.py, sqlite.py, mysql.py)
writes its statements with these; `runs/sql.py` binds and runs them.
"""

# -- the claim order (rule 2) ------------------------------------------------------------------

# Highest priority first, FIFO within a priority: the order of the task_runs_claim index, so
# a claim reads the next runs off the index without sorting the backlog. (column, descending)
CLAIM_ORDER = (("priority", True), ("scheduled_on", False), ("id", False))
CLAIM_COLUMNS = ", ".join(column for column, _ in CLAIM_ORDER)


def claim_order_sql(table=""):
    """CLAIM_ORDER as an ORDER BY list, its columns prefixed with `table` ("r.")."""
    return ", ".join(table + column + (" DESC" if desc else "") for column, desc in CLAIM_ORDER)


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


def assignments(columns, at="%s", results="%s", leave_out=()):
    """A SET list of `columns` with their values; refuses (at import) a list whose values
    would bind in another order than the statements pass them."""
    kept = [(column, value) for column, value in columns if column not in leave_out]
    names = tuple(value[1:-1] for _, value in kept if value.startswith("{"))
    if names not in (RUN_SUCCESS_VALUES, TASK_SUCCESS_VALUES):
        raise AssertionError("success values bound out of order: %s" % (names,))
    return ", ".join("%s = %s" % (column, value.format(at=at, results=results))
                     for column, value in kept)


# -- the claimer is alive (DESIGN rule 11) -----------------------------------------------------

# In every claim, on the runner row's primary key (one lookup, evaluated once per statement): a
# runner declared dead claims nothing more. Race closed: a runner cut off from the database
# (its network, a stop) whose row another host marked dead meanwhile — its claim, sent before
# the verdict and delivered after the heal, found runs; they ran again elsewhere as RunnerDied
# while it executed them. A claim whose snapshot still saw the row ``running`` as the row was
# marked is the one left: the fleet's pass ends that run (liveness.end_orphaned_runs), and the
# runner's heartbeat finds its row dead and its run taken away.
RUNNER_ALIVE = "EXISTS (SELECT 1 FROM task_runners WHERE id = %s AND status = 'running')"

# -- the claimer's slot is within its queue's limit (DESIGN rule 5) ---------------------------

# In a claim, after RUNNER_ALIVE: the runner's slot of the queue (task_runner_queues, taken
# at registration, unique per host) is within the limit in force — the queue's stored
# ``host_limit`` (``queue limit``), else the config's its runner registered under. Placeholders:
# (runner id, queue); uncorrelated, so evaluated once per statement (two primary-key or
# runner_id lookups), never per candidate run. A runner with no slot of the queue (one serving
# ``default`` claiming from a queue with no table) is not held by it.
# Only a claim that can be held carries it (`slot_check`): a limit is a whole number >= 1, so
# a runner with no slot of the queue or with its slot 1 is never above one, and its claims
# leave the check out (the runner knows its slots from its registration: `needs_slot_check`).
# A plain job of a runner serving ``default`` without a table, or the first runner of a queue,
# pays nothing for the feature (DESIGN: a feature a job does not use costs it nothing).
# Race closed: a limit lowered while runners claim. A runner learns of the change at its next
# look (up to check_interval later; a guarded claim claims on an older look still): until then
# its claims carry the slot check themselves, so a slot above the new limit claims nothing from
# the moment the change commits, on every host. A claim whose snapshot was taken before the
# change committed still sees the old limit: it is ordered before the change (its started_on is
# earlier), one of the runs in flight that a lowered limit lets finish. With the unique slots,
# at most `limit` runners of a host claim from the queue under any limit in force.
SLOT_WITHIN_LIMIT = (
    "NOT EXISTS (SELECT 1 FROM task_runner_queues AS rq JOIN task_queues AS lq "
    "ON lq.name = rq.queue WHERE rq.runner_id = %s AND rq.queue = %s "
    "AND rq.slot > COALESCE(lq.host_limit, rq.config_limit))")


def needs_slot_check(slot):
    """Whether a runner holding `slot` of a queue (None: no slot of it) could be above a
    limit of it: only from slot 2 on, as a limit is at least 1."""
    return slot is not None and slot > 1


def may_claim(runner, queue, slot_check=True):
    """RUNNER_ALIVE, and SLOT_WITHIN_LIMIT when `slot_check`, for the claim's WHERE clause,
    with the placeholders `runner` and `queue` (the driver's mark or a {name})."""
    alive = RUNNER_ALIVE % runner
    return "%s AND %s" % (alive, SLOT_WITHIN_LIMIT % (runner, queue)) if slot_check else alive

# A guarded claim (`claim(..., guarded=True)`) also checks what a runner's look reads before an
# ordinary claim: the queue is not paused, and no rate key has a limit (then the claim would
# be a flow claim). A runner the hub woke for a new run claims so at once, on the claim order
# of its last look, however old: what changed since makes the claim come back empty, and the
# runner looks, then claims again. Only on GUARDED_BACKENDS (mysql.claim says why not there).
GUARDED_BACKENDS = ("postgresql", "sqlite")
CLAIM_GUARD = ("NOT EXISTS (SELECT 1 FROM task_queues AS q WHERE q.name = task_runs.queue "
               "AND q.paused) AND NOT EXISTS (SELECT 1 FROM task_rate_buckets AS b "
               "WHERE b.kind = 'key')")


def guard(guarded):
    """The guard of a guarded claim, for its WHERE clause (nothing when not `guarded`)."""
    return "\n        AND " + CLAIM_GUARD if guarded else ""


# -- flow control in the claim (runs/flow.py) --------------------------------------------------
# A claim of a queue with a rate, of any queue while some key has a rate limit, or of a fair
# queue is one of these; any other claim is the plain one, unchanged. Named parameters:
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

def refill(backend, b=""):
    """A bucket's tokens now: refilled at `rate` since `stamp`, up to `burst`."""
    least, greatest = ("min", "max") if backend == "sqlite" else ("LEAST", "GREATEST")
    return "%s(%sburst, %stokens + %s(0, {e} - %sstamp) * %srate)" % (
        least, b, b, greatest, b, b)


def params(backend, text):
    """`text` with {name} placeholders written for `backend`'s driver (named parameters)."""
    mark = ":%s" if backend == "sqlite" else "%%(%s)s"
    return text.replace("%", "%%" if backend != "sqlite" else "%").format(
        **{n: mark % n for n in ("q", "runner", "at", "e", "key", "tenant")})


def key_filter(backend, column):
    """`column`'s run has no rate key, or one whose bucket holds a token now."""
    return ("({c} IS NULL OR {c} NOT IN (SELECT name FROM task_rate_buckets WHERE kind = 'key' "
            "AND %s < 1))" % refill(backend)).replace("{c}", column)


def fair_pick(backend, keys):
    """The queue's tenant served longest ago that has a scheduled run (claimable now)."""
    waiting = ("SELECT 1 FROM task_runs AS w WHERE w.status = 'scheduled' AND w.queue = "
               "f.queue AND w.tenant = f.tenant%s" % (
                   " AND " + key_filter(backend, "w.rate_key") if keys else ""))
    # MariaDB turns an EXISTS into a semi-join it materializes by scanning task_runs; a
    # scalar subquery stays a lookup of task_runs_fair per tenant.
    waiting = "(%s LIMIT 1) IS NOT NULL" % waiting if backend == "mysql" \
        else "EXISTS (%s)" % waiting
    return ("(SELECT f.tenant FROM task_tenants AS f WHERE f.queue = {q} AND %s "
            "ORDER BY f.served, f.tenant LIMIT 1)" % waiting)


def spend(backend, kind, name, b=""):
    """UPDATE of one bucket taking a token, when it has one."""
    tokens = refill(backend, b)
    return ("UPDATE task_rate_buckets%s SET tokens = %s - 1, stamp = %s(%sstamp, {e}), "
            "updated_on = {at} WHERE %skind = '%s' AND %sname = %s AND %s >= 1" % (
                " AS b" if b else "", tokens, "max" if backend == "sqlite" else "GREATEST", b, b,
                kind, b, name, tokens))


def served(backend, tenant):
    """UPDATE of the tenant just served: the queue's next sequence number."""
    highest = "SELECT coalesce(max(served), 0) + 1 FROM task_tenants WHERE queue = {q}"
    if backend == "mysql":          # MySQL reads the table it updates only through a copy
        highest = "SELECT m FROM (SELECT coalesce(max(served), 0) + 1 AS m FROM task_tenants " \
                  "WHERE queue = {q}) AS x"
    return "UPDATE task_tenants SET served = (%s) WHERE queue = {q} AND tenant = %s" % (
        highest, tenant)


# -- a batch's share of the backlog -----------------------------------------------------------

# The runners running now (every host's), and the scheduled runs of one queue, counted up to a
# cap off the claim index (an index-only read of at most the cap's entries, however long the
# backlog). {p}: the driver's placeholder.
BACKLOG_SQL = ("SELECT (SELECT count(*) FROM task_runners WHERE status = 'running' AND kind = "
           "'runner'), (SELECT count(*) FROM (SELECT 1 FROM task_runs WHERE status = "
           "'scheduled' AND queue = {p} LIMIT {p}) AS backlog)")
