"""task_queue, task_runs and task_runners."""
from peewee import (BigIntegerField, CharField, DateTimeField, DoubleField, IntegerField,
                    Model, TextField)


def up(migrator, db):
    class Base(Model):
        class Meta:
            database = db
            legacy_table_names = False

    class Task(Base):
        queued_on = DateTimeField()
        queued_by = CharField(null=True)
        scheduled_on = DateTimeField()
        handler = CharField()
        data = TextField()
        priority = IntegerField(default=0)
        last_status = CharField(max_length=16, default="scheduled")
        max_retries = IntegerField()
        runs_failed = IntegerField(default=0)
        run_count = IntegerField(default=0)
        run_timeout = DoubleField()
        max_runtime = DoubleField(null=True)
        retry_backoff = DoubleField(null=True)
        unique_key = CharField(null=True)
        active_key = CharField(null=True, unique=True)
        periodic_task_id = IntegerField(null=True, index=True)
        next_run_on = DateTimeField(null=True, index=True)
        updated_on = DateTimeField()
        finished_on = DateTimeField(null=True, index=True)
        last_error_code = CharField(null=True)
        last_error_message = TextField(null=True)

        class Meta:
            table_name = "task_queue"

    class Run(Base):
        task_id = IntegerField(index=True)
        created_on = DateTimeField()
        started_on = DateTimeField(null=True)
        updated_on = DateTimeField()
        finished_on = DateTimeField(null=True)
        percent_completed = IntegerField(default=0)
        results = TextField(null=True)
        status = CharField(max_length=16, default="scheduled")
        error_code = CharField(null=True)
        error_message = TextField(null=True)
        runner_id = IntegerField(null=True)
        attempt = IntegerField(default=1)
        active_task_id = IntegerField(null=True, unique=True)
        priority = IntegerField(default=0)
        scheduled_on = DateTimeField()

        class Meta:
            table_name = "task_runs"

    class Runner(Base):
        host = CharField()
        boot_id = CharField(max_length=64)
        pid = IntegerField()
        pid_create_time = DoubleField()
        kind = CharField(max_length=16, default="runner")
        parent_id = IntegerField(null=True)
        started_on = DateTimeField()
        heartbeat_on = DateTimeField()
        finished_on = DateTimeField(null=True)
        status = CharField(max_length=16, default="running")
        slot = IntegerField(null=True)
        rss = BigIntegerField(null=True)
        runs_done = IntegerField(default=0)
        exit_reason = TextField(null=True)

        class Meta:
            table_name = "task_runners"

    # The claim: scheduled runs, highest priority first, then FIFO.
    Run.add_index(Run.status, Run.priority.desc(), Run.scheduled_on, Run.id, name="task_runs_claim")
    Run.add_index(Run.runner_id, Run.status, name="task_runs_runner")
    Runner.add_index(Runner.host, Runner.slot, unique=True, name="task_runners_host_slot")
    Runner.add_index(Runner.status, Runner.host, name="task_runners_status_host")
    db.create_tables([Task, Run, Runner])
