"""Real runner processes against real databases: many runners sharing a queue, signals,
kill -9 and the overseer's sweep, the host limit (rule 5), bad runs, and recycling.

Every test starts `taskrunner` processes (conftest's `spawn`) and reads the outcome both from
the database and from a file the handlers append to outside it (`sample_handlers`), so "ran
exactly once" is counted independently of what the runners recorded.
"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import START_TIMEOUT, process_env, runs_of, taskrunner, wait_for, wait_started
from sample_handlers import read_records
from taskrunner.fleet.liveness import default_host_id as hostname
from taskrunner.store.models import (ERROR, REQUEUED, RUNNING, SCHEDULED, SUCCESS, TIMEOUT, Run,
                                     Runner, Task)
from taskrunner.runner import loop

# Generous but finite: the machine is shared and has two cores.
EXIT_TIMEOUT = 30.0


# -- helpers ------------------------------------------------------------------------------

def config_file(database, tmp_path, runner="", task="retry_backoff = 0", poll_interval=0.1):
    """A config with a short poll interval (and no retry backoff) plus the given keys."""
    return database.write_config(
        tmp_path / "c.toml",
        "[runner]\npoll_interval = %s\n%s\n[task]\n%s\n" % (poll_interval, runner, task))


def runner_row(pid):
    return Runner.get_or_none(Runner.pid == pid)


def wait_registered(proc, procs, timeout=START_TIMEOUT):
    """The runner row of `proc` once it has registered (fail if the process exits first)."""
    def registered():
        if proc.poll() is not None:
            raise AssertionError("pid %d exited %s before registering\n%s"
                                 % (proc.pid, proc.returncode, procs.logs([proc])))
        return runner_row(proc.pid)
    return wait_for(registered, timeout=timeout, message="runner %d to register" % proc.pid)


def waiting_in_select(pid):
    """True while the process's main thread sleeps in select()/poll() — the idle wait.
    When the kernel hides wchan, say True: the test then only loses precision."""
    try:
        with open("/proc/%d/wchan" % pid) as fh:
            wchan = fh.read().strip()
    except OSError:
        return True
    return wchan in ("", "0") or "poll" in wchan or "select" in wchan


def running_runners_here():
    return Runner.select().where((Runner.status == RUNNING) & (Runner.host == hostname()))


# -- 1. many tasks, several runners --------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_2000_tasks_4_runners_each_succeeds_exactly_once(database, procs, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    task_ids = queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                                for _ in range(2000)])
    config = config_file(database, tmp_path)

    runners = [procs.spawn("runner", "--burst", config=config) for _ in range(4)]
    for proc in runners:
        assert procs.wait(proc, timeout=180) == 0, procs.logs([proc])

    records = read_records(log)
    recorded_tasks = [task for task, _, _ in records]
    recorded_runs = [run for _, run, _ in records]
    assert sorted(recorded_tasks) == sorted(task_ids), "some task ran twice or never"
    assert len(set(recorded_runs)) == len(recorded_runs) == 2000

    assert Task.select().where(Task.last_status != SUCCESS).count() == 0
    runs = list(Run.select(Run.id, Run.task_id, Run.status, Run.runner_id))
    assert len(runs) == 2000
    assert len({run.task_id for run in runs}) == 2000, "a task has more than one run"
    assert {run.status for run in runs} == {SUCCESS}
    assert sorted(run.id for run in runs) == sorted(recorded_runs)
    assert len({run.runner_id for run in runs}) > 1, "one runner did everything"
    assert len({pid for _, _, pid in records}) > 1
    assert {r.status for r in Runner.select()} == {SUCCESS}
    queue.close()


# -- 2. signals -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_to_a_busy_runner_finishes_the_run_and_exits_0(signame, sqlite_db, procs,
                                                              tmp_path):
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    busy = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 1.5})
    waiting = queue.add_task("sample_handlers.Record", data={"log": log})
    proc = procs.spawn("runner", config=config_file(sqlite_db, tmp_path))

    wait_started(log)
    proc.send_signal(getattr(signal, signame))
    assert procs.wait(proc) == 0, procs.logs()

    assert [r.status for r in runs_of(busy)] == [SUCCESS]
    assert [task for task, _, _ in read_records(log)] == [busy], "the run was not finished"
    # Claim nothing more after the signal.
    assert [r.status for r in runs_of(waiting)] == [SCHEDULED]
    row = runner_row(proc.pid)
    assert row.status == SUCCESS
    assert signame in row.exit_reason
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_to_an_idle_runner_exits_within_a_second(signame, sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 5\n")
    proc = procs.spawn("runner", config=config)
    wait_registered(proc, procs)
    # Idle: the main thread is in its select() on the wake-up pipe, with up to 5 s to go.
    wait_for(lambda: waiting_in_select(proc.pid), timeout=START_TIMEOUT,
             message="the runner to wait idle")

    sent = time.monotonic()
    proc.send_signal(getattr(signal, signame))
    code = procs.wait(proc)
    elapsed = time.monotonic() - sent

    assert code == 0, procs.logs()
    # Includes retiring the row and interpreter shutdown (about 0.3 s on a quiet machine);
    # a missed wake-up would take ~5 s.
    assert elapsed < 2.5, "exited %.2fs after %s" % (elapsed, signame)   # loaded machine
    row = runner_row(proc.pid)
    assert row.status == SUCCESS
    assert signame in row.exit_reason
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signame", ["SIGTTIN", "SIGTTOU"])
def test_the_overseers_ttin_and_ttou_leave_a_runner_working(signame, sqlite_db, procs, tmp_path):
    """Their default action would suspend the process: a runner ignores them."""
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    proc = procs.spawn("runner", config=config_file(sqlite_db, tmp_path))
    wait_registered(proc, procs)
    proc.send_signal(getattr(signal, signame))
    task_id = queue.add_task("sample_handlers.Record", data={"log": log})
    wait_for(lambda: [t for t, _, _ in read_records(log)] == [task_id], timeout=START_TIMEOUT,
             message="the task to run after %s" % signame)
    assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, signame", [
    (("runner",), "SIGHUP"), (("runner",), "SIGTERM"), (("runner",), "SIGINT"),
    (("run-event", "task-runner:OnProcess"), "SIGTERM")], ids=lambda v: "-".join(v)
    if isinstance(v, tuple) else v)
def test_a_stop_that_reaches_a_starting_runner_is_a_graceful_stop(command, signame, sqlite_db,
                                                                  procs, tmp_path):
    """A supervisor's HUP or TERM may reach a runner while it is still starting (reading its
    config, opening the database): it stops as from any stop — exit 0, claiming nothing —
    instead of dying of the signal's default action. The runner is held at its start by
    reading its config from a FIFO that the test fills only after the signal."""
    queue = sqlite_db.queue()
    task_id = queue.add_task("sample_handlers.Record", data={"log": str(tmp_path / "records")})
    text = open(config_file(sqlite_db, tmp_path), "rb").read()
    fifo = str(tmp_path / "fifo.toml")
    os.mkfifo(fifo, 0o600)
    proc = procs.spawn(*command, config=fifo)

    def reading_its_config():
        if proc.poll() is not None:
            raise AssertionError("exited %s\n%s" % (proc.returncode, procs.logs([proc])))
        try:   # ENXIO until the runner opens the FIFO to read its config
            return (os.open(fifo, os.O_WRONLY | os.O_NONBLOCK),)
        except OSError:
            return None
    [fd] = wait_for(reading_its_config, timeout=START_TIMEOUT, interval=0.01,
                    message="the runner to read its config")
    proc.send_signal(getattr(signal, signame))
    os.set_blocking(fd, True)
    try:
        os.write(fd, text)
    except BrokenPipeError:
        pass                                      # it died of the signal: the test fails below
    finally:
        os.close(fd)
    assert procs.wait(proc) == 0, procs.logs([proc])
    assert "not started: received %s" % signame in procs.log(proc)
    assert [r.status for r in runs_of(task_id)] == [SCHEDULED]
    assert runner_row(proc.pid) is None
    queue.close()


# -- 3. stops that arrive twice, and interrupting on purpose --------------------------------

def test_a_stop_delivered_twice_at_once_still_finishes_the_run(sqlite_db, procs, tmp_path):
    """A supervisor signalling the whole group, then the overseer relaying its own stop: the
    same stop twice within REPEAT_WINDOW finishes the run with its real outcome."""
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 1.5})
    proc = procs.spawn("runner", config=config_file(sqlite_db, tmp_path))
    wait_started(log)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    assert procs.wait(proc) == 0, procs.logs()
    assert [r.status for r in runs_of(task_id)] == [SUCCESS]
    assert [task for task, _, _ in read_records(log)] == [task_id]
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGUSR1", "SIGINT-repeated", "SIGTERM-repeated"])
def test_interrupting_on_purpose_hands_the_run_back_without_a_failure(how, sqlite_db, procs,
                                                                      tmp_path):
    """USR1, or a standalone runner's TERM/INT repeated after REPEAT_WINDOW (Ctrl-C pressed
    again): the handler is interrupted and the run handed back — requeued, not counted
    against max_retries, runnable again at once."""
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 120},
                             max_retries=1)
    proc = procs.spawn("runner", config=sqlite_db.write_config(
        tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\n[task]\nretry_backoff = 60\n"))
    wait_started(log)
    signame = how.split("-")[0]
    sig = getattr(signal, signame)
    proc.send_signal(sig)
    if how.endswith("repeated"):
        time.sleep(loop.Runner.REPEAT_WINDOW + 0.2)   # the operator's pause between two Ctrl-C
        proc.send_signal(sig)
    assert procs.wait(proc) == 0, procs.logs()

    first, second = runs_of(task_id)
    assert (first.status, first.error_code) == (REQUEUED, "Stopped"), procs.logs()
    assert signame in first.error_message
    assert second.status == SCHEDULED and second.attempt == 2
    assert read_records(log) == [], "the handler ran to its end"
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed, task.finished_on) == (SCHEDULED, 0, None)
    assert not task.given_up
    assert runner_row(proc.pid).status == SUCCESS
    queue.close()


# -- 4. kill -9 -----------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_killed_runner_and_its_run_become_timeout_and_the_task_runs_again(database, procs,
                                                                           tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.SlowFirstAttempt", data={"log": log, "sleep": 120})
    config = config_file(database, tmp_path)
    victim = procs.spawn("runner", config=config)
    wait_started(log)
    victim_row = runner_row(victim.pid)

    os.kill(victim.pid, signal.SIGKILL)
    assert procs.wait(victim) == -signal.SIGKILL
    taskrunner("run-event", "task-queue:OnProcess", config=config, check=True)

    row = Runner.get_by_id(victim_row.id)
    assert row.status == TIMEOUT
    assert row.slot is None
    first, second = runs_of(task_id)
    assert (first.status, first.runner_id, first.error_code) == (TIMEOUT, row.id, "RunnerDied")
    assert second.status == SCHEDULED and second.attempt == 2
    assert Task.get_by_id(task_id).runs_failed == 1

    rescuer = procs.spawn("runner", "--burst", config=config)
    assert procs.wait(rescuer) == 0, procs.logs([rescuer])
    assert [(r.status, r.attempt) for r in runs_of(task_id)] == [(TIMEOUT, 1), (SUCCESS, 2)]
    assert runs_of(task_id)[1].runner_id == runner_row(rescuer.pid).id
    assert [task for task, _, _ in read_records(log)] == [task_id]
    assert len(read_records(log + ".started")) == 2
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed) == (SUCCESS, 0)
    queue.close()


# -- 5. rule 5: the host limit under a crowd -----------------------------------------------

# Imports everything first, then blocks on opening a FIFO: the test opens its write end once
# every process is ready, so all of them register at the same moment.
BARRIER = """
import os, sys
import taskrunner.cli, taskrunner.api, taskrunner.runner.loop, taskrunner.fleet.liveness
for driver in ("psycopg", "pymysql"):
    try:
        __import__(driver)
    except ImportError:
        pass
