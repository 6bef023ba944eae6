"""Batched acknowledgements ([runner] batch > 1, batches.py) with real runner processes:
successes written within flush_interval, a stop that writes them and gives the claimed runs
back, runs taken away while claimed never started, the claim order kept within a batch,
concurrency keys held, and kill -9 re-executing at most the runs the victim held.

Runs are counted, as in test_runner_processes, both from the database and from a file the
handlers append to outside it. Every test here fails on a taskrunner without batching: its
config refuses the ``batch`` key (the runner exits 2 before it claims anything).
"""
import json
import os
import random
import re
import signal
import time

import pytest

from conftest import START_TIMEOUT, runs_of, taskrunner, wait_for, wait_started
from sample_handlers import read_records
from taskrunner.host import claimfile
from taskrunner.runs import lifecycle
from taskrunner.store.models import (CANCELLED, RUNNING, SCHEDULED, SUCCESS, TIMEOUT, Run, Runner,
                                     Task)

EXIT_TIMEOUT = 60.0


def batch_config(database, tmp_path, batch=16, flush_interval=0.05, extra=""):
    return database.write_config(
        tmp_path / "c.toml",
        "[runner]\npoll_interval = 0.1\nbatch = %d\nflush_interval = %s\n%s\n"
        "[task]\nretry_backoff = 0\nmax_retries = 50\n[overseer]\ncrash_grace = 0\n"
        % (batch, flush_interval, extra))


def runner_row(proc, procs):
    def registered():
        if proc.poll() is not None:
            raise AssertionError("pid %d exited %s\n%s" % (proc.pid, proc.returncode,
                                                           procs.logs([proc])))
        return Runner.get_or_none(Runner.pid == proc.pid)
    return wait_for(registered, timeout=START_TIMEOUT, message="the runner to register")


def gate_task(queue, tmp_path, log, priority=0):
    return queue.add_task("batch_handlers.Gate", priority=priority,
                          data={"log": log, "gate": str(tmp_path / "gate")})


def open_gate(tmp_path):
    (tmp_path / "gate").write_text("open")


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, key", [("batch = 0", "batch"), ("batch = true", "batch"),
                                       ("flush_interval = 0", "flush_interval"),
                                       ("flush_interval = \"2s\"", "flush_interval")])
def test_bad_batch_settings_are_one_line_errors(text, key, sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "bad.toml", "[runner]\n%s\n" % text)
    result = taskrunner("status", config=config)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "bad.toml" in result.stderr and "[runner] %s" % key in result.stderr


def test_batch_settings_are_accepted(sqlite_db, tmp_path):
    result = taskrunner("status", config=batch_config(sqlite_db, tmp_path, 64, '"5ms"'))
    assert result.returncode == 0, result.stderr


# -- when outcomes are written -----------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_success_is_written_within_flush_interval_while_the_batch_goes_on(database, procs,
                                                                            tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    first = queue.add_task("sample_handlers.Record", data={"log": log}, priority=5)
    held = gate_task(queue, tmp_path, log)
    proc = procs.spawn("runner", config=batch_config(database, tmp_path))
    wait_started(log)

    # The gate holds the runner in a handler: only the flusher can write the first success.
    wait_for(lambda: runs_of(first)[0].status == SUCCESS, timeout=30,
             message="the first run's success to be written while the second runs")
    [done], [running] = runs_of(first), runs_of(held)
    assert running.status == RUNNING
    assert (done.runner_id, done.started_on) == (running.runner_id, running.started_on), \
        "not claimed together"
    assert Task.get_by_id(first).last_status == SUCCESS

    open_gate(tmp_path)
    wait_for(lambda: runs_of(held)[0].status == SUCCESS, message="the second success")
    os.killpg(proc.pid, signal.SIGTERM)   # the group, as a terminal or supervisord
    assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs()
    assert sorted(t for t, _, _ in read_records(log)) == sorted([first, held])
    queue.close()


