"""PostgreSQL: the indexes of columns that are NULL for most rows hold only the rows that
have a value (partial indexes ``WHERE col IS NOT NULL``), as migration 0014 did on SQLite.

Why: an UPDATE that PostgreSQL cannot do in place (HOT) adds an entry for the new row
version to every index whose predicate it satisfies, changed column or not, and a job
updates its run and its task twice each (claim, end). With full indexes each of those
updates also indexed the run's or task's NULLs — a finished task has no active key, next run,
waiting key or periodic task, a finished run no active task or concurrency slot, a running
one no finish time. Every query that reads these indexes compares the column with a value
(``=``, ``<``, ``>=``), which tells the planner the column is not NULL, so it keeps using
them; a unique index still refuses two rows with one value (NULLs never collided). The
indexes keep their names. MySQL keeps full indexes (it has no partial ones).
"""
import importlib

from peewee import PostgresqlDatabase

SQLITE = importlib.import_module("taskrunner.store.migrations.0014_sqlite_partial_null_indexes")
PARTIAL = SQLITE.PARTIAL + (
    # The run that holds its task's one live slot (rule 1): NULL once the run has ended.
    ("task_runs_active_task_id", "UNIQUE INDEX %s ON task_runs (active_task_id)",
     "active_task_id"),
)


def up(migrator, db):
    if not isinstance(db, PostgresqlDatabase):
        return
    for name, index, column in PARTIAL:
        db.execute_sql("DROP INDEX IF EXISTS %s" % name)
        db.execute_sql("CREATE %s WHERE %s IS NOT NULL" % (index % name, column))
