"""periodic_tasks: timers that submit tasks."""
from peewee import (BooleanField, CharField, DateTimeField, DoubleField, IntegerField, Model,
                    TextField)


def up(migrator, db):
    class PeriodicTask(Model):
        name = CharField(unique=True)
        enabled = BooleanField(default=True)
        handler = CharField()
        data = TextField()
        priority = IntegerField(default=0)
        submitter = CharField(null=True)
        worker = CharField(null=True)
        marked = DateTimeField(null=True)
        timer = CharField()
        nextrun = DateTimeField(null=True, index=True)
        created = DateTimeField()
        owner = CharField(null=True, index=True)
        catch_up = CharField(max_length=8, default="once")
        max_runtime = DoubleField(null=True)
        min_spacing = DoubleField(null=True)
        max_retries = IntegerField(null=True)
        source = CharField(max_length=16, default="api")
        last_due = DateTimeField(null=True)
        last_run = DateTimeField(null=True)
        last_task_id = IntegerField(null=True)
        last_status = CharField(max_length=16, null=True)
        consecutive_failures = IntegerField(default=0)
        submitted_count = IntegerField(default=0)
        skipped_count = IntegerField(default=0)
        updated_on = DateTimeField()

        class Meta:
            database = db
            legacy_table_names = False
            table_name = "periodic_tasks"

    db.create_tables([PeriodicTask])
