"""The Procrastinate peer on PostgreSQL ($BENCH_PROCRASTINATE_DSN): a no-op task and a task
sleeping `ms` milliseconds.

Schema: ``procrastinate --app bench.procrastinate_app.app schema --apply``; workers:
``procrastinate --app bench.procrastinate_app.app --log-level L worker --concurrency 1``.
"""
import os
import time

from procrastinate import App, PsycopgConnector

app = App(connector=PsycopgConnector(conninfo=os.environ.get("BENCH_PROCRASTINATE_DSN", "")))


@app.task(name="noop")
def noop():
    return None


@app.task(name="sleep")
def sleep(ms):
    time.sleep(ms / 1000.0)


def enqueue(n, ms=0, batch=5000):
    task, args = (sleep, {"ms": ms}) if ms else (noop, {})
    with app.open():
        for start in range(0, n, batch):
            task.batch_defer(*([args] * min(batch, n - start)))


def enqueuer(dsn):
    """(defer one no-op, close) through an app on `dsn`, as an application calls
    `noop.defer()`: what the bench's single-enqueue latency times."""
    other = App(connector=PsycopgConnector(conninfo=dsn))
    other.open()
    return other.configure_task(name="noop").defer, other.close
