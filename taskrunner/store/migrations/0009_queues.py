"""Named queues: every task, run and periodic task belongs to a queue (``default`` unless
named; existing rows land there), the claim index leads with the queue, and two small
tables: ``task_queues`` (one row per queue name ever used: whether it is paused) and
``task_runner_queues`` (the queues each running runner serves, with a slot under a queue's
``limit``, unique per host like the runner's own slot).

The claim index is rebuilt: on a large backlog the migration takes as long as building an
index over the scheduled runs (SQLite, PostgreSQL: the partial index holds only those).
"""
from datetime import datetime, timezone

from peewee import (BooleanField, CharField, DateTimeField, IntegerField, Model,
                    MySQLDatabase)

ADD_COLUMN = "ALTER TABLE %s ADD COLUMN queue VARCHAR(64) NOT NULL DEFAULT 'default'"
PARTIAL_CLAIM = ("CREATE INDEX task_runs_claim ON task_runs "
                 "(queue, priority DESC, scheduled_on, id) WHERE status = 'scheduled'")
MYSQL_CLAIM = ("CREATE INDEX task_runs_claim ON task_runs "
               "(status, queue, priority DESC, scheduled_on, id)")


def up(migrator, db):
    class Base(Model):
        class Meta:
            database = db
            legacy_table_names = False

    class Queue(Base):
        name = CharField(max_length=64, primary_key=True)
        paused = BooleanField(default=False)
        paused_on = DateTimeField(null=True)
        updated_on = DateTimeField()

        class Meta:
            table_name = "task_queues"

    class RunnerQueue(Base):
        runner_id = IntegerField(index=True)
        host = CharField()
        queue = CharField(max_length=64)
        # 1..limit of the queue while the runner runs; NULL for a queue without a limit.
        slot = IntegerField(null=True)

        class Meta:
            table_name = "task_runner_queues"

    for table in ("task_queue", "task_runs", "periodic_tasks"):
        db.execute_sql(ADD_COLUMN % table)
    mysql = isinstance(db, MySQLDatabase)
    db.execute_sql("DROP INDEX task_runs_claim" + (" ON task_runs" if mysql else ""))
    db.execute_sql(MYSQL_CLAIM if mysql else PARTIAL_CLAIM)
    RunnerQueue.add_index(RunnerQueue.host, RunnerQueue.queue, RunnerQueue.slot, unique=True,
                          name="task_runner_queues_slot")
    db.create_tables([Queue, RunnerQueue])
    Queue.insert(name="default", paused=False,
                 updated_on=datetime.now(timezone.utc).replace(tzinfo=None)).execute()
