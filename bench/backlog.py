"""Queueing many no-op tasks fast, with set-based SQL (INSERT … SELECT over a number
series) that stores exactly the rows `TaskQueue.add_tasks()` stores: task_queue rows with
the defaults of a config without a file, and their scheduled task_runs rows.
`check_backlog_rows()` proves it on the database at hand (one task each way, compared
column by column), so the shortcut cannot drift from the API unnoticed.
"""
import json
import time

from bench import common
from bench.common import add_noop_tasks, query, utcnow

TASK_COLUMNS = ("queued_on", "queued_by", "scheduled_on", "handler", "data", "priority",
                "last_status", "max_retries", "runs_failed", "run_count", "run_timeout",
                "max_runtime", "retry_backoff", "unique_key", "active_key", "periodic_task_id",
                "next_run_on", "updated_on", "finished_on", "last_error_code",
                "last_error_message")
RUN_COLUMNS = ("task_id", "created_on", "started_on", "updated_on", "finished_on",
               "percent_completed", "results", "status", "error_code", "error_message",
               "runner_id", "attempt", "active_task_id", "priority", "scheduled_on")
# The API sets these from the clock (or the ids): not compared.
TIME_COLUMNS = {"queued_on", "scheduled_on", "updated_on", "created_on", "task_id", "active_task_id"}


def _task_values(placeholder):
    from taskrunner.config import Config
    defaults = Config.from_dict({}).task
    return {"queued_on": placeholder, "queued_by": "NULL", "scheduled_on": placeholder,
            "handler": placeholder, "data": placeholder, "priority": "0",
            "last_status": "'scheduled'", "max_retries": str(defaults.max_retries),
            "runs_failed": "0", "run_count": "1", "run_timeout": repr(float(defaults.run_timeout)),
            "max_runtime": "NULL", "retry_backoff": "NULL", "unique_key": "NULL",
            "active_key": "NULL", "periodic_task_id": "NULL", "next_run_on": "NULL",
            "updated_on": placeholder, "finished_on": "NULL", "last_error_code": "NULL",
            "last_error_message": "NULL"}


RUN_VALUES = {"task_id": "id", "created_on": "queued_on", "started_on": "NULL",
              "updated_on": "queued_on", "finished_on": "NULL", "percent_completed": "0",
              "results": "NULL", "status": "'scheduled'", "error_code": "NULL",
              "error_message": "NULL", "runner_id": "NULL", "attempt": "1",
              "active_task_id": "id", "priority": "priority", "scheduled_on": "scheduled_on"}


def add_backlog(url, count, handler=common.NOOP, data=None):
    """Queue `count` due tasks of `handler` with `data` (default: no-ops, data null) in one
    transaction; returns the seconds it took. On PostgreSQL the tables are ANALYZEd
    afterwards, as autovacuum would."""
    backend = common.backend_of(url)
    now = utcnow()
    now_param = str(now) if backend == "sqlite" else now
    if backend == "postgresql":
        prefix, source = "", "generate_series(1, %d) AS seq(x)" % count
    else:
        prefix = ("WITH RECURSIVE seq(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM seq WHERE x < %d) "
                  % count)
        source = "seq"
    task_values = _task_values(common.placeholder(url))
    conn = common.connect(url)
    start = time.perf_counter()
    try:
        cur = conn.cursor()
        if backend == "mysql":
            cur.execute("SELECT version()")
            variable = "max_recursive_iterations" if "mariadb" in cur.fetchone()[0].lower() \
                else "cte_max_recursion_depth"
            cur.execute("SET SESSION %s = %d" % (variable, count + 1))
        cur.execute("SELECT coalesce(max(id), 0) FROM task_queue")
        first = cur.fetchone()[0]
        cur.execute("INSERT INTO task_queue (%s) %sSELECT %s FROM %s"
                    % (", ".join(TASK_COLUMNS), prefix,
                       ", ".join(task_values[c] for c in TASK_COLUMNS), source),
                    (now_param, now_param, handler, json.dumps(data, separators=(",", ":")), now_param))
        cur.execute("INSERT INTO task_runs (%s) SELECT %s FROM task_queue WHERE id > %d"
                    % (", ".join(RUN_COLUMNS), ", ".join(RUN_VALUES[c] for c in RUN_COLUMNS), first))
        conn.commit()
        if backend == "postgresql":
            conn.autocommit = True
            cur.execute("ANALYZE task_queue")
            cur.execute("ANALYZE task_runs")
    finally:
        conn.close()
    return time.perf_counter() - start


def check_backlog_rows(url, handler=common.NOOP, data=None):
    """Raise AssertionError unless a task queued by add_backlog() has the same task and
    run rows as one queued by add_tasks() (ids and clock times aside). Adds 2 tasks."""
    api_id = add_noop_tasks(url, 1, handler=handler, data=data)[0]
    add_backlog(url, 1, handler, data)
    sql_id = query(url, "SELECT max(id) FROM task_queue")[0][0]
    task_columns = [c for c in TASK_COLUMNS if c not in TIME_COLUMNS]
    run_columns = [c for c in RUN_COLUMNS if c not in TIME_COLUMNS]
    rows = {}
    for task_id in (api_id, sql_id):
        rows[task_id] = (
            query(url, "SELECT %s FROM task_queue WHERE id = ?" % ", ".join(task_columns), (task_id,)),
            query(url, "SELECT %s FROM task_runs WHERE task_id = ?" % ", ".join(run_columns), (task_id,)))
    if [list(map(tuple, r)) for r in rows[api_id]] != [list(map(tuple, r)) for r in rows[sql_id]]:
        raise AssertionError("add_backlog() rows differ from add_tasks(): %r vs %r"
                             % (rows[api_id], rows[sql_id]))


def queue_backlog(url, count, handler=common.NOOP, data=None):
    """`count` tasks in a fresh database: checked against the API, then set-based SQL."""
    common.make_queue(url).close()            # the schema
    check_backlog_rows(url, handler, data)
    return add_backlog(url, count - 2, handler, data)
