"""Flow control (issue 27): rate limits per queue and per key, fairness between tenants.

- ``task_queue.rate_key`` / ``task_runs.rate_key``: the key a task's runs spend a token of
  (copied to the run, like the queue and the priority, so the claim reads one table);
  ``tenant`` likewise, the value a fair queue round-robins between.
- ``task_rate_buckets``: one token bucket per limited queue (kind ``queue``) or key (kind
  ``key``): its rate (tokens per second), burst (the bucket's size), the tokens it held at
  ``stamp`` (seconds since the epoch on the database's clock). The claim refills and spends
  it in its own statement or transaction.
- ``task_rate_limits``: the key limits set at run time (``taskrunner rate set``), by key or
  key prefix (``tenant:*``); the config's ``[rate_limits]`` are read from the config.
- ``task_tenants``: one row per (queue, tenant) ever added, with the sequence number of the
  claim that last served it: a fair claim serves the tenant served longest ago.
- ``task_runs_fair``: the fair claim's index, (queue, tenant, the claim order) over the
  scheduled runs that have a tenant (SQLite, PostgreSQL: a partial index; runs without a
  tenant cost it nothing). MySQL has no partial index: (status, queue, tenant, ...).
"""
from peewee import (BigIntegerField, CharField, CompositeKey, DateTimeField, DoubleField,
                    Model, MySQLDatabase)

COLUMNS = (
    ("task_queue", "rate_key VARCHAR(255) NULL"),
    ("task_queue", "tenant VARCHAR(255) NULL"),
    ("task_runs", "rate_key VARCHAR(255) NULL"),
    ("task_runs", "tenant VARCHAR(255) NULL"),
)
PARTIAL_FAIR = ("CREATE INDEX task_runs_fair ON task_runs "
                "(queue, tenant, priority DESC, scheduled_on, id) "
                "WHERE status = 'scheduled' AND tenant IS NOT NULL")
MYSQL_FAIR = ("CREATE INDEX task_runs_fair ON task_runs "
              "(status, queue, tenant, priority DESC, scheduled_on, id)")


def up(migrator, db):
    class Base(Model):
        class Meta:
            database = db
            legacy_table_names = False

    class RateBucket(Base):
        kind = CharField(max_length=8)
        name = CharField(max_length=255)
        rate = DoubleField()
        burst = DoubleField()
        tokens = DoubleField()
        stamp = DoubleField()
        updated_on = DateTimeField()

        class Meta:
            table_name = "task_rate_buckets"
            primary_key = CompositeKey("kind", "name")

    class RateLimit(Base):
        pattern = CharField(max_length=255, primary_key=True)
        rate = DoubleField()
        burst = DoubleField()
        text = CharField(max_length=64)
        updated_on = DateTimeField()

        class Meta:
            table_name = "task_rate_limits"

    class Tenant(Base):
        queue = CharField(max_length=64)
        tenant = CharField(max_length=255)
        served = BigIntegerField(default=0)

        class Meta:
            table_name = "task_tenants"
            primary_key = CompositeKey("queue", "tenant")

    for table, column in COLUMNS:
        db.execute_sql("ALTER TABLE %s ADD COLUMN %s" % (table, column))
    db.execute_sql(MYSQL_FAIR if isinstance(db, MySQLDatabase) else PARTIAL_FAIR)
    db.create_tables([RateBucket, RateLimit, Tenant])
    db.execute_sql("CREATE INDEX task_tenants_served ON task_tenants (queue, served, tenant)")
