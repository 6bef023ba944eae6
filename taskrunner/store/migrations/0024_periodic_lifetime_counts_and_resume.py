"""Periodic tasks count their runs for their whole life: ``run_count`` (runs that ended
success, error or timeout), ``success_count`` and ``error_count`` (error or timeout, crashes
not included: ``crash_count`` has counted those since 0005), incremented when a run of one of
their tasks ends. Until now the counts were read from ``task_runs``, which rotation empties;
an existing row starts from the runs rotation has kept.

``resume``: a periodic task whose next task starts from the checkpoint of the previous one
when that one ended without success (Nuntium: "the next instantiation will proceed from that
point"). Off for every existing row.
"""
from peewee import MySQLDatabase, PostgresqlDatabase


def _count(condition):
    return ("(SELECT COUNT(*) FROM task_runs r JOIN task_queue t ON r.task_id = t.id "
            "WHERE t.periodic_task_id = periodic_tasks.id AND %s)" % condition)


def up(migrator, db):
    for column in ("run_count", "success_count", "error_count"):
        db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN %s INTEGER NOT NULL DEFAULT 0"
                       % column)
    # The type peewee gives a BooleanField on each database.
    if isinstance(db, PostgresqlDatabase):
        boolean = "BOOLEAN NOT NULL DEFAULT FALSE"
    else:
        boolean = "%s NOT NULL DEFAULT 0" % ("BOOL" if isinstance(db, MySQLDatabase) else "INTEGER")
    db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN resume %s" % boolean)
    db.execute_sql(
        "UPDATE periodic_tasks SET run_count = %s, success_count = %s, error_count = %s" % (
            _count("r.status IN ('success', 'error', 'timeout')"),
            _count("r.status = 'success'"),
            _count("r.status IN ('error', 'timeout') AND "
                   "(r.error_code IS NULL OR r.error_code <> 'RunnerDied')")))
