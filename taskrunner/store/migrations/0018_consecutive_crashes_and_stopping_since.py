"""TimescaleDB keeps consecutive crashes apart from consecutive failures and backs off a
crashed job by them: ``task_queue.runs_crashed`` and ``periodic_tasks.consecutive_crashes``
count the runs ended by a dead runner in a row (``RunnerDied``), next to the totals
(``crash_count``); any other end of a run resets them (TimescaleDB resets them when a job
ends by itself).

TimescaleDB's TERMINATING: ``task_runners.stopping_since`` is when the runner began
winding down its run ``stopping_run_id`` (told to stop, its run cancelled or timed out);
``exit_reason`` says why (``stopping: ...``) until the runner exits or the run has ended.
"""
from peewee import PostgresqlDatabase


def up(migrator, db):
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN runs_crashed INTEGER NOT NULL DEFAULT 0")
    db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN consecutive_crashes INTEGER NOT NULL "
                   "DEFAULT 0")
    # The type peewee gives a DateTimeField on each database.
    when = "TIMESTAMP" if isinstance(db, PostgresqlDatabase) else "DATETIME"
    db.execute_sql("ALTER TABLE task_runners ADD COLUMN stopping_since %s NULL" % when)
    db.execute_sql("ALTER TABLE task_runners ADD COLUMN stopping_run_id INTEGER NULL")
