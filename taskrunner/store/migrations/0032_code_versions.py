"""Code versions (docs: "Changing durable code under running work"):
``task_runners.code_version``, the version of the handler code a runner process runs
(``[runner] code_version``, ``TASKRUNNER_CODE_VERSION``, or a digest of the application's
source, runner/versions.py) — a run's version is its runner's; and
``task_queue.code_version``, the version a durable task started under, written with its first
durable record (a step, a checkpoint, a sleep, an event, a patch). NULL for an overseer or a
maintainer, and for a task that recorded nothing durable: a plain job writes nothing here.
"""


def up(migrator, db):
    db.execute_sql("ALTER TABLE task_runners ADD COLUMN code_version VARCHAR(64) NULL")
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN code_version VARCHAR(64) NULL")
