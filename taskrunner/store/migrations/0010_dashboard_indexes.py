"""Indexes of the dashboard's read queries (summaries.py), so that each page answers in
well under 300 ms on a history of a million runs (bench/dashboard.py):

- ``task_runs (finished_on)``: runs finished per minute over the last hour, and the
  metrics' run totals brought up to date from the runs finished since the last scrape.
- ``task_queue (last_status, id)`` of the tasks that did not succeed (a partial index on
  SQLite and PostgreSQL: a run's success removes its task's entry instead of moving it):
  the counts of the statuses other than success, and their filters newest first.
- ``task_queue (handler, id)``: the handler filter newest first.
- ``task_queue (queued_on)``: the time range filter.
- failed tasks by handler and error code for the Failures page: a partial index of the
  failed tasks on SQLite and PostgreSQL (the query names its predicate as a literal),
  a full one led by the status on MySQL, which has no partial indexes.

The claim and the end of every run change ``task_queue.last_status`` (and, on the end,
``finished_on``): they now update these indexes too.
"""
from peewee import MySQLDatabase

INDEXES = (
    "CREATE INDEX task_runs_finished_on ON task_runs (finished_on)",
    "CREATE INDEX task_queue_handler ON task_queue (handler, id)",
    "CREATE INDEX task_queue_queued_on ON task_queue (queued_on)",
)
STATUS_PARTIAL = ("CREATE INDEX task_queue_status ON task_queue (last_status, id) "
                  "WHERE last_status <> 'success'")
STATUS_MYSQL = "CREATE INDEX task_queue_status ON task_queue (last_status, id)"
FAILED_PARTIAL = ("CREATE INDEX task_queue_failed ON task_queue "
                  "(handler, last_error_code, finished_on, id) "
                  "WHERE last_status IN ('error', 'timeout')")
FAILED_MYSQL = ("CREATE INDEX task_queue_failed ON task_queue "
                "(last_status, handler, last_error_code, finished_on)")


def up(migrator, db):
    for sql in INDEXES:
        db.execute_sql(sql)
    mysql = isinstance(db, MySQLDatabase)
    db.execute_sql(STATUS_MYSQL if mysql else STATUS_PARTIAL)
    db.execute_sql(FAILED_MYSQL if mysql else FAILED_PARTIAL)
