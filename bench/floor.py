"""The floor: the least a durable database queue must do per run, in raw SQL on
taskrunner's own tables (same rows, same indexes, same durability), so taskrunner's
throughput can be read as a fraction of it: what is left is the library's own cost.

Per run, one transaction, as a busy taskrunner runner does (the first claim has its own):
  finish — mark the previous run success (conditional on it still being this runner's
           running run, active_task_id cleared) and update its task (last_status,
           finished_on, next_run_on, active_key, runs_failed);
  claim  — take the next scheduled run of the queue (in the claim index's order)
           exclusively (SQLite: BEGIN IMMEDIATE; PostgreSQL
           and MySQL: FOR UPDATE SKIP LOCKED), mark it running (runner, started_on) and
           read its task's handler and data (the task row is written when the run ends:
           readers see `running` on the run, as taskrunner's claim since issue 41).
Each database gets its cheapest form: on PostgreSQL the whole cycle is one statement of
data-modifying CTEs (one round trip); SQLite uses UPDATE ... RETURNING; MySQL, which has
no RETURNING, a locking SELECT joined to the task, then the updates.
SQLite runs in WAL with synchronous=FULL (taskrunner's default); PostgreSQL and MySQL with
their default durable commits.

Run as ``python -m bench.floor URL RUNNER_ID [SQLITE_SYNCHRONOUS]``: one worker, exits when
no run is left.
"""
import json
import sys
from datetime import datetime, timezone

from bench.common import backend_of, connect

NEXT = ("SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = 'default' "
        "ORDER BY priority DESC, scheduled_on, id LIMIT 1")
RUN_STARTED = "UPDATE task_runs SET status = 'running', runner_id = {p}, started_on = {p}, updated_on = {p}"
TASK_READ = "SELECT handler, data FROM task_queue"
RUN_DONE = ("UPDATE task_runs SET status = 'success', finished_on = {p}, updated_on = {p}, "
            "percent_completed = 100, active_task_id = NULL "
            "WHERE id = {p} AND status = 'running' AND runner_id = {p}")
TASK_DONE = ("UPDATE task_queue SET last_status = 'success', finished_on = {p}, updated_on = {p}, "
             "next_run_on = NULL, active_key = NULL, runs_failed = 0 WHERE id = {p}")

SQLITE_CLAIM = (RUN_STARTED + " WHERE id = (" + NEXT + ") RETURNING id, task_id",
                TASK_READ + " WHERE id = {p}")
MYSQL_CLAIM = ("SELECT r.id, r.task_id, t.handler, t.data FROM task_runs r "
               "JOIN task_queue t ON t.id = r.task_id "
               "WHERE r.status = 'scheduled' AND r.queue = 'default' "
               "ORDER BY r.priority DESC, r.scheduled_on, r.id LIMIT 1 FOR UPDATE SKIP LOCKED",
               RUN_STARTED + " WHERE id = {p}")
# PostgreSQL: finish (when there is a previous run) and claim in one statement.
PG_CYCLE = """
WITH done AS ({run_done} RETURNING task_id),
     task_done AS ({task_done_from} FROM done WHERE task_queue.id = done.task_id),
     pick AS ({next} FOR UPDATE SKIP LOCKED),
     started AS ({run_started} FROM pick WHERE task_runs.id = pick.id RETURNING task_runs.id, task_id)
SELECT started.id, started.task_id, handler, data
FROM started JOIN task_queue ON task_queue.id = started.task_id""".format(
    run_done=RUN_DONE.format(p="%s"), task_done_from=TASK_DONE.format(p="%s").split(" WHERE")[0],
    next=NEXT, run_started=RUN_STARTED.format(p="%s"))


def now(backend):
    value = datetime.now(timezone.utc).replace(tzinfo=None)
    return str(value) if backend == "sqlite" else value


def work(url, runner_id, synchronous="full"):
    backend = backend_of(url)
    conn = connect(url, autocommit=backend == "postgresql")
    p = "?" if backend == "sqlite" else "%s"
    if backend == "sqlite":
        conn.isolation_level = None            # explicit BEGIN IMMEDIATE below
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA synchronous=%s" % synchronous)
        conn.execute("PRAGMA busy_timeout=30000")
    run_done, task_done = RUN_DONE.format(p=p), TASK_DONE.format(p=p)
    cur = conn.cursor()

    def transaction(step):
        """Run step() in a write transaction, again after a deadlock (InnoDB can pick
        one between two claims), as taskrunner's retry_transaction does."""
        for attempt in range(20):
            try:
                if backend == "sqlite":
                    cur.execute("BEGIN IMMEDIATE")
                result = step()
                if backend == "sqlite":
                    cur.execute("COMMIT")
                elif backend == "mysql":
                    conn.commit()
                return result
            except Exception as exc:
                if "deadlock" not in str(exc).lower() or attempt == 19:
                    raise
                conn.rollback()

    def finish(previous, t):
        if previous is not None:
            cur.execute(run_done, (t, t, previous[0], runner_id))
            if cur.rowcount == 1:
                cur.execute(task_done, (t, t, previous[1]))

    def cycle(previous):
        """Finish `previous` (run id, task id) if any, claim the next: (run id, task id,
        handler, data) or None."""
        t = now(backend)
        if backend == "postgresql":
            prev = previous or (None, None)
            cur.execute(PG_CYCLE, (t, t, prev[0], runner_id, t, t, runner_id, t, t))
            return cur.fetchone()
        finish(previous, t)
        if backend == "sqlite":
            cur.execute(SQLITE_CLAIM[0].format(p=p), (runner_id, t, t))
            run = cur.fetchone()
            if run is None:
                return None
            cur.execute(SQLITE_CLAIM[1].format(p=p), (run[1],))
            return run + cur.fetchone()
        cur.execute(MYSQL_CLAIM[0])
        row = cur.fetchone()
        if row is not None:
            cur.execute(MYSQL_CLAIM[1].format(p=p), (runner_id, t, t, row[0]))
        return row

    done = 0
    row = transaction(lambda: cycle(None))
    while row is not None:
        run_id, task_id, handler, data = row
        json.loads(data)                       # the no-op "handler": decode its data
        row = transaction(lambda: cycle((run_id, task_id)))
        done += 1
    conn.close()
    return done


if __name__ == "__main__":
    work(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
