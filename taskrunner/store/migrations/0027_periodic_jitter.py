"""Periodic tasks get Temporal's jitter: ``jitter`` (seconds, NULL: none) spreads each
instance's due time over a stable offset in [0, jitter) after its calendar time, and
``nominal`` keeps that calendar time while ``nextrun`` holds the spread one (NULL without
jitter: nextrun is the calendar time, as for every existing row)."""
from peewee import MySQLDatabase, PostgresqlDatabase


def up(migrator, db):
    # The types peewee gives a DoubleField and a DateTimeField on each database (MySQL's
    # DATETIME(6): see store/db.py).
    if isinstance(db, PostgresqlDatabase):
        double, when = "DOUBLE PRECISION", "TIMESTAMP"
    elif isinstance(db, MySQLDatabase):
        double, when = "DOUBLE PRECISION", "DATETIME(6)"
    else:
        double, when = "REAL", "DATETIME"
    db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN jitter %s NULL" % double)
    db.execute_sql("ALTER TABLE periodic_tasks ADD COLUMN nominal %s NULL" % when)
