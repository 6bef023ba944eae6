"""Numbered schema migrations (playhouse.migrations), applied by every command.

Each migration declares frozen copies of the tables it touches, independent of
`taskrunner.models`, so an old migration keeps meaning what it meant.
"""
import os

from playhouse.migrations import Runner

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
HISTORY_TABLE = "taskrunner_migrations"


def pending(db):
    runner = Runner(db, DIRECTORY, table_name=HISTORY_TABLE)
    return [m.name for m in runner.status() if not m.applied and m.path]


def migrate(db, backend):
    """Apply pending migrations. Concurrent processes may start together: the first takes
    a lock (an advisory lock, or SQLite's write lock), the others then find nothing to do."""
    if not pending(db):
        return []
    if backend == "postgresql":
        with db.atomic():
            db.execute_sql("SELECT pg_advisory_xact_lock(1952540011)")
            return Runner(db, DIRECTORY, table_name=HISTORY_TABLE).up()
    if backend == "mysql":
        db.execute_sql("SELECT GET_LOCK('taskrunner_migrations', 60)")
        try:
            return Runner(db, DIRECTORY, table_name=HISTORY_TABLE).up()
        finally:
            db.execute_sql("SELECT RELEASE_LOCK('taskrunner_migrations')")
    with db.atomic():
        return Runner(db, DIRECTORY, table_name=HISTORY_TABLE).up()
