"""The maintainer (overseer/maintainer.py): the queue pass, the periodic scheduler and
rotation run in a child of the overseer, so the overseer's own loop — signals, forks, reaps —
never waits on the database. Real overseer processes and real signals, sent to the whole
process group as supervisord and a terminal send them.

- another program holds SQLite's write lock: a stop sent to the group still ends the
  overseer within graceful_timeout (idle runners go at once, a busy one finishes its run);
- 10,000 periodic tasks due at once: a runner killed -9 during the scheduler's pass is
  replaced within two check intervals, and a stop is acted on at once;
- a maintainer killed -9 or hung (SIGSTOP) is replaced, and its successor keeps the lease,
  without stopping the overseer.
"""
import os
import signal
import sqlite3
import time

import pytest

from conftest import START_TIMEOUT, wait_for, wait_started
from sample_handlers import read_records
from taskrunner.store.models import RUNNER, RUNNING, SUCCESS, TIMEOUT, Run, Runner, Task
from test_overseer import MACHINE_SLACK, Overseers, is_gone, live_pids, overseer_toml, wait_up


@pytest.fixture
def overseers(sqlite_db, tmp_path):
    group = Overseers(sqlite_db, tmp_path)
    yield group
    group.kill_all()


def sqlite_path(database):
    return database.url[len("sqlite:///"):]


@pytest.mark.timeout(120)
def test_a_group_stop_while_another_program_holds_sqlites_lock_ends_within_graceful_timeout(
        sqlite_db, overseers, tmp_path):
    """Another program takes SQLite's write lock (BEGIN IMMEDIATE) and keeps it for 60 s;
    then the overseer's process group gets TERM. The idle runner exits at once, the busy one
    finishes its run (its handler returns), and the overseer exits 0 within graceful_timeout
    plus 2 s — while the lock is still held. (Before: every check of the overseer waited
    busy_timeout for the lock, the idle runner waited behind it and was KILLed at
    graceful_timeout, and the overseer exited long after.)"""
    graceful = 4
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    busy_task = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 2})
    # busy_timeout (the [database] table the file starts with) as in the report.
    config = sqlite_db.write_config(tmp_path / "c.toml", "busy_timeout = 5\n" + overseer_toml(
        limit=2, check_interval=0.5, graceful_timeout=graceful, kill_grace=1,
        heartbeat_interval=0.5))
    proc = overseers.start(config)
    wait_up(overseers, proc, 2)
    [(_, _, busy_pid)] = wait_started(log)
    [idle_pid] = [pid for pid in live_pids(proc.pid) if pid != busy_pid]

    holder = sqlite3.connect(sqlite_path(sqlite_db), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        os.killpg(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        wait_for(lambda: is_gone(idle_pid), timeout=2 + MACHINE_SLACK,
                 message="the idle runner to exit\n" + overseers.log())
        idle_gone = time.monotonic() - sent
        code = overseers.wait(proc, timeout=60)
        elapsed = time.monotonic() - sent
        assert code == 0, overseers.log()
        assert elapsed <= graceful + 2, "exited %.1fs after TERM (graceful_timeout %gs)\n%s" % (
            elapsed, graceful, overseers.log())
        assert idle_gone <= 2, "the idle runner took %.1fs" % idle_gone
        # The busy runner's handler ran to its end (its outcome waits for the database).
        assert [t for t, _, _ in read_records(log)] == [busy_task], overseers.log()
        assert all(is_gone(pid) for pid in live_pids(proc.pid))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    queue.close()
