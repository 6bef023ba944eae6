"""What a durable SQLite queue pays per commit is the pages it writes to the WAL (each one
written and synced before the commit returns): adding a task and a runner's end-and-claim
write no index entry for a NULL, rewrite no index whose column stays the same, touch no
index that nothing reads, and write small pages.

Counted, not timed: the WAL's frames (each a header and one page) with checkpoints off, over
many adds and runs."""
import os
import sqlite3

from taskrunner import TaskQueue
from taskrunner.runs import rotation
from taskrunner.store.models import utcnow
from taskrunner.runner.loop import Runner
from taskrunner.store.bound import Store

ECHO = "taskrunner.handlers.Echo"


def _wal(store):
    """(frames, bytes) of the WAL so far: a 32-byte header, then a 24-byte header and one
    page per frame."""
    page_size = store.db.execute_sql("PRAGMA page_size").fetchone()[0]
    size = os.path.getsize(store.db.database + "-wal")
    return max(0, size - 32) // (24 + page_size), size


def test_a_new_database_has_small_pages(sqlite_db):
    queue = sqlite_db.queue()
    assert queue.store.db.execute_sql("PRAGMA page_size").fetchone()[0] == 2048
    assert queue.store.db.execute_sql("PRAGMA journal_mode").fetchone()[0] == "wal"
    queue.close()


def test_an_existing_database_keeps_its_page_size(tmp_path):
    path = str(tmp_path / "older.db")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA page_size = 4096")
    conn.execute("CREATE TABLE other (id INTEGER)")
    conn.close()
    queue = TaskQueue("sqlite:///" + path, migrate=True)
    assert queue.store.db.execute_sql("PRAGMA page_size").fetchone()[0] == 4096
    queue.add_task(ECHO)
    queue.close()


def test_an_add_and_a_runs_end_and_next_claim_write_few_wal_pages(sqlite_db):
    queue = sqlite_db.queue()
    store = queue.store
    store.db.pragma("wal_autocheckpoint", 0, permanent=True)
    # Past the first splits of every index (a queue with some history), then counted.
    queue.add_tasks([{"handler": ECHO}] * 1000)
    store.db.execute_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    (frames, size), n = _wal(store), 300
    for _ in range(n):
        queue.add_task(ECHO)
    after = _wal(store)
    per_add, bytes_per_add = (after[0] - frames) / n, (after[1] - size) / n
    # 17.5 pages with an index entry for every NULL (active_key, next_run_on, finished_on, ...);
    # 10.1 pages of 4,096 bytes (41.7 KB) before pages of 2,048.
    # 12.04 pages with migration 0020's full index of workflow_id, 10.9 with 0022's partial one.
    assert per_add <= 12, per_add
    assert bytes_per_add <= 26000, bytes_per_add

    runner_store = Store(sqlite_db.config())
    runner_store.db.pragma("wal_autocheckpoint", 0, permanent=True)
    frames, size = _wal(store)
    # memory_limit off: this is the test process, whose RSS says nothing about the runner.
    done = Runner(runner_store, install_signals=False, memory_limit=False).work(burst=True)
    assert done == n + 1000
    after = _wal(store)
    per_run, bytes_per_run = (after[0] - frames) / done, (after[1] - size) / done
    # 14.1 pages when a success set columns already NULL and entered NULLs in finished_on
    # indexes; 9.0 pages of 4,096 bytes (37 KB) with task_queue's finished_on index.
    assert per_run <= 9, per_run
    assert bytes_per_run <= 20000, bytes_per_run
    runner_store.close()
    queue.close()


def test_sqlite_keeps_no_index_on_the_end_time_of_tasks_and_rotation_still_works(sqlite_db):
    """Every end wrote the newest entry of task_queue_finished_on, which no query read:
    rotation takes the oldest tasks in id order."""
    queue = sqlite_db.queue()
    store = queue.store
    names = {row[0] for row in store.db.execute_sql(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'task_queue'")}
    assert "task_queue_finished_on" not in names and "task_queue_queued_on" in names, names
    ids = queue.add_tasks([{"handler": ECHO}] * 5)
    assert Runner(Store(sqlite_db.config()), install_signals=False,
                  memory_limit=False).work(burst=True) == 5
    live = queue.add_task(ECHO)
    store.Task.update(finished_on=utcnow().replace(year=2000)).where(
        store.Task.id.in_(ids[:3])).execute()
    assert rotation.rotate(store, utcnow())["success"] == 3
    assert sorted(t.id for t in store.Task.select(store.Task.id)) == ids[3:] + [live]
    queue.close()


def test_a_success_ends_its_run_and_task_without_returning(sqlite_db):
    """A run's end and its next claim cost the statements' own work: no UPDATE ... RETURNING,
    whose ephemeral table of rows cost as much as the UPDATE itself (about 65k instructions
    per job for the success's two, 30k for the claim's). The success's UPDATEs tell their
    outcome by the rows they changed; a claim of one reads its run and task, then starts the
    run by id, under the write lock its transaction took up front."""
    queue = sqlite_db.queue()
    n = 50
    queue.add_tasks([{"handler": ECHO}] * n)
    runner_store = Store(sqlite_db.config())
    statements = []
    runner_store.db.connect()
    runner_store.db.connection().set_trace_callback(statements.append)
    done = Runner(runner_store, install_signals=False, memory_limit=False).work(burst=True)
    assert done == n
    updates = [s for s in statements
               if s.lstrip().startswith(("UPDATE task_runs ", "UPDATE task_queue "))]
    returning = [s for s in updates if "RETURNING" in s]
    # Per job: the run's start, its end and its task's end (before: 3n + 2 RETURNING, the
    # burst's last claim finding nothing).
    assert not returning, (len(returning), returning[-1])
    assert len(updates) <= 3 * n, len(updates)
    assert queue.store.db.execute_sql(
        "SELECT count(*) FROM task_runs WHERE status = 'success'").fetchone()[0] == n
    runner_store.close()
    queue.close()
