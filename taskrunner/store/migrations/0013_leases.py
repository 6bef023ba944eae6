"""Leases: ``task_leases``, one row per lease name (``maintenance``: the fleet-wide
maintenance, see leadership.py). The holder is a ``task_runners`` id (with its kind and
host, for operators); ``expires_on`` is written and compared on the database server's
clock. The row is inserted by the first process that asks for the lease."""
from peewee import CharField, DateTimeField, IntegerField, Model


def up(migrator, db):
    class Lease(Model):
        name = CharField(max_length=64, primary_key=True)
        holder_id = IntegerField(null=True)
        holder_kind = CharField(max_length=16, null=True)
        host = CharField(null=True)
        taken_on = DateTimeField(null=True)
        expires_on = DateTimeField()

        class Meta:
            database = db
            table_name = "task_leases"

    db.create_tables([Lease])
