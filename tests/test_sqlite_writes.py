"""What a durable SQLite queue pays per commit is the pages it writes to the WAL (each one
written and synced before the commit returns): adding a task and a runner's end-and-claim
write no index entry for a NULL and rewrite no index whose column stays the same.

Counted, not timed: the WAL's growth with checkpoints off, over many adds and runs."""
import os

from taskrunner.runner import Worker
from taskrunner.store import Store

ECHO = "taskrunner.handlers.Echo"
FRAME = 24 + 4096          # a WAL frame: its header and one page


def _wal_frames(store):
    return os.path.getsize(store.db.database + "-wal") // FRAME


def test_an_add_and_a_runs_end_and_next_claim_write_few_wal_pages(sqlite_db):
    queue = sqlite_db.queue()
    store = queue.store
    store.db.pragma("wal_autocheckpoint", 0, permanent=True)
    store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    for _ in range(20):
        queue.add_task(ECHO)                  # the first pages of each index split off
    before, n = _wal_frames(store), 300
    for _ in range(n):
        queue.add_task(ECHO)
    per_add = (_wal_frames(store) - before) / n
    # 17.5 with an index entry for every NULL (active_key, next_run_on, finished_on, ...).
    assert per_add <= 12, per_add

    runner_store = Store(sqlite_db.config())
    runner_store.db.pragma("wal_autocheckpoint", 0, permanent=True)
    before = _wal_frames(store)
    # memory_limit off: this is the test process, whose RSS says nothing about the runner.
    done = Worker(runner_store, install_signals=False, memory_limit=False).work(burst=True)
    assert done == n + 20
    per_run = (_wal_frames(store) - before) / done
    # 14.1 when a success set columns already NULL and entered NULLs in finished_on indexes.
    assert per_run <= 10, per_run
    runner_store.close()
    queue.close()
