"""Periodic tasks get what the other seeds ask for: Docspell's ``subject`` (a human title)
and ``group_name`` (the tenant it belongs to, Docspell's ``group_``), Nuntium's ``timebox``
and ``tolerance`` (the settings they were derived from; the derived ``max_runtime`` and
``min_spacing`` are stored as before), and ``dropped_count``: tasks dropped at start.
Tasks get ``subject`` and ``group_name`` too: a periodic task's are carried to the tasks it
submits (Docspell's job table has both), so a task list shows what a task is for."""
from peewee import MySQLDatabase, PostgresqlDatabase

COLUMNS = (
    ("subject", "VARCHAR(255) NULL"),
    ("group_name", "VARCHAR(255) NULL"),
    ("timebox", "VARCHAR(8) NULL"),
    ("tolerance", "%s NULL"),
    ("dropped_count", "INTEGER NOT NULL DEFAULT 0"),
)


def up(migrator, db):
    double = "DOUBLE PRECISION" if isinstance(db, PostgresqlDatabase) else \
        "DOUBLE" if isinstance(db, MySQLDatabase) else "REAL"
    for column, kind in COLUMNS:
        db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN %s %s"
                       % (column, kind % double if "%s" in kind else kind))
    db.execute_sql("CREATE INDEX periodic_tasks_group_name ON periodic_tasks (group_name)")
    for column in ("subject", "group_name"):
        db.execute_sql("ALTER TABLE task_queue ADD COLUMN %s VARCHAR(255) NULL" % column)
