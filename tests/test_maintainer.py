"""The maintainer (overseer/maintainer.py): the queue pass, the periodic scheduler and
rotation run in a child of the overseer, so the overseer's own loop — signals, forks, reaps —
never waits on the database. Real overseer processes and real signals, sent to the whole
process group as supervisord and a terminal send them.

- another program holds SQLite's write lock: a stop sent to the group still ends the
  overseer within graceful_timeout (idle runners go at once, a busy one finishes its run);
- 10,000 periodic tasks due at once: a runner killed -9 during the scheduler's pass is
  replaced within two check intervals, and a stop is acted on at once;
- a maintainer killed -9 or hung (SIGSTOP) is replaced, and its successor keeps the lease,
  without stopping the overseer; a group stop stops it cleanly;
- the overseer's own statements give up on a held lock within their patience, on every
  backend; and, in this process with an injected clock, the maintainer holds no heartbeat
  against anyone until the database has been back for heartbeat_timeout.
"""
import os
import signal
import sqlite3
import time
from datetime import timedelta

import peewee as pw
import pytest

from conftest import START_TIMEOUT, Database, direct_only, wait_for, wait_started
from sample_handlers import read_records
from taskrunner.fleet import leadership, liveness
from taskrunner.host.hostlock import HostLock, HostLockBusy
from taskrunner.overseer.maintainer import Maintainer, MaintainerProcess
from taskrunner.periodic.definitions import check_periodic
from taskrunner.periodic.scheduler import add_periodic
from taskrunner.store.bound import BRIEF, Store
from taskrunner.store.models import (MAINTAINER, OVERSEER, RUNNING, SUCCESS, TIMEOUT, Runner,
                                     Task, utcnow)
from test_overseer import (MACHINE_SLACK, Overseers, is_gone, live_pids, maintainer_of,
                           overseer_row, overseer_toml, runner_rows, wait_up)
from test_runner_processes import waiting_in_select


@pytest.fixture
def overseers(sqlite_db, tmp_path):
    group = Overseers(sqlite_db, tmp_path)
    yield group
    group.kill_all()


def sqlite_path(database):
    return database.url[len("sqlite:///"):]


@pytest.mark.timing
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
    # Idle: in its wait, not still in its first look (a write that would wait busy_timeout
    # for the lock taken next, as any runner's write would).
    wait_for(lambda: waiting_in_select(idle_pid), timeout=5 + MACHINE_SLACK,
             message="the idle runner %d to wait" % idle_pid)

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
        assert idle_gone <= 2, "the idle runner took %.1fs\n%s" % (idle_gone, overseers.log())
        # The busy runner's handler ran to its end (its outcome waits for the database).
        assert [t for t, _, _ in read_records(log)] == [busy_task], overseers.log()
        assert all(is_gone(pid) for pid in live_pids(proc.pid))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    queue.close()


def add_due_periodic_tasks(queue, count):
    """`count` periodic tasks ("every 1h", Echo), every one due now: one definition checked
    as add_periodic checks it, then inserted in bulk (multi-row INSERTs)."""
    values, _ = check_periodic(queue.config, "burst", "taskrunner.handlers.Echo", "every 1h")
    now = utcnow()
    rows = [dict(values, name="burst-%05d" % n, nextrun=now - timedelta(seconds=1),
                 created=now - timedelta(hours=1), updated_on=now) for n in range(count)]
    PeriodicTask = queue.store.PeriodicTask
    with queue.store.db.atomic():
        for start in range(0, count, 500):
            PeriodicTask.insert_many(rows[start:start + 500]).execute()


def due_left(store):
    PeriodicTask = store.PeriodicTask
    return PeriodicTask.select().where((PeriodicTask.nextrun <= utcnow())
                                       & PeriodicTask.name.startswith("burst-")).count()


