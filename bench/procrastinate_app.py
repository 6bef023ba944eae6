"""The Procrastinate peer: one no-op task on PostgreSQL ($BENCH_PROCRASTINATE_DSN).

Schema: ``procrastinate --app bench.procrastinate_app.app schema --apply``; workers:
``procrastinate --app bench.procrastinate_app.app worker --concurrency 1 --one-shot``.
"""
import os

from procrastinate import App, PsycopgConnector

app = App(connector=PsycopgConnector(conninfo=os.environ.get("BENCH_PROCRASTINATE_DSN", "")))


@app.task(name="noop")
def noop():
    return None


def enqueue(n, batch=5000):
    with app.open():
        for start in range(0, n, batch):
            noop.batch_defer(*([{}] * min(batch, n - start)))

