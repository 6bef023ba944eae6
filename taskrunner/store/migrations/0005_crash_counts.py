"""Crashes counted apart from errors (TimescaleDB's crash accounting): how many runs of a
task, and of a periodic task's tasks, ended because their runner process died."""


def up(migrator, db):
    for table in ("task_queue", "periodic_tasks"):
        db.execute_sql("ALTER TABLE %s ADD COLUMN crash_count INTEGER NOT NULL DEFAULT 0" % table)