@pytest.mark.timeout(120)
def test_term_with_a_full_batch_writes_the_successes_and_gives_back_the_rest(database, procs,
                                                                             tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    first = queue.add_task("sample_handlers.Record", data={"log": log}, priority=10)
    held = gate_task(queue, tmp_path, log, priority=5)
    rest = queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                            for _ in range(10)])
    # The longest flush_interval: the first success may still wait when TERM comes.
    config = batch_config(database, tmp_path, flush_interval=1)
    proc = procs.spawn("runner", config=config)
    wait_started(log)
    row = runner_row(proc, procs)
    assert {r.status for t in rest for r in runs_of(t)} == {RUNNING}
    assert {r.runner_id for t in rest for r in runs_of(t)} == {row.id}
    # `status` shows the runs it holds: the gate's, the ten claimed, maybe the first's.
    [shown] = [r for r in json.loads(taskrunner("status", "--json", config=config,
                                                check=True).stdout)["runners"]
               if r["id"] == row.id]
    assert shown["claimed"] in (11, 12), shown
    assert re.search(r"\+1[01] claimed", taskrunner("status", config=config).stdout)

    os.killpg(proc.pid, signal.SIGTERM)   # the group, as a terminal or supervisord
    open_gate(tmp_path)
    assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs()

    assert [r.status for r in runs_of(first)] == [SUCCESS]
    assert [r.status for r in runs_of(held)] == [SUCCESS], "the run in hand was not finished"
    for task_id in rest:
        [run] = runs_of(task_id)
        assert (run.status, run.runner_id, run.started_on, run.attempt) == \
            (SCHEDULED, None, None, 1), "not given back unstarted"
        task = Task.get_by_id(task_id)
        assert (task.last_status, task.runs_failed) == (SCHEDULED, 0)
    assert sorted(t for t, _, _ in read_records(log)) == sorted([first, held])
    assert Runner.get_by_id(row.id).status == SUCCESS
    queue.close()


# -- rule 8 for runs claimed and not started ---------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cancelled", "timed out"])
def test_a_claimed_run_taken_away_before_it_starts_is_never_started(how, database, procs,
                                                                    tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    gate_task(queue, tmp_path, log, priority=5)
    victim = queue.add_task("sample_handlers.Record", data={"log": log})
    proc = procs.spawn("runner", config=batch_config(database, tmp_path, flush_interval=0.01))
    wait_started(log)
    [claimed] = runs_of(victim)
    assert claimed.status == RUNNING, "not claimed with the first run"

    if how == "cancelled":
        assert queue.cancel(victim) == claimed.id      # a running run is asked to stop
    else:
        assert lifecycle.end_run(queue.store, claimed.id, victim, TIMEOUT,
                                 error_code="RunTimeout", error_message="as an overseer would")
    # The claimed runs are re-read at most flush_interval before a start: what was taken
    # away within that window is stopped like a running run (the heartbeat), not skipped.
    taken_at = time.monotonic()
    wait_for(lambda: time.monotonic() - taken_at > 0.1, message="flush_interval to pass")
    open_gate(tmp_path)
    wait_for(lambda: Task.get_by_id(victim).finished_on is not None, timeout=30,
             message="the victim's task to end")
    os.killpg(proc.pid, signal.SIGTERM)   # the group, as a terminal or supervisord
    assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs()

    executed = [run for _, run, _ in read_records(log)]
    assert claimed.id not in executed, "a run taken away was started"
    first = runs_of(victim)[0]
    if how == "cancelled":
        assert (first.status, first.error_code) == (CANCELLED, "Cancelled")
        assert Task.get_by_id(victim).last_status == CANCELLED
        assert len(runs_of(victim)) == 1
    else:
        assert first.status == TIMEOUT
        # Its retry is a run of its own, executed once.
        assert [r.status for r in runs_of(victim)] == [TIMEOUT, SUCCESS]
        assert executed.count(runs_of(victim)[1].id) == 1
    queue.close()


# -- a batched runner's death: the runs it had not started ----------------------------------------

def held_by_a_gated_runner(database, procs, tmp_path, how):
    """A batched runner (standalone, or an overseer's child) executing the gate with six
    runs claimed behind it: (queue, log, the gate's task, the six tasks, the runner's row,
    the config, the process started: `how`, "runner" or "overseer")."""
    queue = database.queue()
    log = str(tmp_path / "records")
    gate = gate_task(queue, tmp_path, log, priority=5)
    held = queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                            for _ in range(6)])
    config = batch_config(database, tmp_path, flush_interval=1,
                          extra="limit = 1" if how == "overseer" else "")
    overseer = procs.spawn(how, config=config)
    wait_started(log)
    [row] = wait_for(lambda: list(Runner.select().where(
        (Runner.kind == "runner") & (Runner.status == RUNNING))), timeout=START_TIMEOUT,
        message="the runner's row")
    assert {r.status for t in held for r in runs_of(t)} == {RUNNING}
    assert {r.runner_id for t in [gate] + held for r in runs_of(t)} == {row.id}, \
        "not claimed together"
    return queue, log, gate, held, row, config, overseer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["runner", "overseer"])