fifo, ready = sys.argv[1], sys.argv[2]
fd = os.open(ready, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, b"%d\\n" % os.getpid())
os.close(fd)
os.close(os.open(fifo, os.O_RDONLY))
sys.exit(taskrunner.cli.main(sys.argv[3:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_20_runners_started_at_once_never_exceed_the_limit(database, procs, tmp_path):
    queue = database.queue()
    config = config_file(database, tmp_path, runner="limit = 8", poll_interval=0.5)
    fifo, ready = str(tmp_path / "go"), tmp_path / "ready"
    os.mkfifo(fifo)
    crowd = []
    for i in range(20):
        log_path = tmp_path / ("crowd-%d.log" % i)
        with open(log_path, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", BARRIER, fifo, str(ready), "--config", config,
                 "run-event", "task-runner:OnProcess"],
                stdout=subprocess.DEVNULL, stderr=err, env=process_env(), start_new_session=True)
        crowd.append(procs.add(proc, log_path))

    def all_ready():
        for proc in crowd:
            if proc.poll() is not None:
                raise AssertionError("pid %d exited early\n%s" % (proc.pid, procs.logs([proc])))
        return ready.exists() and len(ready.read_text().split()) == 20
    wait_for(all_ready, timeout=START_TIMEOUT, message="20 processes at the barrier")

    most = 0

    def settled():
        nonlocal most
        rows = list(running_runners_here())
        most = max(most, len(rows))
        assert most <= 8, "%d runners running on this host (limit 8)" % most
        pids = {row.pid for row in rows}
        return all(proc.poll() is not None or proc.pid in pids for proc in crowd)

    go = os.open(fifo, os.O_WRONLY)  # releases every process blocked opening the FIFO
    try:
        wait_for(settled, timeout=START_TIMEOUT, interval=0.02,
                 message="every process to register or exit")
    finally:
        os.close(go)

    rows = list(running_runners_here())
    assert len(rows) == 8, procs.logs()
    assert sorted(row.slot for row in rows) == list(range(1, 9))
    exited = [proc for proc in crowd if proc.poll() is not None]
    alive = [proc for proc in crowd if proc.poll() is None]
    assert len(exited) == 12, procs.logs()
    assert [proc.returncode for proc in exited] == [0] * 12, procs.logs(exited)
    assert sorted(proc.pid for proc in alive) == sorted(row.pid for row in rows)
    # The refused ones never held a row, not even briefly.
    assert Runner.select().count() == 8

    for proc in alive:
        proc.send_signal(signal.SIGTERM)
    for proc in alive:
        assert procs.wait(proc) == 0, procs.logs([proc])
    assert [r.status for r in Runner.select()] == [SUCCESS] * 8
    assert running_runners_here().count() == 0
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, code", [
    (("run-event", "task-runner:OnProcess"), 0),
    (("runner",), 1),
    (("runner", "--burst"), 1),
], ids=["run-event", "runner", "runner-burst"])
def test_a_runner_at_the_limit_refuses_without_a_traceback(args, code, sqlite_db, procs,
                                                           tmp_path):
    queue = sqlite_db.queue()
    config = config_file(sqlite_db, tmp_path, runner="limit = 1", poll_interval=0.5)
    first = procs.spawn("runner", config=config)
    wait_registered(first, procs)

    result = taskrunner(*args, config=config)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "limit" in result.stderr
    assert Runner.select().count() == 1
    first.send_signal(signal.SIGTERM)
    assert procs.wait(first) == 0
    queue.close()


