"""Idle runners are woken when work arrives instead of waiting out their poll interval:
a same-host socket on every database, and LISTEN/NOTIFY across hosts on PostgreSQL."""
import os
import shutil
import signal
import time

import pytest

from conftest import direct_only, spawn, stop_process, wait_for
from sample_handlers import read_records
from taskrunner.host import wakeup
from taskrunner.store.models import RUNNING, Runner


def _idle_runner(database, tmp_path):
    config = database.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 60\n")
    proc = spawn("runner", config=config, log_path=tmp_path / "runner.log")
    queue = database.queue()
    wait_for(lambda: Runner.select().where(Runner.status == RUNNING).count() == 1,
             message="the runner to register")
    # Once registered it claims, finds nothing and waits: give it a moment to get there.
    directory = wakeup.directory(database.url)
    wait_for(lambda: os.path.isdir(directory) and os.listdir(directory), message="its socket")
    return proc, queue


def _assert_woken(database, tmp_path, before_add=None):
    """An idle runner (poll interval 60 s) starts a task added now within a few seconds."""
    proc, queue = _idle_runner(database, tmp_path)
    try:
        time.sleep(0.5)  # let the runner settle into its 60 s wait; correctness does not depend on it
        if before_add is not None:
            before_add()
        log = str(tmp_path / "records")
        started = time.monotonic()
        queue.add_task("sample_handlers.Record", data={"log": log})
        wait_for(lambda: read_records(log), timeout=10, message="the task to run")
        # Far below the 60 s poll interval: it was woken, not polling.
        assert time.monotonic() - started < 5
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        stop_process(proc)


@pytest.mark.timeout(90)
def test_idle_runner_starts_new_task_at_once(database, tmp_path):
    _assert_woken(database, tmp_path)


@pytest.mark.timeout(90)
def test_postgres_notify_wakes_runners_without_the_local_socket(tmp_path, request):
    from conftest import Database
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    direct_only(database, "no LISTEN through the pooler")
    # As if the task came from another host: no local wake-up can reach the runner.
    _assert_woken(database, tmp_path,
                  before_add=lambda: shutil.rmtree(wakeup.directory(database.url)))


@pytest.mark.timeout(90)
def test_an_idle_runner_listens_again_after_its_connection_was_terminated(tmp_path, request):
    """A restart or a network cut ends the idle runner's session and its LISTEN with it: the
    runner reconnects and LISTENs again, so NOTIFY (another host's work) still wakes it."""
    from conftest import Database
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    direct_only(database, "no LISTEN through the pooler")
    listening = ("SELECT pid FROM pg_stat_activity WHERE datname = %s AND query = %s "
                 "AND pid <> pg_backend_pid()")
    args = (database.name, "LISTEN %s" % wakeup.CHANNEL)

    def listeners():
        with database.admin.cursor() as cur:
            cur.execute(listening, args)
            return [row[0] for row in cur.fetchall()]

    def cut():
        shutil.rmtree(wakeup.directory(database.url))
        [first] = wait_for(listeners, message="the runner to LISTEN")
        with database.admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (first,))
        wait_for(lambda: [pid for pid in listeners() if pid != first],
                 message="the runner to LISTEN on a new connection")
    _assert_woken(database, tmp_path, before_add=cut)
