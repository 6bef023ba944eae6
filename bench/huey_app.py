"""The Huey peer: SqliteHuey (WAL, its defaults) with synchronous=$BENCH_SQLITE_SYNCHRONOUS
(full, SQLite's own default, unless the bench says otherwise) and one no-op task. Each finished task appends its finish time to $BENCH_MARKS (one line per task,
O_APPEND), which is how the bench sees the last finish.

Consumer: ``huey_consumer bench.huey_app.huey -k process -w W`` with $BENCH_HUEY_DB set.
"""
import os
import time

from huey import SqliteHuey, signals
from huey.storage import SqliteStorage


class Storage(SqliteStorage):
    def _create_connection(self):
        conn = super()._create_connection()
        conn.execute("pragma synchronous=%s" % os.environ.get("BENCH_SQLITE_SYNCHRONOUS", "full"))
        return conn


huey = SqliteHuey("bench", filename=os.environ.get("BENCH_HUEY_DB", ":memory:"),
                  storage_class=Storage)
_marks = None


@huey.task()
def noop():
    return None


@huey.signal(signals.SIGNAL_COMPLETE)
def _mark(signal, task, *args, **kwargs):
    global _marks
    if _marks is None:
        _marks = os.open(os.environ["BENCH_MARKS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(_marks, b"%.6f\n" % time.time())


def enqueue(n):
    """Queue n no-op tasks in one transaction (Huey has no bulk API; enqueueing is not what
    is timed, so the serialized messages are inserted as its storage.enqueue would)."""
    rows = [(huey.storage.name, huey.serialize_task(noop.s()), 0) for _ in range(n)]
    with huey.storage.db(commit=True) as cursor:
        cursor.executemany("insert into task (queue, data, priority) values (?, ?, ?)", rows)

