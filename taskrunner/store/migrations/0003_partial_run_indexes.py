"""task_runs_claim and task_runs_runner become partial indexes on SQLite and PostgreSQL:
the claim index holds only ``scheduled`` runs, the runner index only ``running`` ones.

Why: every run passes scheduled → running → final, and history stays in task_runs until
rotation. In the full indexes each run left entries behind, and on PostgreSQL a run's end
(``WHERE id = … AND status = 'running'``) was planned as a scan of the ``running`` range
of the claim index, which grows with dead entries until VACUUM: a busy queue slowed to
half its speed within 15,000 runs. The partial indexes stay as small as the live work.
Queries that should use them name the status as a literal (`models.run_status_is`).
MySQL has no partial indexes and keeps the full ones.
"""
from peewee import MySQLDatabase

PARTIAL = (
    "CREATE INDEX task_runs_claim ON task_runs (priority DESC, scheduled_on, id) "
    "WHERE status = 'scheduled'",
    "CREATE INDEX task_runs_runner ON task_runs (runner_id) WHERE status = 'running'",
)


def up(migrator, db):
    if isinstance(db, MySQLDatabase):
        return
    for name in ("task_runs_claim", "task_runs_runner"):
        db.execute_sql("DROP INDEX %s" % name)
    for sql in PARTIAL:
        db.execute_sql(sql)
