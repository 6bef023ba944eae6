"""MySQL / MariaDB: three datetime columns added by ALTER TABLE in 0006, 0018 and 0019 were
plain DATETIME, which keeps whole seconds (MySQL rounds the fraction away), where every
other datetime column is DATETIME(6) (store/db.py): ``task_runs.cancel_requested_on`` (the
kill grace counts from it), ``task_runners.stopping_since`` and ``task_queue.checkpoint_on``.
Nothing to do on SQLite and PostgreSQL (TIMESTAMP keeps microseconds). On a large
``task_runs`` the MODIFY copies the table: run it in a quiet moment.
"""
from peewee import MySQLDatabase

COLUMNS = (("task_runs", "cancel_requested_on"), ("task_runners", "stopping_since"),
           ("task_queue", "checkpoint_on"))


def up(migrator, db):
    if isinstance(db, MySQLDatabase):
        for table, column in COLUMNS:
            db.execute_sql("ALTER TABLE %s MODIFY %s DATETIME(6) NULL" % (table, column))
