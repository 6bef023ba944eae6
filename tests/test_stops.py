"""Stops, crashes and timeouts as an operator meets them: the whole process group
signalled, a deploy followed by HUP, a run timed out by someone else, a hung runner.
Real processes and signals; see test_deploy.py for real supervisord."""
import collections
import gc
import os
import signal
import sys
import threading
import time
import uuid

import pytest

from taskrunner.handler import RunContext
from taskrunner.runs import lifecycle
from taskrunner.runs.lifecycle import ClaimedRun
from taskrunner.fleet import leadership, liveness
from taskrunner.runner.current import CurrentRun
from taskrunner.runner import loop
from taskrunner.store.models import (CANCELLED, REQUEUED, RUNNING, SCHEDULED, SUCCESS, TIMEOUT, Run,
                                     Runner,
                                     Task, utcnow)

from conftest import (REPO_DIR, START_TIMEOUT, TESTS_DIR, ok, runs_of, spawn, taskrunner, wait_for,
                      wait_started)
from sample_handlers import gate, read_records
from test_overseer import (MACHINE_SLACK, Overseers, fresh_overseers, group_members, is_gone,
                           overseer_toml, wait_up)


@pytest.fixture
def overseers(database_sp, tmp_path):
    group = Overseers(database_sp, tmp_path)
    yield group
    group.kill_all()


def timed(log):
    """Lines of sample_handlers.Timed: [(kind, task, run, pid, monotonic)]."""
    try:
        with open(log) as fh:
            return [(k, int(t), int(r), int(p), float(m)) for k, t, r, p, m in
                    (line.split() for line in fh if line.strip())]
    except FileNotFoundError:
        return []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_sent_to_the_whole_process_group_lets_runs_in_flight_finish(
        signame, database_sp, overseers, tmp_path):
    """supervisord's stopasgroup, systemd's control-group kill, a terminal's Ctrl-C: the stop
    reaches the overseer's whole group. The runs in flight end with their real outcome."""
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    ids = queue.add_tasks([{"handler": "sample_handlers.Started",
                            "data": {"log": log, "sleep": 2}} for _ in range(2)])
    proc = overseers.start(overseers.config(limit=2))
    wait_up(overseers, proc, 2)
    wait_started(log, count=2)
    os.killpg(proc.pid, getattr(signal, signame))
    assert overseers.wait(proc) == 0, overseers.log()
    assert [Task.get_by_id(i).last_status for i in ids] == [SUCCESS, SUCCESS], overseers.log()
    assert sorted(t for t, _, _ in read_records(log)) == sorted(ids)
    assert group_members(proc.pid) == []
    queue.close()


@pytest.mark.timeout(120)
def test_hup_with_the_readme_handler_pattern_does_not_spend_a_retry(database_sp, overseers,
                                                                    tmp_path):
    """A handler that returns early on should_stop() by raising TaskError, max_retries 1:
    a HUP (deploy) hands its run back instead of giving the task up."""
    queue = database_sp.queue()
    task_id = queue.add_task("taskrunner.handlers.Sleep", data={"seconds": 2}, max_retries=1)
    proc = overseers.start(overseers.config(limit=1))
    wait_up(overseers, proc, 1)
    wait_for(lambda: queue.status_of(task_id) == RUNNING, timeout=START_TIMEOUT,
             message="the run to start")
    first = runs_of(task_id)[0]
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: Task.get_by_id(task_id).last_status == SUCCESS, timeout=START_TIMEOUT,
             message="the task to succeed on a new runner")
    runs = runs_of(task_id)
    if runs[0].status == REQUEUED:        # stopped mid-run: handed back, then run again
        assert runs[0].error_code == "Stopped" and "Stopped" in runs[0].error_message
        assert [r.status for r in runs[1:]] == [SUCCESS]
    else:                                 # the HUP came as it was finishing
        assert [r.id for r in runs] == [first.id] and runs[0].status == SUCCESS
    task = Task.get_by_id(task_id)
    assert not task.given_up and task.runs_failed == 0
    assert proc.poll() is None
    queue.close()