@pytest.mark.timeout(180)
def test_with_10000_periodic_tasks_due_a_killed_runner_is_replaced_and_a_stop_is_prompt(
        sqlite_db, overseers, tmp_path):
    """10,000 periodic tasks due at once: while the maintainer works through them, a runner
    killed -9 is marked dead and replaced within two check intervals, and a TERM to the
    group ends the overseer within graceful_timeout. (Before: the scheduler's pass ran in the
    overseer's loop for minutes; a dead runner was not noticed, nor a TERM acted on, until
    it ended.)"""
    check, graceful = 0.5, 5
    queue = sqlite_db.queue()
    add_due_periodic_tasks(queue, 10000)
    proc = overseers.start(overseers.config(limit=2, check_interval=check,
                                            graceful_timeout=graceful, heartbeat_interval=0.5))
    me = wait_up(overseers, proc, 2)
    wait_for(lambda: Task.select().where(Task.periodic_task_id.is_null(False)).count() >= 20,
             timeout=START_TIMEOUT, message="the scheduler's pass to be under way\n"
             + overseers.log())
    [victim] = [row for row in runner_rows(me.id)][:1]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()

    def replaced():
        rows = runner_rows(me.id)
        return Runner.get_by_id(victim.id).status == TIMEOUT and len(rows) == 2 \
            and sorted(r.pid for r in rows) == live_pids(proc.pid)
    wait_for(replaced, timeout=2 * check + MACHINE_SLACK, interval=0.02,
             message="the dead runner to be marked and replaced\n" + overseers.log())
    noticed = time.monotonic() - killed
    left = due_left(queue.store)
    print("replaced %.2fs after the kill; %d periodic tasks still due" % (noticed, left))
    assert left > 0, "the pass ended before the test could interrupt it"

    os.killpg(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    assert overseers.wait(proc, timeout=60) == 0, overseers.log()
    stopped = time.monotonic() - sent
    assert stopped <= graceful, "stopped %.1fs after TERM\n%s" % (stopped, overseers.log())
    assert due_left(queue.store) > 0, "the pass ended before the stop: it proves nothing"
    assert "maintainer" in overseers.log() and noticed <= 2 * check + MACHINE_SLACK
    queue.close()


def maintainer_row(process):
    return Runner.get_or_none((Runner.kind == MAINTAINER) & (Runner.pid == process.pid))


def lease_holder(store):
    [lease] = leadership.leases(store)
    return lease["holder_id"] if lease["held"] else None


@pytest.mark.timeout(120)
def test_a_maintainer_killed_or_hung_is_replaced_and_the_lease_follows(sqlite_db, overseers,
                                                                       tmp_path):
    """The maintainer killed -9: the overseer marks its row (which frees the lease) and
    starts another, which takes the lease over; the next one, stopped (SIGSTOP), is silent
    for heartbeat_timeout: KILLed and replaced. Meanwhile the overseer carries on, and the
    periodic scheduler with the lease. kill -9 of the overseer alone takes the maintainer
    along at once."""
    hung_after = 2
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    add_periodic(queue.store, "tick", "sample_handlers.Record", "every 1s", data={"log": log})
    proc = overseers.start(overseers.config(limit=1, check_interval=0.5, heartbeat_interval=0.5,
                                            heartbeat_timeout=hung_after))
    wait_up(overseers, proc, 1)

    def a_maintainer_holding_the_lease(not_pid=None):
        process = maintainer_of(proc.pid)
        if process is None or process.pid == not_pid:
            return None
        row = maintainer_row(process)
        return row is not None and lease_holder(queue.store) == row.id and (process, row)
    first, first_row = wait_for(a_maintainer_holding_the_lease, timeout=START_TIMEOUT,
                                message="a maintainer with the lease\n" + overseers.log())
    assert first.name() == "tr-maintainer" and os.getpgid(first.pid) == first.pid
    assert first_row.parent_id == overseer_row(proc).id

    os.kill(first.pid, signal.SIGKILL)
    second, _ = wait_for(lambda: a_maintainer_holding_the_lease(first.pid),
                         timeout=MaintainerProcess.RESTART_DELAY + MACHINE_SLACK,
                         message="the next maintainer with the lease\n" + overseers.log())
    dead = Runner.get_by_id(first_row.id)
    assert dead.status == TIMEOUT and "signal SIGKILL" in dead.exit_reason, dead.exit_reason

    os.kill(second.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    third, _ = wait_for(lambda: a_maintainer_holding_the_lease(second.pid),
                        timeout=hung_after + MaintainerProcess.RESTART_DELAY + MACHINE_SLACK,
                        message="the hung maintainer's successor\n" + overseers.log())
    assert time.monotonic() - stopped >= hung_after
    assert is_gone(second.pid)
    assert "hung: no sign of life" in proc.log_path.read_text()
    ticks = len(read_records(log))
    wait_for(lambda: len(read_records(log)) >= ticks + 2, timeout=START_TIMEOUT,
             message="the periodic task to go on\n" + overseers.log())
    assert proc.poll() is None, overseers.log()

    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: is_gone(third.pid), timeout=5, message="the maintainer to die with it")
    queue.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_sent_to_the_group_stops_the_maintainer_cleanly(signame, sqlite_db, overseers):
    """supervisord's stopasgroup, a terminal's Ctrl-C: the maintainer, in a process group of
    its own, is stopped by its overseer — it releases the lease, retires its row and exits
    0, before the overseer exits 0."""
    queue = sqlite_db.queue()
    proc = overseers.start(overseers.config(limit=1, check_interval=0.5))
    wait_up(overseers, proc, 1)
    process = wait_for(lambda: maintainer_of(proc.pid), timeout=START_TIMEOUT,
                       message="the maintainer")
    wait_for(lambda: lease_holder(queue.store), timeout=START_TIMEOUT, message="the lease")
    os.killpg(proc.pid, getattr(signal, signame))
    assert overseers.wait(proc) == 0, overseers.log()
    assert is_gone(process.pid)
    row = maintainer_row(process)
    assert (row.status, row.exit_reason) == (SUCCESS, "received SIGTERM"), overseers.log()
    assert lease_holder(queue.store) is None
    assert "Traceback" not in overseers.log() and "killing the maintainer" not in overseers.log()
    queue.close()


def test_after_losing_the_database_no_heartbeat_is_judged_for_heartbeat_timeout(tmp_path):
    """The maintainer's decisions tick by tick, in this process, with an injected clock: the
    server ends its session (a restart, a network cut); once its check gets through again, a
    heartbeat 300 s old is held against nobody until the database has been back for
    heartbeat_timeout (60 s) — nobody could write one meanwhile."""
    database = Database("postgresql", tmp_path)
    direct_only(database, "a server connection the server ends is replaced unseen; the "
                "client's is not cut")
    maintainer = Maintainer(database.config(overseer={"check_interval": 1}), None, os.getppid())
    try:
        database.queue()                       # binds the models to this database
        t0 = 1000.0
        maintainer.tick(t0)
        assert maintainer.lease.holding
        now = utcnow()
        row = Runner.create(host="elsewhere", boot_id="b", pid=1, pid_create_time=0,
                            started_on=now, heartbeat_on=now - timedelta(seconds=300), slot=1)
        pid = maintainer.store.db.execute_sql("SELECT pg_backend_pid()").fetchone()[0]
        with database.admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
        maintainer.tick(t0 + 1)
        assert maintainer.db_lost_at == t0 + 1      # the check met the dead session
        maintainer.tick(t0 + 2)
        assert maintainer.db_lost_at is None and maintainer.db_back_at is not None
        assert Runner.get_by_id(row.id).status == RUNNING
        maintainer.db_back_at = utcnow() - timedelta(seconds=61)    # back for heartbeat_timeout
        maintainer.tick(t0 + 3)
        assert Runner.get_by_id(row.id).status == TIMEOUT
    finally:
        maintainer.store.close()
        database.drop()


@pytest.mark.timing
def test_the_overseers_statements_give_up_on_a_held_lock_within_their_patience(database):
    """What the overseer writes itself goes through a bounded store (Store.bounded): with the
    row it writes locked by another transaction (SQLite: the database's write lock; then the
    host lock), the statement fails within about BRIEF instead of waiting for the lock — on
    every backend."""
    queue = database.queue()
    row = liveness.register(queue.store, kind=OVERSEER)
    other = Store(queue.config)
    bounded = queue.store.bounded()
    try:
        with other.db.atomic():
            # SQLite's transactions take the write lock up front (BEGIN IMMEDIATE).
            list(other.locked(other.Runner.select().where(other.Runner.id == row.id)))
            started = time.monotonic()
            with pytest.raises(pw.OperationalError):
                liveness.heartbeat(bounded, row.id)
            waited = time.monotonic() - started
        # MySQL's lock wait timeout is whole seconds: at least 1.
        assert waited < BRIEF + 1.5, "waited %.1fs for the lock" % waited
        if database.backend == "sqlite":
            with HostLock(bounded.db.database):
                started = time.monotonic()
                with pytest.raises(HostLockBusy):
                    liveness.heartbeat(bounded, row.id)
                assert time.monotonic() - started < BRIEF + 1.5
        assert liveness.heartbeat(bounded, row.id)       # free again: it goes through
    finally:
        bounded.close()
        other.close()
        queue.close()
