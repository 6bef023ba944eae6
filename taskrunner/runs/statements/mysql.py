"""MySQL's and MariaDB's statements of the run state machine (River's river_job.sql per
dialect, Procrastinate's named queries): a claim is a locking read of the runs joined to their
tasks, then their UPDATEs by primary key; each with the race it closes. `runs/sql.py` binds and
runs them.

The names every catalogue has: `claim`, `SUCCESS`, `flow_claim`, `BACKLOG`, `INSERT_QUEUE`;
MySQL's own (OWN): the UPDATE that starts the runs a locking read claimed.
"""
from .shared import (BACKLOG_SQL, RUN_SUCCESS, TASK_SUCCESS, assignments, claim_order_sql,
                     fair_pick, key_filter, may_claim, params, refill, served, spend)

OWN = ("START",)


# The candidates and their tasks locked and read at once (InnoDB locks the joined task rows
# too: a task row another transaction holds is skipped, as the run's end will write it), then
# the runs marked.
def claim(limit, guarded=False, slot_check=True):
    """The locking read of up to `limit` runs of one queue and their tasks; START marks the
    runs (the task rows are locked, not written: a task's row says ``scheduled`` while its
    run runs, and readers see ``running`` on the run, reads.records). Parameters: (queue,
    runner_id), then (runner_id, queue) with `slot_check` (shared.SLOT_WITHIN_LIMIT). Never
    `guarded`: the locking read would lock (or skip) the rows the guard reads too."""
    if guarded:
        raise ValueError("no guarded claim on mysql")
    return """
    SELECT r.id, r.task_id, r.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id
    FROM task_runs AS r JOIN task_queue AS t ON t.id = r.task_id
    WHERE r.status = 'scheduled' AND r.queue = %%s
        AND %s
    ORDER BY %s LIMIT %d
    FOR UPDATE SKIP LOCKED""" % (may_claim("%s", "%s", slot_check), claim_order_sql("r."),
                                 int(limit))


# The locking read skips a run whose run or task row is locked. The UPDATE that follows names
# the primary key (FORCE INDEX): on a small table InnoDB would rather scan it, locking every
# row it reads, and wait for a row another transaction holds (a task row the application
# locked, the run another claimer took) — the wait the SKIP LOCKED was there to avoid.
START = ("UPDATE task_runs FORCE INDEX (PRIMARY) SET status = 'running', runner_id = %%s, "
         "started_on = %%s, updated_on = %%s WHERE id IN (%s)")
# The whole SET, unlike SQLite's: InnoDB leaves the index entries of a column set to the value
# it had. The task's UPDATE matches a task without dependents only (an UPDATE reads the
# latest row, under its lock): when it changes nothing, the task has some, and the third
# statement ends it before they are released (graph.release).
SUCCESS = (
    "UPDATE task_runs SET %s WHERE id = %%s AND status = 'running' AND runner_id = %%s"
    % assignments(RUN_SUCCESS),
    "UPDATE task_queue SET %s WHERE id = %%s AND dependents = 0" % assignments(TASK_SUCCESS),
    "UPDATE task_queue SET %s WHERE id = %%s" % assignments(TASK_SUCCESS))



def flow_claim(rate, keys, fair, slot_check=True):
    """(the queue bucket's check, locking its row; the locking read of the run; the spends)."""
    run = """
    SELECT r.id, r.task_id, r.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id,
        r.rate_key, r.tenant
    FROM task_runs AS r JOIN task_queue AS t ON t.id = r.task_id
    WHERE r.status = 'scheduled' AND r.queue = {q}
        %s%s AND %s
    ORDER BY %s LIMIT 1
    FOR UPDATE SKIP LOCKED""" % (
        "AND r.tenant = %s " % fair_pick("mysql", keys) if fair else "",
        "AND " + key_filter("mysql", "r.rate_key") if keys else "",
        may_claim("{runner}", "{q}", slot_check), claim_order_sql("r."))
    check = ("SELECT %s >= 1 FROM task_rate_buckets WHERE kind = 'queue' AND name = {q} "
             "FOR UPDATE" % refill("mysql"))
    return tuple(params("mysql", text) for text in (
        check, run, spend("mysql", "queue", "{q}"), spend("mysql", "key", "{key}"),
        served("mysql", "{tenant}")))


BACKLOG = BACKLOG_SQL.format(p="%s")

# The row of a queue first seen (postgresql.INSERT_QUEUE's race).
INSERT_QUEUE = "INSERT IGNORE INTO task_queues (name, paused, updated_on) VALUES (%s, %s, %s)"