def test_a_handler_can_snooze_without_counting_a_failure(sqlite_db):
    queue = sqlite_db.queue()
    task_id = queue.add_task("sample_handlers.Snooze", data={"times": 2}, max_retries=1)
    assert queue.run_pending() == 1
    [first] = runs_of(task_id)
    assert (first.status, first.error_code) == (REQUEUED, "Snoozed")
    assert "rate limited" in first.error_message
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed, task.finished_on) == (SCHEDULED, 0, None)
    assert task.next_run_on is not None          # 60 s from now: no run yet
    Task.update(next_run_on=first.finished_on).where(Task.id == task_id).execute()  # time passes
    assert queue.run_pending() == 1
    assert queue.get_task(task_id).status == SCHEDULED and len(runs_of(task_id)) == 2
    Task.update(next_run_on=first.finished_on).where(Task.id == task_id).execute()
    assert queue.run_pending() == 1
    assert [r.status for r in runs_of(task_id)] == [REQUEUED, REQUEUED, SUCCESS]
    assert queue.get_task(task_id).status == SUCCESS
    queue.close()


@pytest.mark.timing
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stubborn", [False, True], ids=["handler-returns", "handler-ignores"])
def test_a_run_timed_out_by_run_event_is_stopped_by_its_runner(stubborn, database_sp, procs,
                                                               tmp_path):
    """Rule 8 whoever marks the run: `run-event task-queue:OnProcess` times out a run that a
    standalone runner (no overseer) is executing. The runner interrupts the handler within
    about a heartbeat, or exits hard after kill_grace if the handler ignores that; the
    retry's execution never overlaps the first one for longer than kill_grace."""
    kill_grace, heartbeat = 1.0, 0.2
    queue = database_sp.queue()
    log = str(tmp_path / "timed")
    task_id = queue.add_task("sample_handlers.Timed", data={
        "log": log, "sleep": 30, "stubborn": stubborn}, run_timeout=1, max_retries=3)
    config = database_sp.write_config(tmp_path / "c.toml", (
        "[runner]\npoll_interval = 0.1\nheartbeat_interval = %s\n[overseer]\nkill_grace = %s\n"
        "[task]\nretry_backoff = 0.1\n" % (heartbeat, kill_grace)))
    first = procs.spawn("runner", config=config, name="first")
    wait_for(lambda: timed(log), timeout=START_TIMEOUT, message="the handler to start")
    wait_for(lambda: lifecycle.running_runs_query(queue.store).count() == 1, timeout=10,
             message="the run to be running")
    time.sleep(1.2)                         # run_timeout passes: no progress for 1 s
    ok(taskrunner("run-event", "task-queue:OnProcess", config=config))
    [run] = [r for r in runs_of(task_id) if r.status == TIMEOUT]
    marked = time.monotonic()
    # When the first runner exits, taken as it happens: the wait for the retry below can
    # outlast it on a loaded machine (CI: 7.1 s after the mark, the second runner still
    # starting).
    exited = []
    watcher = threading.Thread(target=lambda: exited.append((first.wait(), time.monotonic())),
                               daemon=True)
    watcher.start()
    procs.spawn("runner", config=config, name="second")
    wait_for(lambda: any(kind == "start" and r != run.id for kind, _, r, _, _ in timed(log)),
             timeout=START_TIMEOUT, message="the retry to start")
    [retry_start] = [m for kind, _, r, _, m in timed(log) if kind == "start" and r != run.id][:1]
    if stubborn:
        wait_for(lambda: exited, timeout=kill_grace + 2 * heartbeat + MACHINE_SLACK,
                 message="the first runner to exit hard")
        [(code, gone)] = exited
        assert code == 4, procs.logs([first])
        assert gone - marked <= kill_grace + 2 * heartbeat + MACHINE_SLACK
        assert "did not return within kill_grace" in procs.log(first)
    else:
        wait_for(lambda: any(kind == "stop" and r == run.id for kind, _, r, _, _ in timed(log)),
                 timeout=2 * heartbeat + MACHINE_SLACK,
                 message="the first handler to stop")
        [stopped] = [m for kind, _, r, _, m in timed(log) if kind == "stop" and r == run.id]
        assert stopped - marked <= 2 * heartbeat + MACHINE_SLACK
        assert first.poll() is None, "a runner whose handler returned carries on"
        assert stopped - retry_start <= kill_grace, "two executions overlapped"
    assert Run.get_by_id(run.id).status == TIMEOUT    # the late outcome changed nothing (rule 4)
    queue.close()


