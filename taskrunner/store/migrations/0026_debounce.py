"""Debounce (Inngest's debounce, DBOS's debouncer): enqueues of one key of one handler within
a span collapse into one task. ``debounce_key`` is the key a task was added with (kept, for
every face to show); ``debounce_open`` holds it too while the task's window may still be open,
under a unique index on (debounce_open, handler): one open window per key and handler, a
database rule. A later enqueue that finds the window closed (the task due, run, or ended)
clears ``debounce_open`` before adding the next window's task. ``debounce_until``: the latest
due time a window may be pushed to (``debounce_max`` after its first enqueue; NULL: none);
``debounce_count``: the enqueues that landed in the task.

SQLite and PostgreSQL index only the rows that hold a window (partial, as 0014 and 0016 did
for the other mostly-NULL columns), so a task added without a debounce writes no entry.
"""
from peewee import MySQLDatabase, PostgresqlDatabase, SqliteDatabase


def up(migrator, db):
    # The type a DateTimeField has on each database (with microseconds on MySQL, as
    # store/db.py makes it: a due time compared with the others').
    when = "TIMESTAMP" if isinstance(db, PostgresqlDatabase) else \
        "DATETIME(6)" if isinstance(db, MySQLDatabase) else "DATETIME"
    for column in ("debounce_key VARCHAR(255) NULL", "debounce_open VARCHAR(255) NULL",
                   "debounce_until %s NULL" % when, "debounce_count INTEGER NULL"):
        db.execute_sql("ALTER TABLE task_queue ADD COLUMN %s" % column)
    partial = isinstance(db, (PostgresqlDatabase, SqliteDatabase))
    db.execute_sql("CREATE UNIQUE INDEX task_queue_debounce ON task_queue "
                   "(debounce_open, handler)%s" % (
                       " WHERE debounce_open IS NOT NULL" if partial else ""))
