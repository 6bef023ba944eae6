"""The floor: the least a durable database queue must do per run, in raw SQL on
taskrunner's own tables (same rows, same indexes, same durability), so taskrunner's
throughput can be read as a fraction of it.

Per run, in two transactions like taskrunner:
  claim  — select the next scheduled run exclusively (SQLite: BEGIN IMMEDIATE; PostgreSQL
           and MySQL: FOR UPDATE SKIP LOCKED) with its task's handler and data, mark it
           running (runner, started_on);
  finish — mark the run success (conditional on it still being this runner's running run,
           active_task_id cleared) and update its task (last_status, finished_on,
           next_run_on, active_key, runs_failed).
SQLite runs in WAL with synchronous=FULL (taskrunner's default); PostgreSQL and MySQL with
their default durable commits, autocommit off.

Run as ``python -m bench.floor URL RUNNER_ID [SQLITE_SYNCHRONOUS]``: one worker, exits when
no run is left.
"""
import json
import sys
from datetime import datetime, timezone

from bench.common import backend_of, connect

CLAIM = ("SELECT r.id, r.task_id, t.handler, t.data FROM task_runs r "
         "JOIN task_queue t ON t.id = r.task_id WHERE r.status = 'scheduled' "
         "ORDER BY r.priority DESC, r.scheduled_on, r.id LIMIT 1")
LOCK = {"sqlite": "", "postgresql": " FOR UPDATE OF r SKIP LOCKED", "mysql": " FOR UPDATE SKIP LOCKED"}
MARK_RUNNING = ("UPDATE task_runs SET status = 'running', runner_id = ?, started_on = ?, "
                "updated_on = ? WHERE id = ?")
MARK_SUCCESS = ("UPDATE task_runs SET status = 'success', finished_on = ?, updated_on = ?, "
                "percent_completed = 100, active_task_id = NULL "
                "WHERE id = ? AND status = 'running' AND runner_id = ?")
UPDATE_TASK = ("UPDATE task_queue SET last_status = 'success', finished_on = ?, updated_on = ?, "
               "next_run_on = NULL, active_key = NULL, runs_failed = 0 WHERE id = ?")


def now(backend):
    value = datetime.now(timezone.utc).replace(tzinfo=None)
    return str(value) if backend == "sqlite" else value


def work(url, runner_id, synchronous="full"):
    backend = backend_of(url)
    conn = connect(url)
    if backend == "sqlite":
        conn.isolation_level = None            # explicit BEGIN IMMEDIATE below
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA synchronous=%s" % synchronous)
        conn.execute("PRAGMA busy_timeout=30000")
    p = "?" if backend == "sqlite" else "%s"
    claim_sql = CLAIM + LOCK[backend]
    running_sql, success_sql, task_sql = (s.replace("?", p) for s in (MARK_RUNNING, MARK_SUCCESS, UPDATE_TASK))
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
                else:
                    conn.commit()
                return result
            except Exception as exc:
                if "deadlock" not in str(exc).lower() or attempt == 19:
                    raise
                conn.rollback()

    def claim():
        cur.execute(claim_sql)
        row = cur.fetchone()
        if row is not None:
            t = now(backend)
            cur.execute(running_sql, (runner_id, t, t, row[0]))
        return row

    def finish(run_id, task_id):
        t = now(backend)
        cur.execute(success_sql, (t, t, run_id, runner_id))
        if cur.rowcount == 1:
            cur.execute(task_sql, (t, t, task_id))

    done = 0
    while True:
        row = transaction(claim)
        if row is None:
            break
        run_id, task_id, handler, data = row
        json.loads(data)                       # the no-op "handler": decode its data
        transaction(lambda: finish(run_id, task_id))
        done += 1
    conn.close()
    return done


if __name__ == "__main__":
    work(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
