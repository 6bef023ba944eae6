"""MySQL / MariaDB: task data, run results and error messages as LONGTEXT.

peewee's TextField is MySQL's TEXT, which holds 64 KiB, while `[task] max_data_size`
allows 1 MiB by default: a larger task was refused by the server (or cut short outside
strict mode). SQLite's and PostgreSQL's text has no such limit.
"""
from peewee import MySQLDatabase

COLUMNS = (
    ("task_queue", "data", "NOT NULL"),
    ("task_queue", "last_error_message", "NULL"),
    ("task_runs", "results", "NULL"),
    ("task_runs", "error_message", "NULL"),
    ("periodic_tasks", "data", "NOT NULL"),
)


def up(migrator, db):
    if not isinstance(db, MySQLDatabase):
        return
    for table, column, null in COLUMNS:
        db.execute_sql("ALTER TABLE %s MODIFY %s LONGTEXT %s" % (table, column, null))