def watched_signals(worker):
    """The SIGUSR2s the heartbeat's check of the current run sent this process (the signal a
    runner's heartbeat interrupts its run with)."""
    signals = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: signals.append(signum))
    try:
        worker.heartbeat.watch_current_run()
    finally:
        signal.signal(signal.SIGUSR2, previous)
    return signals


def test_a_run_ending_as_the_heartbeat_checks_it_does_not_get_the_next_run_interrupted(
        sqlite_db, monkeypatch):
    """The heartbeat thread asks whether the run in hand was taken away just as the runner
    ends it by itself and starts the next one: the answer ("no longer running") is about a
    run that is gone, and must not interrupt the next. (Seen with three runners on
    PostgreSQL: a run ended `timeout` "interrupted: run 16 was ended by someone else".) The
    switch is made to happen inside that question, on the real database."""
    queue = sqlite_db.queue()
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for _ in range(2)])
    worker = loop.Runner(queue.store)
    worker.runner_id = liveness.register(queue.store).id
    first = lifecycle.claim(queue.store, worker.runner_id)
    first_run = worker.current = CurrentRun(first)
    asked = lifecycle.taken_away_on

    def the_runner_moves_on_meanwhile(store, run_id, runner_id):
        first_run.close()                               # its handler returned
        ended, following = lifecycle.end_run_and_claim(store, first.run_id, first.task_id,
                                                       SUCCESS, worker.runner_id)
        assert ended and following is not None
        worker.current = CurrentRun(following)
        return asked(store, run_id, runner_id)
    monkeypatch.setattr(lifecycle, "taken_away_on", the_runner_moves_on_meanwhile)
    signals = watched_signals(worker)
    assert (first_run.abort_reason, worker.current.abort_reason, signals) == (None, None, [])
    queue.close()


def test_a_cancel_racing_the_switch_to_the_next_run_never_lands_on_it(database, monkeypatch):
    """An operator cancels run A as it finishes. The heartbeat reads A "still running,
    cancel requested" just before the runner ends A by itself and starts B: the switch is
    made to happen inside that read, with the runner's own execute() in a thread of its own
    on the real database. The cancel is about A: A ends success (it had finished) or
    cancelled, and B, which nobody cancelled, ends success. (Seen: B ended `cancelled`.)"""
    queue = database.queue()
    name = uuid.uuid4().hex
    a, b = queue.add_tasks([{"handler": "sample_handlers.Gated", "data": {"name": name + n},
                             "priority": p} for n, p in (("a", 1), ("b", 0))])
    (a_started, a_go), (b_started, b_go) = gate(name + "a"), gate(name + "b")
    worker = loop.Runner(queue.store, memory_limit=False)
    worker.runner_id = liveness.register(queue.store).id
    first = lifecycle.claim(queue.store, worker.runner_id)
    assert first.task_id == a

    def runner():          # the runner's main thread: A, then B claimed with A's end
        following = worker.execute(first, claim_next=True)
        assert following is not None and following.task_id == b
        worker.execute(following)
    thread = threading.Thread(target=runner, name="runner")
    thread.start()
    try:
        assert a_started.wait(30)
        queue.cancel(a)
        asked = lifecycle.taken_away_on

        def the_runner_moves_on_meanwhile(store, run_id, runner_id):
            answer = asked(store, run_id, runner_id)
            assert answer == (None, True)            # A: running here, cancel requested
            a_go.set()
            assert b_started.wait(30), "the runner did not start B"
            return answer
        monkeypatch.setattr(lifecycle, "taken_away_on", the_runner_moves_on_meanwhile)
        signals = watched_signals(worker)
    finally:
        a_go.set()
        b_go.set()
        thread.join(30)
    assert not thread.is_alive()
    [run_a], [run_b] = runs_of(a), runs_of(b)
    assert run_a.status in (SUCCESS, CANCELLED)
    assert (run_b.status, run_b.error_code, run_b.error_message) == (SUCCESS, None, None)
    assert signals == []
    queue.close()