def test_kill_9_of_a_batched_runner_hands_back_the_runs_it_had_not_started_uncounted(
        how, database, procs, tmp_path):
    """Its host learns which claimed runs it never started (its claim file): those go back
    to the queue unstarted (not a failure, not a second attempt); the one executing is a
    crash."""
    queue, log, gate, held, row, config, proc = held_by_a_gated_runner(
        database, procs, tmp_path, how)
    path = os.path.join(claimfile.directory(queue.store.wakeup_directory), str(row.id))
    assert os.path.exists(path), "no claim file"
    os.kill(row.pid, signal.SIGKILL)
    if how == "runner":
        assert procs.wait(proc) == -signal.SIGKILL
        # This host's sweep (its PID is gone), as a cron run-event or an overseer does.
        taskrunner("run-event", "task-queue:OnProcess", config=config, check=True)
    else:
        # Its overseer reaps it and marks it at once.
        wait_for(lambda: Runner.get_by_id(row.id).status == TIMEOUT, timeout=30,
                 message="the overseer to mark its dead child")
    assert Runner.get_by_id(row.id).status == TIMEOUT
    [crashed] = runs_of(gate)[:1]
    assert (crashed.status, crashed.error_code) == (TIMEOUT, "RunnerDied")
    assert Task.get_by_id(gate).runs_failed == 1
    for task_id in held:
        runs = runs_of(task_id)
        assert [(r.attempt, r.error_code) for r in runs] == [(1, None)], \
            "a claimed run that never started was counted as a crash"
        [run] = runs
        assert run.runner_id != row.id
        # The overseer's next runner may hold it, or have run it already (a Record is quick).
        assert run.status in (SCHEDULED, RUNNING, SUCCESS)
        assert Task.get_by_id(task_id).runs_failed == 0
    # Removed once the marking committed: an overseer's reap may still be between the two.
    wait_for(lambda: not os.path.exists(path), timeout=10,
             message="the claim file to be removed")

    open_gate(tmp_path)
    if how == "runner":
        rescuer = procs.spawn("runner", "--burst", config=config)
        assert procs.wait(rescuer, EXIT_TIMEOUT) == 0, procs.logs([rescuer])
    wait_for(lambda: {Task.get_by_id(t).last_status for t in [gate] + held} == {SUCCESS},
             timeout=60, message="every task to succeed")
    executed = [t for t, _, _ in read_records(log)]
    assert sorted(executed) == sorted([gate] + held), "a held task ran twice or not at all"
    assert all(len(runs_of(t)) == 1 for t in held)
    if how == "overseer":
        os.killpg(proc.pid, signal.SIGTERM)   # the group, as supervisord
        assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs([proc])
    queue.close()


