"""Durable execution (DESIGN "Durable execution", rule 10).

- ``task_queue.checkpoint`` / ``checkpoint_on``: the last value a handler stored with
  ``run.checkpoint()`` (JSON) and when; every later attempt of the task starts from it.
- ``task_queue.waiting_for``: the event a ``waiting`` task waits for (``run.wait_for``); its
  ``next_run_on`` says until when (a sleep's end, an event's timeout).
- ``task_steps``: one row per step of a task that has run (``run.step``, and the sleeps and
  events of ``run.sleep`` / ``run.wait_for``), unique per (task_id, name): the row is
  inserted in the transaction that runs the step, so a step recorded once is never run again.
- ``task_events``: events sent to a task (``TaskQueue.send_event``), kept until a wait of
  their name consumes them.
MySQL / MariaDB: the JSON columns as LONGTEXT (as 0004 did for data and results).
"""
from peewee import (CharField, DateTimeField, IntegerField, Model, MySQLDatabase,
                    PostgresqlDatabase, TextField)


def up(migrator, db):
    when = "TIMESTAMP" if isinstance(db, PostgresqlDatabase) else "DATETIME"
    text = "LONGTEXT" if isinstance(db, MySQLDatabase) else "TEXT"
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN checkpoint %s NULL" % text)
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN checkpoint_on %s NULL" % when)
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN waiting_for VARCHAR(255) NULL")

    class Step(Model):
        task_id = IntegerField()
        name = CharField()
        kind = CharField(max_length=16)
        run_id = IntegerField(null=True)
        attempt = IntegerField(null=True)
        result = TextField(null=True)
        started_on = DateTimeField(null=True)
        finished_on = DateTimeField()

        class Meta:
            database = db
            table_name = "task_steps"

    class Event(Model):
        task_id = IntegerField()
        name = CharField()
        payload = TextField(null=True)
        sent_on = DateTimeField()
        consumed_on = DateTimeField(null=True)
        consumed_by = IntegerField(null=True)

        class Meta:
            database = db
            table_name = "task_events"

    db.create_tables([Step, Event])
    # Rule 10: one record per (task, step), whoever records it; the steps of a task and its
    # unconsumed events are read through these.
    db.execute_sql("CREATE UNIQUE INDEX task_steps_task_name ON task_steps (task_id, name)")
    db.execute_sql("CREATE INDEX task_events_task_name ON task_events (task_id, name)")
    if isinstance(db, MySQLDatabase):
        db.execute_sql("ALTER TABLE task_steps MODIFY result LONGTEXT NULL")
        db.execute_sql("ALTER TABLE task_events MODIFY payload LONGTEXT NULL")