@pytest.fixture
def pg_overseers(tmp_path):
    """Overseers sharing a fresh PostgreSQL database (two hosts' overseers, on one machine)."""
    with fresh_overseers("postgresql", tmp_path) as group:
        yield group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stubborn", [False, True], ids=["handler-returns", "handler-ignores"])
def test_a_run_timed_out_by_a_second_overseer_is_stopped_by_its_runner(stubborn, pg_overseers,
                                                                       tmp_path):
    """Rule 8 across overseers: overseer A's runner executes a run; overseer B (another
    host's, sharing the database; here on the same machine) times it out (run_timeout) —
    A checks only every 60 s and never sees it overdue. A's runner interrupts the handler
    within about a heartbeat (or exits hard after kill_grace when the handler ignores the
    interruption), and the retry, claimed at once by A's other runner, never overlaps the
    first execution for longer than kill_grace."""
    kill_grace, heartbeat = 1.0, 0.2
    database = pg_overseers.database
    queue = database.queue()
    log = str(tmp_path / "timed")
    task_id = queue.add_task("sample_handlers.Timed", data={
        "log": log, "sleep": 30, "stubborn": stubborn}, run_timeout=1, max_retries=3)

    def config(name, check_interval):
        return database.write_config(tmp_path / name, overseer_toml(
            limit=2, check_interval=check_interval, kill_grace=kill_grace,
            heartbeat_interval=heartbeat))
    a = pg_overseers.start(config("a.toml", 60))
    wait_up(pg_overseers, a, 2)
    wait_for(lambda: timed(log), timeout=START_TIMEOUT, message="the handler to start")
    [(_, _, run_id, victim, first_start)] = timed(log)
    # A, checking every 60 s, holds the maintenance lease (for 180 s) once its maintainer's
    # first check has taken it: end it then as if it had expired, so that B becomes the
    # holder that does the fleet's work (leadership.py).
    wait_for(lambda: any(lease["held"] for lease in leadership.leases(queue.store)),
             timeout=START_TIMEOUT, message="A's maintainer to take the lease")
    queue.store.Lease.update(expires_on=queue.store.server_time(-1)).execute()
    b = pg_overseers.start(config("b.toml", 0.2))    # the host's slots are taken: no runner

    def marked():
        run = Run.get_by_id(run_id)
        return run.status == TIMEOUT and run
    run = wait_for(marked, timeout=START_TIMEOUT, message="overseer B to time the run out")
    marked_at = time.monotonic() - (utcnow() - run.finished_on).total_seconds()
    assert run.error_code == "RunTimeout"
    assert "timed out: no update" in pg_overseers.log(b), pg_overseers.log()
    assert "timed out: no update" not in pg_overseers.log(a), pg_overseers.log()

    def retry_start():
        return [m for kind, _, r, _, m in timed(log) if kind == "start" and r != run_id][:1]
    [second_start] = wait_for(retry_start, timeout=START_TIMEOUT, message="the retry to start")
    if stubborn:
        wait_for(lambda: is_gone(victim), timeout=kill_grace + 2 * heartbeat + MACHINE_SLACK,
                 interval=0.01, message="the first runner to exit hard")
        first_end = time.monotonic()
        assert "did not return within kill_grace" in pg_overseers.log(a)
        assert first_end - marked_at <= kill_grace + 2 * heartbeat + MACHINE_SLACK
    else:
        def stopped():
            return [m for kind, _, r, _, m in timed(log) if kind == "stop" and r == run_id]
        [first_end] = wait_for(stopped, timeout=2 * heartbeat + MACHINE_SLACK,
                               message="the first handler to stop")
        assert first_end - marked_at <= 2 * heartbeat + MACHINE_SLACK
        assert not is_gone(victim), "a runner whose handler returned carries on"
    overlap = first_end - second_start
    print("rule 8 by a second overseer (%s): interrupted %.3fs after being marked, "
          "executions overlapped %.3fs" % ("stubborn" if stubborn else "returns",
                                           first_end - marked_at, max(0.0, overlap)))
    assert first_start < marked_at
    assert overlap <= kill_grace, "two executions of task %d overlapped" % task_id
    assert Run.get_by_id(run_id).status == TIMEOUT
    assert a.poll() is None and b.poll() is None
    queue.close()


