"""The PgQueuer peer on PostgreSQL: a no-op entrypoint and one sleeping `ms` milliseconds,
run by ``python -m bench.pgqueuer_app work DSN BATCH_SIZE MARKS`` (one QueueManager on one
asyncpg connection per process, as PgQueuer's performance guide advises).

Its fast settings, from its performance-tuning guide: the asyncpg driver (about twice psycopg's
throughput in its own benchmark), `batch_size` (jobs taken per dequeue round trip; its default
is 10, short jobs want more — the bench compares 1 and 100), its default `durable` tables
(logged: no job lost in a crash, as every other side here), and `pgq autovac`'s table settings
(applied at install). Acknowledgements: a finished job goes into a buffer flushed when it
holds `batch_size` jobs or after 0.1 s, by a statement that deletes the jobs and logs them;
the worker does not wait for that commit before it takes more. With batch_size 1 each ack is
flushed on its own (the closest PgQueuer comes to "committed before the next job"); with 100,
up to 100 finished jobs are uncommitted at a time and run again after a crash.

Finish times come from its own log table (pgqueuer_log, status 'successful', written by the
ack's statement); each job appends the time and the worker's pid to MARKS (one line per job,
O_APPEND), which gives each worker's share and when a job ran (bench/compare.py's pickup).
"""
import asyncio
import logging
import os
import sys
import time
from datetime import timedelta

import asyncpg
from pgqueuer import AsyncpgDriver, Queries, QueueManager

_marks = None


def _mark():
    global _marks
    if _marks is None:
        _marks = os.open(os.environ["BENCH_MARKS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(_marks, b"%.6f %d\n" % (time.time(), os.getpid()))


async def _connect(dsn):
    return await asyncpg.connect(dsn)


async def _install(dsn):
    conn = await _connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        await queries.optimize_autovacuum()
    finally:
        await conn.close()


async def _enqueue(dsn, n, ms, batch=5000):
    conn = await _connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        name, payload = ("sleep", b"%g" % ms) if ms else ("noop", None)
        for start in range(0, n, batch):
            size = min(batch, n - start)
            await queries.enqueue([name] * size, [payload] * size, [0] * size)
    finally:
        await conn.close()


async def _work(dsn, batch_size):
    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "warning").upper())
    logging.getLogger("pgqueuer").setLevel(os.environ.get("BENCH_LOG_LEVEL", "warning").upper())
    conn = await _connect(dsn)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("noop")
    async def noop(job):
        _mark()

    @qm.entrypoint("sleep")
    async def sleep(job):
        await asyncio.sleep(float(job.payload) / 1000.0)
        _mark()

    await qm.run(batch_size=batch_size, dequeue_timeout=timedelta(seconds=30))


def install(dsn):
    asyncio.run(_install(dsn))


def enqueue(dsn, n, ms=0, batch=5000):
    asyncio.run(_enqueue(dsn, n, ms, batch))


def enqueuer(dsn):
    """(enqueue one no-op, close) on a connection of its own, as an application calls
    `queries.enqueue("noop", None)`: what a single-enqueue latency would time."""
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(_connect(dsn))
    queries = Queries(AsyncpgDriver(conn))

    def call():
        loop.run_until_complete(queries.enqueue("noop", None))

    def close():
        loop.run_until_complete(conn.close())
        loop.close()
    return call, close


if __name__ == "__main__":
    if sys.argv[1:2] == ["work"] and len(sys.argv) == 5:
        os.environ["BENCH_MARKS"] = sys.argv[4]
        asyncio.run(_work(sys.argv[2], int(sys.argv[3])))
    else:
        sys.exit("usage: python -m bench.pgqueuer_app work DSN BATCH_SIZE MARKS")
