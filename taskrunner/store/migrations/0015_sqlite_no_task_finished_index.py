"""SQLite: no index on ``task_queue.finished_on``.

Why: every run's end wrote an entry at the newest end of that index, a WAL page (and now
and then a split) in each job's commit, which SQLite writes and syncs before the runner
goes on. No query read it: rotation, the only one that filters on the column by range,
takes the oldest tasks in id order (``ORDER BY id LIMIT batch``), which SQLite plans as a
scan by id that stops at the batch, with or without this index (EXPLAIN QUERY PLAN:
``SCAN task_queue``). A job's end-and-claim writes 8 pages instead of 9. PostgreSQL and
MySQL keep the index.
"""
from peewee import SqliteDatabase


def up(migrator, db):
    if isinstance(db, SqliteDatabase):
        db.execute_sql("DROP INDEX IF EXISTS task_queue_finished_on")