@pytest.mark.timeout(120)
def test_after_hup_runners_run_the_handler_code_on_disk(sqlite_db, tmp_path):
    """A deploy adds a handler class, then HUP: runners forked after it import the new code
    (the overseer itself imports no handler module, even to check periodic tasks)."""
    package = tmp_path / "pkg"
    package.mkdir()
    module = package / "deploy_jobs.py"
    module.write_text("from taskrunner import TaskHandler\n\n"
                      "class Old(TaskHandler):\n    def handle(self, run):\n"
                      "        run.results = 'old'\n")
    queue = sqlite_db.queue()
    config = sqlite_db.write_config(tmp_path / "c.toml", (
        "[runner]\nlimit = 1\npoll_interval = 0.1\n[overseer]\ncheck_interval = 1\n"
        "[[periodic]]\nname = \"nightly\"\nhandler = \"deploy_jobs.Old\"\ntimer = \"daily\"\n"))
    env = {"PYTHONPATH": os.pathsep.join([str(package), TESTS_DIR, REPO_DIR])}
    log_path = tmp_path / "overseer.log"
    overseers = Overseers(sqlite_db, tmp_path)
    proc = spawn("overseer", config=config, env=env, log_path=log_path)
    overseers.started.append(proc)
    proc.log_path = log_path
    try:
        _hup_then_new_code(queue, overseers, proc, module, package, log_path, tmp_path)
    finally:
        overseers.kill_all()
    queue.close()


def _hup_then_new_code(queue, overseers, proc, module, package, log_path, tmp_path):
    wait_up(overseers, proc, 1)
    old = queue.add_task("sample_handlers.Record", data={"log": str(tmp_path / "r")})
    wait_for(lambda: Task.get_by_id(old).last_status == SUCCESS, timeout=START_TIMEOUT,
             message="a first task")
    module.write_text(module.read_text() + "\n\nclass New(TaskHandler):\n"
                      "    def handle(self, run):\n        run.results = 'new'\n")
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "replacing runners" in log_path.read_text(), timeout=START_TIMEOUT,
             message="the reload")
    sys.path.insert(0, str(package))
    try:
        new = queue.add_task("deploy_jobs.New")
    finally:
        sys.path.remove(str(package))
    wait_for(lambda: Task.get_by_id(new).finished_on, timeout=START_TIMEOUT,
             message="the task of the new handler to end")
    assert (Task.get_by_id(new).last_status, runs_of(new)[-1].results) == (SUCCESS, '"new"'), \
        overseers.log()


