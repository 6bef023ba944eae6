"""PostgreSQL's statements of the run state machine (River's river_job.sql per dialect,
Procrastinate's named queries): each claim and end of a run in one statement of
data-modifying CTEs, a busy runner's success and its next claim in one (one round trip and
commit per job), each with the race it closes. `runs/sql.py` binds and runs them.

The names every catalogue has: `claim`, `SUCCESS`, `flow_claim`, `BACKLOG`, `INSERT_QUEUE`;
PostgreSQL's own (OWN): the success inside a transaction, the success with the next claim,
and many successes in one statement.
"""
from .shared import (BACKLOG_SQL, CLAIM_ORDER, RUN_SUCCESS, TASK_SUCCESS, assignments,
                     claim_order_sql, fair_pick, guard, key_filter, may_claim, params, served,
                     spend)

OWN = ("SUCCESS_IN_TRANSACTION", "SUCCESS_AND_CLAIM", "success_and_claim", "SUCCESSES")

# A claim locks the candidate run and its task row together, skipping the candidate when
# either is locked; it writes the run alone (a task's row says ``scheduled`` while its run
# runs: readers see ``running`` on the run, reads.records). Race closed: a task row another
# transaction holds (the application's SELECT ... FOR UPDATE, an admin's edit, a long
# migration) — a claim that took its run would end it by an UPDATE of that row, and the runner
# would wait there with other work due. FOR SHARE conflicts with every writer's lock (FOR
# [NO KEY] UPDATE) and is no new row version: a lock bit in the row, not a copy of it.
_SKIP_LOCKED = "FOR UPDATE OF task_runs SKIP LOCKED FOR SHARE OF t SKIP LOCKED"
# What a runner reads of the task of each run `claimed` returned: the columns `next` read
# of the task row it locked (_TASK_COLUMNS), not a second lookup of that row per run. The
# row is locked FOR SHARE from `next` on, so no writer changed it since; and `next` read its
# latest version (a row updated as the claim waited is re-read under the lock), where a new
# join would read the statement's snapshot.
_TASK_COLUMNS = ("handler", "data", "max_runtime", "periodic_task_id")
_NEXT_TASK = "".join(", t.%s AS task_%s" % (c, c) for c in _TASK_COLUMNS)
_CLAIMED_TASK = """
    claimed_task AS (
        SELECT claimed.id, claimed.task_id, claimed.attempt, %s%%s
        FROM claimed JOIN next ON next.id = claimed.id)""" % ", ".join(
    "next.task_%s" % c for c in _TASK_COLUMNS)


def claim(limit, guarded=False, slot_check=True):
    """The claim of up to `limit` runs of one queue. Parameters: (queue, runner_id), then
    (runner_id, queue) with `slot_check` (shared.SLOT_WITHIN_LIMIT), then (runner_id, at,
    at)."""
    return "WITH" + _claim_ctes(limit, guarded, slot_check) + " SELECT * FROM claimed_task"


def _claim_ctes(limit, guarded=False, slot_check=True):
    # The claim order comes back only where in_claim_order has rows to sort: one run needs
    # none of it (3 columns fewer to copy, send and parse per job).
    order = limit > 1
    return """
    next AS (
        SELECT task_runs.id%s FROM task_runs JOIN task_queue AS t ON t.id = task_runs.task_id
        WHERE task_runs.status = 'scheduled' AND task_runs.queue = %%s
            AND %s%s
        ORDER BY %s LIMIT %d %s),
    claimed AS (
        UPDATE task_runs AS r SET status = 'running', runner_id = %%s, started_on = %%s,
            updated_on = %%s
        FROM next WHERE r.id = next.id RETURNING r.id, r.task_id, r.attempt%s),%s""" % (
        _NEXT_TASK, may_claim("%s", "%s", slot_check), guard(guarded),
        claim_order_sql("task_runs."), int(limit), _SKIP_LOCKED,
        "".join(", r." + c for c, _ in CLAIM_ORDER if c != "id") if order else "",
        _CLAIMED_TASK % ("".join(", claimed." + c for c, _ in CLAIM_ORDER) if order else ""))


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
_GUARD_CTE = """
    guard AS (
        SELECT dependents FROM task_queue WHERE id = %s FOR KEY SHARE),"""


def _success_ctes(guarded):
    return (_GUARD_CTE if guarded else "") + """
    ended AS (
        UPDATE task_runs SET %s
        WHERE id = %%s AND status = 'running' AND runner_id = %%s%s RETURNING task_id),
    ended_task AS (
        UPDATE task_queue AS t SET %s
        FROM ended WHERE t.id = ended.task_id RETURNING t.id, t.dependents)""" % (
        assignments(RUN_SUCCESS),
        " AND (SELECT dependents FROM guard) = 0" if guarded else "",
        assignments(TASK_SUCCESS))


# Parameters: the guard's (task_id); the success's (at, at, results, run_id, runner_id, at, at);
# SUCCESS_AND_CLAIM's then the claim's (queue, runner_id, [runner_id, queue,] runner_id, at,
# at). Returns (runs ended, the task's dependents).
SUCCESS = ("WITH" + _success_ctes(True) + " SELECT (SELECT count(*) FROM ended_task), "
              "(SELECT dependents FROM guard)")
