"""Durable execution with real processes: a handler told to stop learns why and by when
(run.stop_reason, run.stop_deadline); a 600-step task checkpointing every step loses at most
the step in flight per stop or crash (three HUPs to its overseer and one kill -9 of its
runner: at most 604 steps executed)."""
import os
import signal
import time
from datetime import datetime, timezone

import pytest

from conftest import wait_for
from durable_handlers import lines
from test_overseer import (fresh_overseers, is_gone, live_pids, runner_rows, wait_all_final,
                           wait_up)
from taskrunner.store.models import Run, Task

H = "durable_handlers."


@pytest.fixture(params=("sqlite", "postgresql"))
def overseers(request, tmp_path):
    with fresh_overseers(request.param, tmp_path) as group:
        yield group


def steps_logged(log):
    return len(lines(log))


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_600_steps_through_three_hups_and_a_kill_9_execute_at_most_604(overseers, tmp_path):
    """The issue's deploy test: each HUP hands the run back at the next step (the handler
    sees run.stop_reason "hup" and a deadline graceful_timeout away) and the next attempt
    starts from the checkpoint; the kill -9 loses the step in flight at most."""
    queue = overseers.database.queue()
    log = str(tmp_path / "steps")
    task_id = queue.add_task(H + "Steps", {"log": log, "steps": 600, "sleep": 0.01},
                             max_retries=10)
    proc = overseers.start(overseers.config(limit=1, check_interval=0.5, graceful_timeout=30))
    wait_up(overseers, proc, 1)
    for milestone, action in ((80, "hup"), (200, "hup"), (320, "kill"), (440, "hup")):
        wait_for(lambda: steps_logged(log) >= milestone, timeout=90,
                 message="%d steps executed" % milestone)
        if action == "hup":
            os.kill(proc.pid, signal.SIGHUP)
        else:
            victim = wait_for(lambda: [r.pid for r in runner_rows()
                                       if r.pid in live_pids(proc.pid)], timeout=30)[0]
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: is_gone(victim), timeout=10)
    wait_all_final(overseers, timeout=120)
    task = queue.get_task(task_id)
    assert task.status == "success", (task, overseers.log())
    executed = lines(log)
    assert {int(step) for _, step in executed} == set(range(600))
    assert len(executed) <= 604, "%d steps executed" % len(executed)
    assert task.checkpoint == 600
    runs = queue.runs_of(task_id)
    assert [r.error_code for r in runs if r.status == "timeout"] == ["RunnerDied"]
    assert sum(r.status == "requeued" for r in runs) >= 3
    stops = lines(log + ".stops")
    assert len(stops) >= 3 and {reason for reason, _ in stops} == {"hup"}, stops
    for _, deadline in stops:
        left = (datetime.fromisoformat(deadline) - datetime.now(timezone.utc)).total_seconds()
        assert -60 < left <= 30, deadline     # graceful_timeout from the HUP
    queue.close()


@pytest.mark.timeout(120)
def test_a_handler_learns_why_it_is_asked_to_stop_and_by_when(sqlite_db, procs, tmp_path):
    """TERM to a runner: "term", graceful_timeout (here 20 s) from the signal; an operator's
    cancel: "cancel", kill_grace (here 7 s) from the cancel's arrival."""
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\n"
                                    "heartbeat_interval = 0.2\n[overseer]\n"
                                    "graceful_timeout = 20\nkill_grace = 7\n")
    queue = sqlite_db.queue()
    log = str(tmp_path / "stop")
    first = queue.add_task(H + "WaitUntilStopped", {"log": log})
    runner = procs.spawn("runner", config=config, name="runner")
    wait_for(lambda: lines(log + ".started"), timeout=60, message="the handler to start")
    sent = time.time()
    runner.send_signal(signal.SIGTERM)
    assert procs.wait(runner) == 0
    [(reason, deadline)] = lines(log)
    assert reason == "term"
    assert abs(datetime.fromisoformat(deadline).timestamp() - (sent + 20)) < 5
    assert queue.get_task(first).status == "scheduled"       # handed back

    runner = procs.spawn("runner", config=config, name="runner")
    wait_for(lambda: len(lines(log + ".started")) >= 2, timeout=60,
             message="the handler to start again")
    sent = time.time()
    assert queue.cancel(first) is not None
    wait_for(lambda: len(lines(log)) >= 2, timeout=30, message="the handler to see the cancel")
    reason, deadline = lines(log)[1]
    assert reason == "cancel"
    assert abs(datetime.fromisoformat(deadline).timestamp() - (sent + 7)) < 5
    wait_for(lambda: Task.get_by_id(first).last_status == "cancelled", timeout=30)
    runner.send_signal(signal.SIGTERM)
    procs.wait(runner)
    assert Run.select().where(Run.status.in_(["scheduled", "running"])).count() == 0
    queue.close()