@pytest.mark.timeout(120)
def test_a_hung_runner_is_noticed_by_its_heartbeat_and_killed_with_its_subprocesses(
        sqlite_db, overseers, tmp_path):
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.Subprocess", data={"log": log})
    config = sqlite_db.write_config(tmp_path / "c.toml", (
        "[runner]\nlimit = 1\npoll_interval = 0.1\nheartbeat_interval = 0.2\n"
        "[overseer]\ncheck_interval = 0.5\nheartbeat_timeout = 2\n[task]\nretry_backoff = 60\n"))
    proc = overseers.start(config)
    wait_up(overseers, proc, 1)
    [(_, _, runner_pid, child_pid)] = wait_for(lambda: read_records(log + ".started"),
                                               timeout=START_TIMEOUT, message="the subprocess")
    os.kill(runner_pid, signal.SIGSTOP)       # alive, but hung
    stopped = time.monotonic()
    wait_for(lambda: is_gone(runner_pid), timeout=2 + 2 * 0.5 + MACHINE_SLACK,
             message="the hung runner to be killed")
    assert time.monotonic() - stopped <= 2 + 2 * 0.5 + MACHINE_SLACK
    wait_for(lambda: is_gone(child_pid), timeout=5, message="its handler's subprocess to go too")
    # The overseer kills a hung runner first (on SQLite it may hold the write lock), then
    # marks its row: wait for the mark.
    row = wait_for(lambda: Runner.get_or_none((Runner.pid == runner_pid)
                                              & (Runner.status == TIMEOUT)), timeout=10,
                   message="the hung runner's row to be marked")
    assert "hung" in row.exit_reason
    run = runs_of(task_id)[0]
    assert (run.status, run.error_code) == (TIMEOUT, "RunnerDied")
    assert proc.poll() is None
    queue.close()


@pytest.mark.timeout(120)
def test_a_stopped_runner_whose_run_timed_out_is_killed_after_kill_grace(overseers, tmp_path):
    """Rule 8 with a runner that cannot act (SIGSTOP): its run is timed out by the fleet's
    pass, and its overseer's maintainer kills it once kill_grace has passed, long before
    heartbeat_timeout would call it hung. Seen: the frozen child lived 60.8 s, its slot
    blocked, after rule 8 moved into the runner."""
    queue = overseers.database.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.Subprocess", data={"log": log}, run_timeout=3,
                             max_retries=1)
    proc = overseers.start(overseers.config(limit=1, check_interval=0.5, kill_grace=2,
                                            heartbeat_interval=0.5, heartbeat_timeout=60))
    wait_up(overseers, proc, 1)
    [(_, run_id, runner_pid, child_pid)] = wait_for(
        lambda: read_records(log + ".started"), timeout=START_TIMEOUT, message="the subprocess")
    os.kill(runner_pid, signal.SIGSTOP)       # it can no longer enforce rule 8 itself
    wait_for(lambda: Run.get_by_id(run_id).status == TIMEOUT, timeout=3 + 2 + MACHINE_SLACK,
             message="the run to time out")
    timed_out = time.monotonic()
    wait_for(lambda: is_gone(runner_pid), timeout=30, message="the stopped runner to be killed")
    assert time.monotonic() - timed_out <= 2 + 2 * 0.5 + MACHINE_SLACK, overseers.log()
    wait_for(lambda: is_gone(child_pid), timeout=5, message="its handler's subprocess to go too")
    row = wait_for(lambda: Runner.get_or_none((Runner.pid == runner_pid)
                                              & (Runner.status == TIMEOUT)), timeout=10,
                   message="the stopped runner's row to be marked")
    # Marked by the maintainer that killed it, or by its overseer that reaped it first.
    assert "kill_grace" in row.exit_reason or "SIGKILL" in row.exit_reason, row.exit_reason
    assert Run.get_by_id(run_id).error_code == "RunTimeout"
    wait_up(overseers, proc, 1)               # its slot is free again: a new runner took it
    assert proc.poll() is None
    queue.close()


