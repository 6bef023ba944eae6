"""task_runs.traceback: where a failed run failed (the handler's traceback, bounded to its
last 64 KiB), so an error can be read back with its file, line and stack. LONGTEXT on
MySQL / MariaDB, whose TEXT holds only 64 KiB of bytes.

task_runs.cancel_requested_on: an operator cancelled the task while this run was running;
its runner stops the handler cooperatively and ends the run ``cancelled``.
"""
from peewee import MySQLDatabase, PostgresqlDatabase


def up(migrator, db):
    mysql = isinstance(db, MySQLDatabase)
    db.execute_sql("ALTER TABLE task_runs ADD COLUMN traceback %s NULL"
                   % ("LONGTEXT" if mysql else "TEXT"))
    # The type peewee gives a DateTimeField on each database.
    when = "TIMESTAMP" if isinstance(db, PostgresqlDatabase) else "DATETIME"
    db.execute_sql("ALTER TABLE task_runs ADD COLUMN cancel_requested_on %s NULL" % when)