# Inside a transaction: no guard; the caller releases the dependents after it (RETURNING
# shows the latest count, the row being locked by the UPDATE).
SUCCESS_IN_TRANSACTION = ("WITH" + _success_ctes(False)
                             + " SELECT count(*), max(dependents) FROM ended_task")


def success_and_claim(slot_check=True):
    """The success and the next claim in one statement. Every data-modifying CTE runs to
    completion whether or not the final SELECT reads it: the success happens even when the
    claim finds nothing, and the reverse."""
    return ("WITH" + _success_ctes(True) + "," + _claim_ctes(1, slot_check=slot_check) + """
    SELECT (SELECT count(*) FROM ended_task), (SELECT dependents FROM guard), c.*
    FROM (VALUES (1)) AS one LEFT JOIN claimed_task AS c ON true""")


# With the slot check (a claim that can be held), and without (`success_and_claim(False)`).
SUCCESS_AND_CLAIM = success_and_claim()


# Successes of one runner, each with its own end time and results, in one statement, inside
# the caller's transaction: the ids of the runs ended, and their tasks' dependents. Each row
# comes from the task's UPDATE, whose RETURNING names the run it joined: a join of the two
# CTEs after them was a nested loop (a CTE's rows are not estimated), B x B rows compared for
# a batch of B (66k of 300k server instructions per job at B = 100, bench/server_phases.py).
# One run per task ends here (rule 1: one non-final run per task), so each row of `ended`
# has its task's row.
SUCCESSES = """
    WITH done AS (
        SELECT * FROM unnest(%%s::bigint[], %%s::timestamp[], %%s::text[])
            AS d(id, finished_on, results)),
    ended AS (
        UPDATE task_runs AS r SET %s
        FROM done WHERE r.id = done.id AND r.status = 'running' AND r.runner_id = %%s
        RETURNING r.id, r.task_id, done.finished_on),
    ended_task AS (
        UPDATE task_queue AS t SET %s
        FROM ended WHERE t.id = ended.task_id RETURNING ended.id, t.id, t.dependents)
    SELECT * FROM ended_task""" % (
    assignments(RUN_SUCCESS, "done.finished_on", "done.results"),
    assignments(TASK_SUCCESS, "ended.finished_on"))


def flow_claim(rate, keys, fair, slot_check=True):
    """The claim of one run of a queue under flow control, in one statement (shared.py's
    races closed)."""
    ctes = []
    if fair:
        ctes.append("pick AS %s" % fair_pick("postgresql", keys))
    ctes.append("""next AS (
        SELECT task_runs.id, task_runs.rate_key, task_runs.tenant%s
        FROM task_runs JOIN task_queue AS t ON t.id = task_runs.task_id
        WHERE task_runs.status = 'scheduled' AND task_runs.queue = {q}
            %s%s AND %s
        ORDER BY %s LIMIT 1 %s)""" % (
        _NEXT_TASK, "AND task_runs.tenant = (SELECT tenant FROM pick) " if fair else "",
        "AND " + key_filter("postgresql", "task_runs.rate_key") if keys else "",
        may_claim("{runner}", "{q}", slot_check), claim_order_sql("task_runs."), _SKIP_LOCKED))
    allowed = ""
    if rate:
        ctes.append("queue_token AS (%s AND EXISTS (SELECT 1 FROM next) RETURNING 1)"
                    % spend("postgresql", "queue", "{q}"))
        allowed += " AND EXISTS (SELECT 1 FROM queue_token)"
    if keys:
        ctes.append("key_token AS (%s RETURNING b.name)" % spend(
            "postgresql", "key", "(SELECT rate_key FROM next)", "b."))
        allowed += (" AND (next.rate_key IS NULL OR EXISTS (SELECT 1 FROM key_token) OR NOT "
                    "EXISTS (SELECT 1 FROM task_rate_buckets AS k WHERE k.kind = 'key' AND "
                    "k.name = next.rate_key))")
    ctes.append("""claimed AS (
        UPDATE task_runs AS r SET status = 'running', runner_id = {runner}, started_on = {at},
            updated_on = {at}
        FROM next WHERE r.id = next.id%s RETURNING r.id, r.task_id, r.attempt, r.tenant)"""
                % allowed)
    ctes.append(_CLAIMED_TASK.strip() % "")
    if fair:
        ctes.append("served AS (%s AND EXISTS (SELECT 1 FROM claimed) RETURNING 1)"
                    % served("postgresql", "(SELECT tenant FROM claimed)"))
    return params("postgresql", "WITH " + ",\n    ".join(ctes) + " SELECT * FROM claimed_task")



BACKLOG = BACKLOG_SQL.format(p="%s")

# The row of a queue first seen (its name is how runners serving ``default`` find it, and
# where pausing is stored). Race closed: two adds of a new queue's first tasks — the name is
# the key, and the second insert does nothing.
INSERT_QUEUE = ("INSERT INTO task_queues (name, paused, updated_on) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING")
