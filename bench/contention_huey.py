"""bench/huey_app.py's Huey with a task that sleeps $BENCH_HUEY_SLEEP seconds (the
5 ms-per-task workload of bench/sqlite_contention.py); its finish marks are huey_app's."""
import os
import time

from bench.huey_app import huey, noop  # noqa: F401  (the consumer loads this module's huey)

SECONDS = float(os.environ.get("BENCH_HUEY_SLEEP", "0"))


@huey.task()
def sleep():
    time.sleep(SECONDS)


def enqueue(n):
    rows = [(huey.storage.name, huey.serialize_task(sleep.s()), 0) for _ in range(n)]
    with huey.storage.db(commit=True) as cursor:
        cursor.executemany("insert into task (queue, data, priority) values (?, ?, ?)", rows)
