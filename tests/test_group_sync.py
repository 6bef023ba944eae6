"""Group commit for SQLite runners (groupsync.py): a runner commits without SQLite's sync and
makes the WAL durable before it acts on the commit, with one fdatasync shared by the host's
runners. Real runner processes, real locks; the shared counters (commits recorded, commits
known durable, fdatasyncs done) are read from the file every runner maps."""
import json
import os
import signal
import stat

import pytest

from conftest import START_TIMEOUT, wait_for
from sample_handlers import read_records
from taskrunner.host.groupsync import SUFFIX, GroupSync
from taskrunner.store.models import RUNNER, SUCCESS, Run, Runner, utcnow
from taskrunner.store.bound import Store

SYNCED_AT_START = "sync_handlers.SyncedAtStart"
HOLD = "sync_handlers.HoldSyncLocks"
RECORD = "sample_handlers.Record"


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _start_runners(sqlite_db, procs, tmp_path, count):
    config = sqlite_db.write_config(
        tmp_path / "c.toml", "[runner]\nlimit = %d\n[log]\nlevel = \"warning\"\n" % count)
    for _ in range(count):
        procs.spawn("runner", config=config, name="runner")
    wait_for(lambda: Runner.select().where((Runner.kind == RUNNER)
                                           & (Runner.status == "running")).count() == count,
             timeout=START_TIMEOUT, message="%d runners to register" % count)


def _succeeded():
    return Run.select().where(Run.status == SUCCESS).count()


def _lock_waiters(path):
    """Processes waiting for a lock (flock or record lock) on `path`: /proc/locks' '->' lines."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as fh:
        return sum(1 for line in fh if "->" in line
                   and line.split()[-3].endswith(":%d" % inode))


@pytest.mark.timeout(180)
def test_a_runner_starts_a_claimed_run_only_once_a_sync_covers_its_claim(sqlite_db, procs,
                                                                         tmp_path):
    queue = sqlite_db.queue()
    log = str(tmp_path / "starts.log")
    _start_runners(sqlite_db, procs, tmp_path, 3)
    n = 60
    queue.add_tasks([{"handler": SYNCED_AT_START, "data": {"log": log}} for _ in range(n)])
    wait_for(lambda: _succeeded() == n, timeout=120, message="%d runs to succeed" % n)
    starts = _records(log)
    assert len(starts) == n, procs.logs()
    assert len({s["pid"] for s in starts}) > 1, "one runner did all the work"
    for start in starts:
        assert start["ticket"] > 0, start
        assert start["synced"] >= start["ticket"], start
    queue.close()


@pytest.mark.timeout(240)
def test_one_fdatasync_covers_several_runners_commits(sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    _start_runners(sqlite_db, procs, tmp_path, 4)
    n = 400
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for _ in range(n)])
    wait_for(lambda: _succeeded() == n, timeout=180, message="%d runs to succeed" % n)
    # The runners stopped first: alive, one may be between a commit (a heartbeat) and its
    # sync when the counters are read (seen under load: 407 synced of 408 written). Once
    # they have exited, every commit any of them wrote must have been synced.
    for proc in procs.started:
        proc.send_signal(signal.SIGTERM)
    for proc in procs.started:
        assert procs.wait(proc) == 0, procs.logs([proc])
    written, synced, flushes = GroupSync(queue.store.db.database).counters()
    assert written >= n, (written, synced, flushes)
    assert synced == written, "a commit of a runner was left unsynced"
    assert 0 < flushes < written, (written, synced, flushes)
    queue.close()


@pytest.mark.timeout(180)
def test_a_runner_killed_holding_the_sync_locks_does_not_stop_the_others(sqlite_db, procs,
                                                                          tmp_path):
    queue = sqlite_db.queue()
    _start_runners(sqlite_db, procs, tmp_path, 2)
    held = str(tmp_path / "held.log")
    queue.add_task(HOLD, data={"log": held})
    holder = wait_for(lambda: _records(held), timeout=START_TIMEOUT,
                      message="a runner to hold the sync locks")[0]["held_by"]
    log = str(tmp_path / "records.log")
    n = 20
    queue.add_tasks([{"handler": RECORD, "data": {"log": log}} for _ in range(n)])
    # The other runner committed its claim and waits for the locks, its run not started.
    sync_file = queue.store.db.database + SUFFIX
    wait_for(lambda: _lock_waiters(sync_file), message="the other runner to wait for the sync")
    assert read_records(log) == []
    os.kill(holder, signal.SIGKILL)
    wait_for(lambda: len(read_records(log)) == n, timeout=60,
             message="the other runner to run the %d tasks" % n)
    assert holder not in {pid for _, _, pid in read_records(log)}
    queue.close()


def test_only_a_runners_store_in_full_mode_syncs_this_way(sqlite_db):
    app = sqlite_db.queue()
    app.add_task(RECORD, data={"log": os.devnull})
    # An application's store keeps SQLite's own sync of every commit.
    assert app.store.group_sync is None
    assert app.store.db.execute_sql("PRAGMA synchronous").fetchone()[0] == 2
    runner = Store(sqlite_db.config())
    assert runner.use_group_sync()
    assert runner.db.execute_sql("PRAGMA synchronous").fetchone()[0] == 1
    mode = os.stat(runner.db.database + SUFFIX).st_mode
    assert stat.S_IMODE(mode) == 0o600
    runner.close()
    for level in ("normal", "off"):
        store = Store(sqlite_db.config(database={"sqlite_synchronous": level}))
        assert not store.use_group_sync()
        store.close()
    app.close()


def _deleted_files_open(suffix):
    """This process's descriptors of deleted files whose name ends with `suffix`."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink("/proc/self/fd/" + fd))
        except FileNotFoundError:       # the listing's own descriptor, closed since
            pass
    return [link for link in links if link.endswith(suffix + " (deleted)")]


def test_a_commit_after_the_wal_was_deleted_syncs_the_new_wal(sqlite_db):
    store = Store(sqlite_db.config())
    assert store.use_group_sync()
    Queue = store.Queue
    store.write(lambda: Queue.insert(name="q", paused=False, updated_on=utcnow()).execute())

    def touch():
        store.write(lambda: Queue.update(updated_on=utcnow()).execute())
    wal = store.db.database + "-wal"
    touch()
    before = store.group_sync.counters()
    store.close()                       # the last connection: SQLite deletes the WAL
    assert not os.path.exists(wal)
    touch()
    assert os.path.exists(wal)
    written, synced, flushes = store.group_sync.counters()
    assert (written, synced, flushes) == (before[0] + 1, before[1] + 1, before[2] + 1)
    assert _deleted_files_open("-wal") == [], "the sync went to the deleted WAL"
    store.close()
