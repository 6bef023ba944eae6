"""Idle runners are woken when work arrives instead of waiting out their poll interval:
a same-host socket on every database, and LISTEN/NOTIFY across hosts on PostgreSQL."""
import contextlib
import os
import shutil
import signal
import threading
import time

import pytest

from conftest import direct_only, spawn, stop_process, wait_for
from sample_handlers import read_records
from taskrunner.host import wakeup
from taskrunner.runner import loop
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


class _Observed(loop.Runner):
    """A standalone runner for a thread of the test. `after_look(worker)` runs once on the
    runner's thread right after its first idle look (it finds nothing): what another host
    does in that instant. `waits`: its connection's backend PID at each idle wait."""

    def __init__(self, store, after_look=None):
        super().__init__(store, install_signals=False, memory_limit=False)
        self.after_look, self.idle, self.waits = after_look, False, []

    def _idle(self, standalone):
        self.idle = True
        return super()._idle(standalone)

    def _look(self):
        work = super()._look()
        if self.idle and self.after_look is not None:   # not the look before its first claim
            act, self.after_look = self.after_look, None
            assert not work
            act(self)
        return work

    def _wait(self, timeout):
        self.waits.append(self.store.db.connection().info.backend_pid)
        super()._wait(timeout)


@contextlib.contextmanager
def _woken_from_another_host(tmp_path, request, after_look=None):
    """An idle standalone runner on PostgreSQL (poll interval 30 s) in a thread, and
    add(), which queues a task from "another host" (a wake-up directory of its own: only
    NOTIFY can reach the runner). Yields (runner, add); the task add() queued must start
    within 10 s. `after_look(runner, add)`: see _Observed."""
    from conftest import Database
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    direct_only(database, "no LISTEN through the pooler")
    here = database.queue(runner={"poll_interval": 30, "wakeup_dir": str(tmp_path / "here")})
    there = database.queue(runner={"wakeup_dir": str(tmp_path / "there")})
    log = str(tmp_path / "records")
    added = []

    def add():
        added.append(there.add_task("sample_handlers.Record", data={"log": log}))

    runner = _Observed(here.store, after_look and (lambda worker: after_look(worker, add)))
    thread = threading.Thread(target=runner.work, kwargs={"max_runs": 1}, daemon=True)
    thread.start()
    try:
        yield runner, add
        wait_for(lambda: read_records(log), timeout=10,
                 message="the runner to be woken for the task added on another host")
        assert [task for task, _, _ in read_records(log)] == added
    finally:
        runner.stop_reason = runner.stop_reason or "the test is over"
        here.wake()
        thread.join(30)
        here.close()
        there.close()
    assert not thread.is_alive()


@pytest.mark.timeout(90)
def test_an_idle_runner_listens_again_after_its_connection_was_terminated(tmp_path, request):
    """A restart or a network cut ends the idle runner's session and its LISTEN with it: the
    runner reconnects and LISTENs again, so NOTIFY (another host's work) still wakes it."""
    with _woken_from_another_host(tmp_path, request) as (runner, add):
        first = wait_for(lambda: runner.waits and runner.waits[-1],
                         message="the runner to wait idle")
        # (on a connection of the test's thread)
        assert runner.store.db.execute_sql("SELECT pg_terminate_backend(%s)",
                                           (first,)).fetchone()[0]
        wait_for(lambda: runner.waits[-1] != first,
                 message="the runner to wait again on a new connection")
        add()


@pytest.mark.timeout(60)
def test_a_task_committed_between_the_idle_runners_look_and_its_wait_wakes_it(tmp_path,
                                                                               request):
    """The runner LISTENs before it looks, not after: a NOTIFY committed right after the
    look is not lost (CI: test_transactional's committed task waited out the 30 s poll)."""
    with _woken_from_another_host(tmp_path, request, lambda runner, add: add()):
        pass


@pytest.mark.timeout(60)
def test_a_notify_that_arrives_during_another_query_of_the_runner_still_wakes_it(tmp_path,
                                                                                  request):
    """A NOTIFY that reaches the runner's connection while it waits for a query's result is
    read by psycopg with that result, so the socket the runner then waits on stays quiet:
    the runner must see it before it blocks."""
    def during_a_query(runner, add):
        later = threading.Timer(0.3, add)
        later.start()
        runner.store.db.execute_sql("SELECT pg_sleep(1)")
        later.join()
    with _woken_from_another_host(tmp_path, request, during_a_query):
        pass
