"""``task_reruns``: an operator's re-run of an ended durable task from one of its steps
(``taskrunner rerun ID --from-step NAME``): the step, how many recorded steps it dropped, who
asked and why, when, and the run it created. Read by a task's page and ``show``.
MySQL / MariaDB: the reason as LONGTEXT (as 0004 did for data and results).
"""
from peewee import CharField, DateTimeField, IntegerField, Model, MySQLDatabase, TextField


def up(migrator, db):
    class Rerun(Model):
        task_id = IntegerField(index=True)
        from_step = CharField()
        steps_dropped = IntegerField()
        requested_by = CharField(null=True)
        reason = TextField(null=True)
        requested_on = DateTimeField()
        run_id = IntegerField(null=True)

        class Meta:
            database = db
            table_name = "task_reruns"

    db.create_tables([Rerun])
    if isinstance(db, MySQLDatabase):
        db.execute_sql("ALTER TABLE task_reruns MODIFY reason LONGTEXT NULL")
