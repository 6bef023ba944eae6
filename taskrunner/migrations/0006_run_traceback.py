"""task_runs.traceback: where a failed run failed (the handler's traceback, bounded to its
last 64 KiB), so an error can be read back with its file, line and stack. LONGTEXT on
MySQL / MariaDB, whose TEXT holds only 64 KiB of bytes."""
from peewee import MySQLDatabase


def up(migrator, db):
    kind = "LONGTEXT" if isinstance(db, MySQLDatabase) else "TEXT"
    db.execute_sql("ALTER TABLE task_runs ADD COLUMN traceback %s NULL" % kind)