def test_a_claim_file_lists_what_was_published_last_and_is_read_whole(tmp_path):
    """The reader sees the runs held before the next start, and nothing of a list the
    writer was killed publishing (a count of 0 comes first)."""
    base = str(tmp_path / "wakeup")
    claims = claimfile.ClaimFile(base, 7, 4)
    assert claimfile.unstarted(base, 7) == set()
    claims.publish([11, 12, 13, 14, 15])        # at most the batch: the first 4
    assert claimfile.unstarted(base, 7) == {11, 12, 13, 14}
    claims.publish([13, 14])
    assert claimfile.unstarted(base, 7) == {13, 14}
    claims.starting()                            # 13 starts: only 14 is left unstarted
    assert claimfile.unstarted(base, 7) == {14}
    claims.publish([13, 14])                     # published again: none started
    assert claimfile.unstarted(base, 7) == {13, 14}
    assert oct(os.stat(claims.path).st_mode & 0o777) == oct(0o600)
    with open(claims.path, "r+b") as fh:         # killed after zeroing the count
        fh.write(bytes(8))
    assert claimfile.unstarted(base, 7) == set()
    assert claimfile.unstarted(base, 8) == set(), "another runner's file"
    claims.remove()
    assert not os.path.exists(claims.path)
    assert not os.path.exists(claimfile.directory(base)), "the empty directory was left"


# -- rule 2 and rule 5 within a batch ----------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_batch_runs_in_priority_order(database, procs, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "records")
    rng = random.Random(7)
    priorities = [rng.randint(-3, 3) for _ in range(40)]
    ids = queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log},
                            "priority": p} for p in priorities])
    proc = procs.spawn("runner", "--burst", config=batch_config(database, tmp_path, batch=16))
    assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs()

    expected = [i for _, i in sorted(zip(priorities, ids), key=lambda pi: (-pi[0], pi[1]))]
    assert [t for t, _, _ in read_records(log)] == expected
    assert {Task.get_by_id(i).last_status for i in ids} == {SUCCESS}
    # Claimed 16 at a time: three claims, so three distinct claim times.
    assert len({r.started_on for r in Run.select(Run.started_on)}) == 3
    queue.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_batched_runners_keep_a_concurrency_key_limit(database, procs, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "spans")
    keyed = [queue.add_task("sample_handlers.Span", data={"log": log, "sleep": 0.1},
                            concurrency_key="k", concurrency_limit=2) for _ in range(8)]
    config = batch_config(database, tmp_path, batch=16)
    runners = [procs.spawn("runner", config=config) for _ in range(3)]
    wait_for(lambda: all(Task.get_by_id(t).last_status == SUCCESS for t in keyed),
             timeout=90, message="every keyed task to succeed")
    for proc in runners:
        os.killpg(proc.pid, signal.SIGTERM)   # the group, as a terminal or supervisord
    for proc in runners:
        assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs()

    with open(log) as fh:
        events = [line.split() for line in fh if line.strip()]
    running = peak = 0
    for kind, _, _ in events:
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak <= 2, "more than the key's limit of 2 at once"
    assert sorted(int(t) for kind, t, _ in events if kind == "end") == sorted(keyed)
    queue.close()


# -- a batch's share of the backlog --------------------------------------------------------------

@pytest.mark.timeout(120)
def test_runs_added_at_once_go_to_as_many_idle_batched_runners(database, procs, tmp_path):
    """Four runs added in one call while four batched runners (batch 16) wait: each runner
    takes one, and all four start while the first still runs. Before, the first runner woken
    claimed all four, the others found none, and the four ran one after another."""
    queue = database.queue()
    log = str(tmp_path / "records")
    proc = procs.spawn("overseer", config=batch_config(database, tmp_path, extra="limit = 4"))
    wait_for(lambda: Runner.select().where((Runner.kind == "runner")
                                           & (Runner.status == RUNNING)).count() == 4,
             timeout=START_TIMEOUT, message="four runners")
    gates = queue.add_tasks([{"handler": "batch_handlers.Gate",
                              "data": {"log": log, "gate": str(tmp_path / "gate")}}
                             for _ in range(4)])
    started = wait_started(log, count=4)
    assert len({pid for _, _, pid in started}) == 4
    assert len({r.runner_id for t in gates for r in runs_of(t)}) == 4
    open_gate(tmp_path)
    wait_for(lambda: {Task.get_by_id(t).last_status for t in gates} == {SUCCESS}, timeout=60,
             message="the four to succeed")
    os.killpg(proc.pid, signal.SIGTERM)   # the group, as supervisord
    assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs([proc])
    queue.close()


