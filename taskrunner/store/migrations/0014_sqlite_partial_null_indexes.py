"""SQLite: the indexes of columns that are NULL for most rows hold only the rows that have a
value (partial indexes ``WHERE col IS NOT NULL``).

Why: SQLite writes every page it changes to the WAL and syncs it at each commit, and the
commit is what bounds a durable queue on one disk. A full index has an entry for every row,
NULL or not: adding a task wrote eight index entries for NULLs (17 pages per add_task), and
a run's end moved two finished_on entries from the NULL range to the newest times (two pages
each). With the partial indexes an add writes 10 pages, a runner's end-and-claim 9 instead of
11. Every query that reads these indexes compares the column with a value (``=``, ``<``,
``>=``), which tells SQLite the column is not NULL, so it keeps using them. PostgreSQL and
MySQL keep the full indexes (MySQL has no partial ones).
"""
from peewee import SqliteDatabase

# (index, what it indexes, the column whose NULLs it leaves out)
PARTIAL = (
    ("task_queue_active_key", "UNIQUE INDEX %s ON task_queue (active_key)", "active_key"),
    ("task_queue_periodic_task_id", "INDEX %s ON task_queue (periodic_task_id)",
     "periodic_task_id"),
    ("task_queue_next_run_on", "INDEX %s ON task_queue (next_run_on)", "next_run_on"),
    ("task_queue_finished_on", "INDEX %s ON task_queue (finished_on)", "finished_on"),
    ("task_queue_waiting_key", "INDEX %s ON task_queue (waiting_key)", "waiting_key"),
    ("task_runs_finished_on", "INDEX %s ON task_runs (finished_on)", "finished_on"),
    # Live slots only: a run's slot is cleared when it ends.
    ("task_runs_concurrency_slot", "UNIQUE INDEX %s ON task_runs (concurrency_key, "
                                   "concurrency_slot)", "concurrency_slot"),
)


def up(migrator, db):
    if not isinstance(db, SqliteDatabase):
        return
    for name, index, column in PARTIAL:
        db.execute_sql("DROP INDEX %s" % name)
        db.execute_sql("CREATE %s WHERE %s IS NOT NULL" % (index % name, column))
