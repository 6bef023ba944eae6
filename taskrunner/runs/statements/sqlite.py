"""SQLite's statements of the run state machine (River's river_job.sql per dialect,
Procrastinate's named queries): UPDATE ... RETURNING under the write lock a transaction takes
up front (BEGIN IMMEDIATE), so a select and its update are one step; each with the race it
closes. `runs/sql.py` binds and runs them.

The names every catalogue has: `claim`, `SUCCESS`, `flow_claim`, `BACKLOG`, `INSERT_QUEUE`;
SQLite's own (OWN): the read of a claimed run's task (the others read it in their claim), and
the start of the run a claim of one read (MySQL's START starts many).
"""
from .shared import (BACKLOG_SQL, CLAIM_COLUMNS, RUN_SUCCESS, SQLITE_APART, TASK_SUCCESS,
                     assignments, claim_order_sql, fair_pick, guard, key_filter, may_claim,
                     params, refill, served, spend)

OWN = ("CLAIMED_TASK", "START")

# What a runner reads of a claimed run's task (a read: SQLite has no row to lock).
CLAIMED_TASK = "SELECT handler, data, max_runtime, periodic_task_id FROM task_queue WHERE id = ?"


# The start of the one run a claim of one picked (its parameters: runner_id, at, at, run id).
START = "UPDATE task_runs SET status = 'running', runner_id = ?, started_on = ?, updated_on = ? " \
    "WHERE id = ?"


def claim(limit, guarded=False, slot_check=True):
    """A claim of many (`limit` > 1): (the claim of up to `limit` runs of one queue, the read
    of one claimed run's task). Parameters: (runner_id, at, at, queue, runner_id), then
    (runner_id, queue) with `slot_check` (shared.SLOT_WITHIN_LIMIT); then (task id) per run.
    A claim of one, a busy runner's every claim: (the read of the next run and its task,
    START). Parameters: (queue, runner_id), then (runner_id, queue) with `slot_check`; then
    START's. Its RETURNING would build an ephemeral table of the row first (about 30k
    instructions per claim): under the write lock the transaction took up front (BEGIN
    IMMEDIATE), the read and the UPDATE of the row it found are one step as well. The claim
    writes the run alone: a task's row says ``scheduled`` while its run runs, and readers see
    ``running`` on the run (reads.records)."""
    if limit == 1:
        return ("""
    SELECT task_runs.id, task_runs.task_id, task_runs.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id
    FROM task_runs JOIN task_queue AS t ON t.id = task_runs.task_id
    WHERE task_runs.id = (SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = ?
                          ORDER BY %s LIMIT 1)
        AND %s%s""" % (claim_order_sql(), may_claim("?", "?", slot_check), guard(guarded)),
                START)
    return ("""
    UPDATE task_runs SET status = 'running', runner_id = ?, started_on = ?, updated_on = ?
    WHERE id IN (SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = ?
                 ORDER BY %s LIMIT %d)
        AND %s%s
    RETURNING id, task_id, attempt, %s""" % (claim_order_sql(), int(limit),
                                             may_claim("?", "?", slot_check), guard(guarded),
                                             CLAIM_COLUMNS),
            CLAIMED_TASK)


def _apart(columns):
    """The columns of SQLITE_APART in `columns`, and the expression RETURNING shows (NULL
    when all are)."""
    apart = [column for column, _ in columns if column in SQLITE_APART]
    return apart, apart[0] if len(apart) == 1 else "coalesce(%s)" % ", ".join(apart)


# The success of a runner's run and its task: (the run's UPDATE when its SQLITE_APART columns
# are NULL, as for most runs; the run's UPDATE clearing them; the task's UPDATE when it has no
# dependents and its SQLITE_APART columns are NULL; the task's UPDATE returning its
# SQLITE_APART values and dependents; their clearing). The common case is two UPDATEs without
# RETURNING, told apart by their changes(): an UPDATE ... RETURNING builds an ephemeral table
# of its rows first, as much work as the UPDATE itself here (MySQL's SUCCESS reads dependents
# the same way). Race closed: rule 4, as every end.
_RUN_APART = _apart(RUN_SUCCESS)[0]
_TASK_APART, _TASK_SHOWS = _apart(TASK_SUCCESS)
_RUN_END = "UPDATE task_runs SET %s WHERE id = ? AND status = 'running' AND runner_id = ?"
_TASK_END = "UPDATE task_queue SET %s WHERE id = ?"
SUCCESS = (
    _RUN_END % assignments(RUN_SUCCESS, "?", "?", SQLITE_APART) + "".join(
        " AND %s IS NULL" % c for c in _RUN_APART),
    _RUN_END % assignments(RUN_SUCCESS, "?", "?"),
    _TASK_END % assignments(TASK_SUCCESS, "?", leave_out=SQLITE_APART) + " AND dependents = 0"
    + "".join(" AND %s IS NULL" % c for c in _TASK_APART),
    _TASK_END % assignments(TASK_SUCCESS, "?", leave_out=SQLITE_APART) + " RETURNING %s, "
    "dependents" % _TASK_SHOWS,
    "UPDATE task_queue SET %s WHERE id = ?" % ", ".join(c + " = NULL" for c in _TASK_APART))


def flow_claim(rate, keys, fair, slot_check=True):
    """(the claim of the run, the spends that follow it): under SQLite's write lock the
    candidate's buckets cannot change between the two."""
    run = """
    UPDATE task_runs SET status = 'running', runner_id = {runner}, started_on = {at},
        updated_on = {at}
    WHERE id = (SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = {q}
                 %s%s ORDER BY %s LIMIT 1)
        AND %s%s
    RETURNING id, task_id, attempt, rate_key, tenant""" % (
        "AND tenant = %s " % fair_pick("sqlite", keys) if fair else "",
        "AND " + key_filter("sqlite", "rate_key") if keys else "",
        claim_order_sql(), may_claim("{runner}", "{q}", slot_check),
        " AND EXISTS (SELECT 1 FROM task_rate_buckets WHERE kind = 'queue' AND name = {q} "
        "AND %s >= 1)" % refill("sqlite") if rate else "")
    return tuple(params("sqlite", text) for text in (
        run, spend("sqlite", "queue", "{q}"), spend("sqlite", "key", "{key}"),
        served("sqlite", "{tenant}")))


BACKLOG = BACKLOG_SQL.format(p="?")

# The row of a queue first seen (postgresql.INSERT_QUEUE's race).
INSERT_QUEUE = "INSERT OR IGNORE INTO task_queues (name, paused, updated_on) VALUES (?, ?, ?)"
