"""The DBOS Transact peer: its system database on PostgreSQL or SQLite (the URL the bench
gives), workflows on one queue ("bench"), drained by W worker processes with an executor id
each (``python -m bench.dbos_app work URL EXECUTOR_ID``), as DBOS asks for a queue served by
several processes without its Conductor.

Workflows:
- ``noop``: nothing (the throughput comparison: one workflow per job);
- ``ten_steps(sleep_s)``: 10 no-op ``@DBOS.step``s, with ``DBOS.sleep(sleep_s)`` (durable)
  between the 5th and the 6th when sleep_s > 0 (bench/durable.py);
- ``chain(n)``: n ``noop`` child workflows, each started (``DBOS.start_workflow``, in the
  parent's process: no queue poll between two links) once the previous one returned;
- ``fan(n)``: n ``leaf`` children enqueued at once, all awaited, then one ``report`` child
  over their results, awaited.

The queue: ``worker_concurrency`` (workflows one process runs at a time, in its thread pool)
and ``polling_interval_sec`` (DBOS polls its queue: there is no wake-up on enqueue) from
$BENCH_DBOS_CONCURRENCY and $BENCH_DBOS_POLL (bench/systems.py says which and why).
Everything runs under one application version ("bench"), so every process may run every
workflow. Log level from $BENCH_LOG_LEVEL (WARNING by default).
"""
import os
import signal
import sys
import threading

from dbos import DBOS, DBOSClient

APP = "trbench"
QUEUE = "bench"
VERSION = "bench"


def config(url, executor_id):
    return {"name": APP, "system_database_url": sqlalchemy_url(url), "executor_id": executor_id,
            "application_version": VERSION,
            "log_level": os.environ.get("BENCH_LOG_LEVEL", "warning").upper(),
            "run_admin_server": False}


def sqlalchemy_url(url):
    """The bench's URL as SQLAlchemy (DBOS) reads it."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


# -- workflows ---------------------------------------------------------------------------

@DBOS.step()
def step():
    return None


@DBOS.workflow(name="noop")
def noop():
    return None


@DBOS.workflow(name="leaf")
def leaf(i):
    return i


@DBOS.workflow(name="report")
def report(results):
    return len(results)


@DBOS.workflow(name="ten_steps")
def ten_steps(sleep_s=0):
    for i in range(10):
        if i == 5 and sleep_s:
            DBOS.sleep(sleep_s)
        step()
    return None


def _queue():
    return DBOS.retrieve_queue(QUEUE)


@DBOS.workflow(name="chain")
def chain(n):
    for _ in range(n):
        DBOS.start_workflow(noop).get_result()
    return n


@DBOS.workflow(name="fan")
def fan(n):
    handles = [_queue().enqueue(leaf, i) for i in range(n)]
    results = [h.get_result() for h in handles]
    return _queue().enqueue(report, results).get_result()


# -- processes ---------------------------------------------------------------------------

def work(url, executor_id):
    """A worker: launch, register the queue, serve it until TERM."""
    concurrency = int(os.environ.get("BENCH_DBOS_CONCURRENCY", "0")) or None
    poll = float(os.environ.get("BENCH_DBOS_POLL", "1.0"))
    DBOS(config=config(url, executor_id))
    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=concurrency, polling_interval_sec=poll,
                        on_conflict="always_update")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    DBOS.destroy(workflow_completion_timeout_sec=0)
    os._exit(0)


def client(url):
    return DBOSClient(system_database_url=sqlalchemy_url(url), application_name=APP)


def enqueue(url, n, workflow="noop", args=(), batch=1000):
    """Queue n workflows `workflow(*args)`, `batch` per transaction (not timed)."""
    c = client(url)
    try:
        c.register_queue(QUEUE, on_conflict="never_update")
        options = {"queue_name": QUEUE, "workflow_name": workflow, "app_version": VERSION}
        engine = c._sys_db.engine
        for start in range(0, n, batch):
            with engine.begin() as conn:
                for _ in range(min(batch, n - start)):
                    c.enqueue_in_transaction(conn, options, *args)
    finally:
        c.destroy()


def install(url):
    """Create DBOS's system tables (DBOS.migrate, as `dbos migrate` does), so workers start
    alike."""
    DBOS.migrate(sqlalchemy_url(url))
    c = client(url)
    try:
        c.register_queue(QUEUE, on_conflict="never_update")
    finally:
        c.destroy()


if __name__ == "__main__":
    if sys.argv[1:2] == ["work"] and len(sys.argv) == 4:
        work(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m bench.dbos_app work URL EXECUTOR_ID")