@pytest.mark.parametrize("backlog, runners, want, share", [
    (40, 1, 16, 16), (4, 4, 16, 1), (10, 4, 16, 3), (0, 2, 16, 1), (1, 0, 16, 1),
    (1000, 2, 16, 16), (33, 2, 16, 16), (31, 2, 16, 16), (30, 2, 16, 15), (5, 3, 2, 2)])
def test_a_batch_takes_its_share_of_the_backlog_among_the_running_runners(
        database, backlog, runners, want, share):
    """sql.backlog_share: the queue's scheduled runs divided among the runners running
    (rounded up), at most `want`, at least one; other queues' runs, runs not scheduled and
    runner rows not running (or an overseer's) do not count."""
    from taskrunner.runs import sql
    from taskrunner.store.models import utcnow
    queue = database.queue()
    store, now = queue.store, utcnow()
    queue.add_tasks([{"handler": "sample_handlers.Record", "data": {}}] * backlog)
    queue.add_tasks([{"handler": "sample_handlers.Record", "data": {}, "queue": "other"}] * 5)
    rows = dict(host="h", boot_id="b", pid=1, pid_create_time=0.0, started_on=now,
                heartbeat_on=now)
    for n in range(runners):
        Runner.create(**rows, status=RUNNING)
    Runner.create(**rows, status=RUNNING, kind="overseer")
    Runner.create(**rows, status=SUCCESS)
    assert store.write(lambda: sql.backlog_share(store, "default", want)) == share
    queue.close()


# -- kill -9 -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_of_a_batched_runner_reexecutes_at_most_the_runs_it_held(database, procs,
                                                                        tmp_path):
    """Every task ends with exactly one successful run; what ran twice is among the runs the
    victim held (claimed, or ended and not written yet), and those are at most `batch`."""
    queue = database.queue()
    log = str(tmp_path / "records")
    task_ids = queue.add_tasks([{"handler": "sample_handlers.Record",
                                 "data": {"log": log, "sleep": 0.005}} for _ in range(400)])
    config = batch_config(database, tmp_path, batch=16, flush_interval=1)
    victim, other = (procs.spawn("runner", config=config) for _ in range(2))
    victim_row = runner_row(victim, procs)
    wait_for(lambda: any(pid == victim.pid for _, _, pid in read_records(log)),
             timeout=START_TIMEOUT, message="the victim to execute a run")
    os.kill(victim.pid, signal.SIGKILL)
    assert procs.wait(victim) == -signal.SIGKILL
    # This host's sweep: the victim's row and every run it held become timeout.
    taskrunner("run-event", "task-queue:OnProcess", config=config, check=True)
    assert Runner.get_by_id(victim_row.id).status == TIMEOUT

    rescuer = procs.spawn("runner", "--burst", config=config)
    assert procs.wait(rescuer, 180) == 0, procs.logs([rescuer])
    wait_for(lambda: not Task.select().where(Task.finished_on.is_null()).exists(),
             timeout=120, message="every task to end")
    os.killpg(other.pid, signal.SIGTERM)   # the group, as a terminal or supervisord
    assert procs.wait(other, EXIT_TIMEOUT) == 0, procs.logs([other])

    assert {Task.get_by_id(t).last_status for t in task_ids} == {SUCCESS}
    success = [r.task_id for r in Run.select(Run.task_id).where(Run.status == SUCCESS)]
    assert sorted(success) == sorted(task_ids), "a task has no or two successful runs"
    lost = list(Run.select().where((Run.runner_id == victim_row.id) & (Run.status != SUCCESS)))
    assert len(lost) <= 16, "the victim held %d runs" % len(lost)
    assert {(r.status, r.error_code) for r in lost} <= {(TIMEOUT, "RunnerDied")}
    records = read_records(log)
    runs = [run for _, run, _ in records]
    assert len(runs) == len(set(runs)), "a run was executed twice"
    executed = [t for t, _, _ in records]
    twice = {t for t in executed if executed.count(t) > 1}
    assert twice <= {r.task_id for r in lost}, "a task ran twice that the victim did not hold"
    assert set(executed) == set(task_ids)
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0
    queue.close()