# -- 6. bad runs do not stop a runner --------------------------------------------------------

@pytest.mark.timeout(120)
def test_runner_carries_on_after_a_missing_handler_and_undecodable_data(database, procs,
                                                                        tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    missing, bad_data, good = queue.add_tasks(
        [{"handler": "sample_handlers.Record", "data": {"log": log}, "max_retries": 1}
         for _ in range(3)])
    # Valid when added, broken by the time a runner gets them.
    Task.update(handler="nope.Missing").where(Task.id == missing).execute()
    Task.update(data="{bad").where(Task.id == bad_data).execute()

    proc = procs.spawn("runner", "--burst", config=config_file(database, tmp_path))
    assert procs.wait(proc) == 0, procs.logs()

    runner_id = runner_row(proc.pid).id
    for task_id, status, code in ((missing, ERROR, "HandlerError"),
                                  (bad_data, ERROR, "DataDecodeError"),
                                  (good, SUCCESS, None)):
        [run] = runs_of(task_id)
        assert (run.status, run.error_code, run.runner_id) == (status, code, runner_id), \
            procs.logs()
        task = Task.get_by_id(task_id)
        assert (task.last_status, task.last_error_code) == (status, code)
    assert "nope.Missing" in runs_of(missing)[0].error_message
    assert Task.get_by_id(missing).given_up and Task.get_by_id(bad_data).given_up
    assert [task for task, _, _ in read_records(log)] == [good]
    assert runner_row(proc.pid).status == SUCCESS
    queue.close()


# -- 7. recycling ---------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_runner_exits_after_max_runs(sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                     for _ in range(5)])
    proc = procs.spawn("runner", config=config_file(sqlite_db, tmp_path, runner="max_runs = 3"))
    assert procs.wait(proc) == 0, procs.logs()

    row = runner_row(proc.pid)
    assert row.status == SUCCESS
    assert "max_runs" in row.exit_reason
    assert Run.select().where((Run.runner_id == row.id) & (Run.status == SUCCESS)).count() == 3
    assert len(read_records(log)) == 3
    assert Run.select().where(Run.status == SCHEDULED).count() == 2
    queue.close()


@pytest.mark.timeout(120)
def test_runner_exits_after_a_run_that_passes_memory_limit(sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    log = str(tmp_path / "records")
    queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                     for _ in range(2)])
    # Any Python process is over 1 MB: the limit is passed as soon as a run ends.
    proc = procs.spawn("runner",
                       config=config_file(sqlite_db, tmp_path, runner="memory_limit = 1"))
    assert procs.wait(proc) == 0, procs.logs()

    row = runner_row(proc.pid)
    assert row.status == SUCCESS
    assert "memory_limit" in row.exit_reason
    assert Run.select().where((Run.runner_id == row.id) & (Run.status == SUCCESS)).count() == 1
    assert len(read_records(log)) == 1
    queue.close()


@pytest.mark.timeout(120)
def test_an_ended_runner_row_keeps_its_final_rss_and_runs_done(sqlite_db, procs, tmp_path):
    """The row's rss and runs_done are those of the runner's end, not of its last heartbeat
    (here none after registering: heartbeat_interval is longer than the runner lives)."""
    queue = sqlite_db.queue()
    queue.add_tasks([{"handler": "sample_handlers.Hold", "data": {"mb": 40}}
                     for _ in range(3)])
    proc = procs.spawn("runner", "--burst", config=config_file(
        sqlite_db, tmp_path, runner="heartbeat_interval = 50\nmemory_limit = 1000"))
    assert procs.wait(proc) == 0, procs.logs()

    row = runner_row(proc.pid)
    assert row.status == SUCCESS
    assert (row.runs_done, row.exit_reason) == (3, "no work left"), procs.logs()
    # It exited holding the 120 MB its handlers wrote: more than it had when it registered.
    assert row.rss > 120 * 1024 * 1024, row.rss
    queue.close()
