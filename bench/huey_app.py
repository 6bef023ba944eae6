"""The Huey peer: SqliteHuey (WAL, its defaults) with synchronous=$BENCH_SQLITE_SYNCHRONOUS
(full, SQLite's own default, unless the bench says otherwise), a no-op task and a task
sleeping `ms` milliseconds. Each finished task appends its finish time and the worker's pid
to $BENCH_MARKS (one line per task, O_APPEND), which is how the bench sees the last finish
and each worker's share.

Consumer: ``huey_consumer bench.huey_app.huey -k process -w W [-q]`` with $BENCH_HUEY_DB set.
With $BENCH_HUEY_STARTED set (bench/instructions.py), each worker appends its pid to that file
once it has started, before its first dequeue; without it, no start-up hook is registered.
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


def make_huey(filename):
    return SqliteHuey("bench", filename=filename, storage_class=Storage)


huey = make_huey(os.environ.get("BENCH_HUEY_DB", ":memory:"))
_marks = None


def _noop():
    return None


noop = huey.task(name="noop")(_noop)


@huey.task(name="sleep")
def sleep(ms):
    time.sleep(ms / 1000.0)


@huey.signal(signals.SIGNAL_COMPLETE)
def _mark(signal, task, *args, **kwargs):
    global _marks
    if _marks is None:
        _marks = os.open(os.environ["BENCH_MARKS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(_marks, b"%.6f %d\n" % (time.time(), os.getpid()))


if os.environ.get("BENCH_HUEY_STARTED"):
    @huey.on_startup()
    def _started():
        started = os.open(os.environ["BENCH_HUEY_STARTED"], os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                          0o600)
        os.write(started, b"%d\n" % os.getpid())
        os.close(started)


def task(ms):
    """The task the bench queues: the no-op, or a sleep of `ms` ms."""
    return sleep.s(ms) if ms else noop.s()


def enqueue(n, ms=0):
    """Queue n tasks in one transaction (Huey has no bulk API; enqueueing is not what is
    timed, so the serialized messages are inserted as its storage.enqueue would)."""
    rows = [(huey.storage.name, huey.serialize_task(task(ms)), 0) for _ in range(n)]
    with huey.storage.db(commit=True) as cursor:
        cursor.executemany("insert into task (queue, data, priority) values (?, ?, ?)", rows)


def enqueuer(filename):
    """(enqueue one no-op, close) on the Huey of `filename`, as an application calls
    `noop()`: what the bench's single-enqueue latency times."""
    other = make_huey(filename)
    return other.task(name="noop")(_noop), other.storage.close