@pytest.mark.timeout(120)
def test_a_periodic_task_that_cannot_be_submitted_does_not_stop_the_overseer(tmp_path, procs):
    """A 250-character name slipped past the checks (an older version, a manual INSERT):
    'periodic:' + name does not fit queued_by. The overseer logs it, records the error on
    that periodic task, keeps going, and serves the other periodic tasks."""
    from conftest import Database
    database = Database("postgresql", tmp_path)
    try:
        queue = database.queue()
        from taskrunner.periodic.scheduler import add_periodic
        add_periodic(queue.store, "fine", "taskrunner.handlers.Echo", "every 1s")
        add_periodic(queue.store, "x" * 200, "taskrunner.handlers.Echo", "every 1s")
        from taskrunner.store.models import PeriodicTask
        PeriodicTask.update(name="y" * 250).where(PeriodicTask.name == "x" * 200).execute()
        config = database.write_config(tmp_path / "c.toml", "[runner]\nlimit = 1\n")
        proc = procs.spawn("overseer", config=config, name="overseer")
        wait_for(lambda: PeriodicTask.get(PeriodicTask.name == "fine").submitted_count >= 3,
                 timeout=START_TIMEOUT, message="the good periodic task to keep submitting")
        bad = PeriodicTask.get(PeriodicTask.name == "y" * 250)
        assert bad.last_status == "error" and bad.submitted_count == 0
        assert proc.poll() is None, procs.logs()
        assert "not submitted" in procs.log(proc)
        proc.send_signal(signal.SIGTERM)
        assert procs.wait(proc) == 0
        queue.close()
    finally:
        database.drop()


def test_a_periodic_name_too_long_for_its_derived_values_is_refused(sqlite_db):
    from taskrunner import InputError
    from taskrunner.periodic.scheduler import MAX_NAME, add_periodic
    queue = sqlite_db.queue()
    with pytest.raises(InputError, match="longer than %d" % MAX_NAME):
        add_periodic(queue.store, "n" * (MAX_NAME + 1), "taskrunner.handlers.Echo", "daily")
    add_periodic(queue.store, "n" * MAX_NAME, "taskrunner.handlers.Echo", "daily")
    queue.close()


@pytest.mark.timeout(120)
def test_a_run_found_crashed_at_overseer_start_waits_crash_grace(sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 60})
    config = sqlite_db.write_config(tmp_path / "c.toml", (
        "[runner]\nlimit = 1\npoll_interval = 0.1\n[overseer]\ncrash_grace = 3600\n"
        "[task]\nretry_backoff = 0\n"))
    runner = procs.spawn("runner", config=config, name="runner")
    [(_, run_id, pid)] = wait_started(log)
    os.kill(pid, signal.SIGKILL)                 # the host went down with it, say
    runner.wait(10)
    overseer = procs.spawn("overseer", config=config, name="overseer")
    wait_for(lambda: Run.get_by_id(run_id).status == TIMEOUT, timeout=START_TIMEOUT,
             message="the sweep at start")
    task = Task.get_by_id(task_id)
    assert task.crash_count == 1 and task.runs_failed == 1
    wait = (task.next_run_on - Run.get_by_id(run_id).finished_on).total_seconds()
    assert 3599 <= wait <= 3601, wait
    assert len(runs_of(task_id)) == 1            # no retry run before crash_grace
    overseer.send_signal(signal.SIGTERM)
    assert procs.wait(overseer) == 0
    queue.close()


def test_a_run_leaves_no_cycle_for_the_garbage_collector(database):
    """What a runner makes for each run (its CurrentRun, the handler's RunContext and the
    callbacks between them) is freed when the run ends, by reference counting: a busy
    runner's garbage collector finds none of it. (Seen: 14 objects of every run left in a
    cycle, and twice the collections of a runner without them.)"""
    queue = database.queue()
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "data": {"n": n}}
                     for n in range(30)])
    worker = loop.Runner(queue.store, memory_limit=False)
    worker.runner_id = liveness.register(queue.store).id
    claimed, done = lifecycle.claim(queue.store, worker.runner_id), 0
    gc.collect()
    gc.disable()
    try:
        while claimed is not None:
            claimed = worker.execute(claimed, claim_next=True)
            done += 1
        gc.set_debug(gc.DEBUG_SAVEALL)       # what a collection finds stays in gc.garbage
        gc.collect()
        in_cycles = collections.Counter(type(o).__name__ for o in gc.garbage if isinstance(
            o, (CurrentRun, RunContext, ClaimedRun)))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert done == 30
    assert in_cycles == {}, "left in cycles by %d runs: %s" % (done, dict(in_cycles))
    queue.close()
