"""Every run can be seen (issue 12): tracebacks of failed runs, results while a run goes on,
waiting for a task's outcome, the handler's hooks, async handlers, and run_pending driving
time. Real databases; real runner processes where the process boundary is the point."""
import json
import logging
import os
import re
import sys
import threading
import time
from datetime import datetime, timedelta

import pytest

from taskrunner.fleet import liveness
from taskrunner.store.models import utcnow

from conftest import START_TIMEOUT, ok, taskrunner, utc, wait_for
from visibility_handlers import BREAK_ENV, read_lines

H = "visibility_handlers."


def final_run(queue, task_id):
    return queue.runs_of(task_id)[-1]


# -- 1. tracebacks --------------------------------------------------------------------------

def test_failed_run_stores_its_traceback_and_logs_it(queue, caplog):
    task_id = queue.add_task(H + "KeyFails", max_retries=1)
    with caplog.at_level(logging.INFO, logger="taskrunner"):
        assert queue.run_pending() == 1
    run = final_run(queue, task_id)
    assert (run.status, run.error_code, run.error_message) == ("error", "KeyError", "'amount'")
    assert run.traceback.startswith("Traceback (most recent call last):")
    assert 'visibility_handlers.py", line' in run.traceback
    assert 'return invoice["amount"]' in run.traceback
    assert run.traceback.rstrip().endswith("KeyError: 'amount'")
    assert run.to_json()["traceback"] == run.traceback
    task = queue.get_task(task_id)
    assert task.last_traceback == run.traceback and task.given_up
    failed = [r for r in caplog.records if " failed: " in r.getMessage()]
    assert [r.levelname for r in failed] == ["WARNING"]
    assert 'return invoice["amount"]' in failed[0].getMessage()
    gave_up = [r for r in caplog.records if "gave up" in r.getMessage()]
    assert [r.levelname for r in gave_up] == ["ERROR"]


def test_a_retrying_failure_is_not_logged_as_a_give_up(queue, caplog):
    queue.add_task(H + "KeyFails", max_retries=3)
    with caplog.at_level(logging.INFO, logger="taskrunner"):
        queue.run_pending()
    assert not [r for r in caplog.records if "gave up" in r.getMessage()]
    assert [r.levelname for r in caplog.records if " failed: " in r.getMessage()] == [
        "WARNING"]


def test_traceback_is_bounded_to_its_last_64_kib(queue):
    task_id = queue.add_task(H + "KeyFails", data={"size": 200_000}, max_retries=1)
    queue.run_pending()
    stored = final_run(queue, task_id).traceback
    assert len(stored.encode("utf-8")) <= 65536
    assert stored.startswith("[... ") and stored.rstrip().endswith("x END")


def test_handler_that_cannot_be_imported_stores_the_import_traceback(queue, monkeypatch):
    task_id = queue.add_task("broken_handlers.Fine", max_retries=1)
    monkeypatch.setenv(BREAK_ENV, "1")
    monkeypatch.delitem(sys.modules, "broken_handlers", raising=False)
    queue.run_pending()
    run = final_run(queue, task_id)
    assert run.error_code == "HandlerError"
    assert "broken on purpose" in run.error_message
    assert 'broken_handlers.py", line' in run.traceback
    assert "raise ImportError" in run.traceback


def test_cli_shows_the_traceback_in_runs_and_show_as_text_and_json(database):
    queue = database.queue()
    task_id = queue.add_task(H + "KeyFails", max_retries=1)
    queue.run_pending()
    runs_text = ok(taskrunner("runs", str(task_id), url=database.url))
    assert 'return invoice["amount"]' in runs_text and "KeyError: 'amount'" in runs_text
    runs_json = json.loads(ok(taskrunner("runs", str(task_id), "--json", url=database.url)))
    assert 'return invoice["amount"]' in runs_json[0]["traceback"]
    show_text = ok(taskrunner("show", str(task_id), url=database.url))
    assert 'return invoice["amount"]' in show_text
    show_json = json.loads(ok(taskrunner("show", str(task_id), "--json", url=database.url)))
    assert 'return invoice["amount"]' in show_json["last_traceback"]
    queue.close()


# -- 4. hooks -------------------------------------------------------------------------------

@pytest.mark.parametrize("hooks_fail", [False, True], ids=["hooks", "failing-hooks"])
def test_on_failure_and_on_give_up_are_called_and_never_change_the_outcome(
        queue, tmp_path, hooks_fail, caplog):
    log = str(tmp_path / "hooks.log")
    t0 = utcnow()
    task_id = queue.add_task(H + "Hooked", data={"log": log, "hooks_fail": hooks_fail},
                             max_retries=2, retry_backoff=10)
    with caplog.at_level(logging.INFO, logger="taskrunner"):
        assert queue.run_pending(now=utc(t0)) == 1
        assert queue.run_pending(now=utc(t0 + timedelta(hours=1))) == 1
    runs = queue.runs_of(task_id)
    assert read_lines(log) == [
        ["on_failure", runs[0].id, 1, "RuntimeError"],
        ["on_failure", runs[1].id, 2, "RuntimeError"],
        ["on_give_up", task_id, "given-up", 2]]
    assert [(r.status, r.error_code, r.results) for r in runs] == [
        ("error", "RuntimeError", {"partial": 1})] * 2
    assert queue.get_task(task_id).given_up
    hook_errors = [r for r in caplog.records if "raised; the run's outcome is unchanged"
                   in r.getMessage()]
    assert len(hook_errors) == (3 if hooks_fail else 0)


def test_a_task_error_with_retry_false_gives_up_at_once_with_its_hooks(queue, tmp_path,
                                                                        caplog):
    """``TaskError(..., retry=False)``: the task gives up after this failure whatever its
    max_retries, as any give-up (error kept, on_give_up called, dependents cancelled); an
    operator's retry re-arms it."""
    log = str(tmp_path / "hooks.log")
    task_id = queue.add_task(H + "Hooked", data={"log": log, "no_retry": True},
                             max_retries=5, retry_backoff=0)
    dependent = queue.add_task("taskrunner.handlers.Echo", after=[task_id])
    with caplog.at_level(logging.INFO, logger="taskrunner"):
        assert queue.run_pending() == 1
    assert queue.run_pending() == 0
    assert "task %d gave up after 1 failed run(s) (an error not to retry)" % task_id in [
        r.getMessage().split(":")[0] for r in caplog.records]
    task = queue.get_task(task_id)
    assert task.given_up and task.finished_on is not None, task
    assert (task.status, task.runs_failed, task.last_error_code, task.last_error_message) == (
        "given-up", 1, "Refused", "attempt 1 refused")
    runs = queue.runs_of(task_id)
    assert read_lines(log) == [["on_failure", runs[0].id, 1, "TaskError"],
                               ["on_give_up", task_id, "given-up", 1]]
    assert [t.id for t in queue.tasks(status="given-up")] == [task_id]
    assert queue.get_task(dependent).status == "cancelled"
    assert queue.retry(task_id) == 1
    assert queue.run_pending() == 1
    assert queue.get_task(task_id).given_up and len(queue.runs_of(task_id)) == 2
    from taskrunner import TaskError
    assert TaskError("x").retry is True and TaskError("x", retry=False).retry is False


# -- 5. async handlers ----------------------------------------------------------------------

def test_async_handler_runs_to_completion(queue):
    ok_id = queue.add_task(H + "AsyncAdd", data={"numbers": [1, 2, 3]})
    bad_id = queue.add_task(H + "AsyncAdd", data={"fail": True}, max_retries=1)
    assert queue.run_pending() == 2
    assert (final_run(queue, ok_id).status, final_run(queue, ok_id).results) == (
        "success", {"sum": 6})
    bad = final_run(queue, bad_id)
    assert (bad.status, bad.error_code) == ("error", "KeyError")
    assert "async-missing" in bad.traceback and "visibility_handlers.py" in bad.traceback


# -- 6. run_pending drives time and takes no slot -------------------------------------------

def test_run_pending_takes_a_task_through_its_retries_without_sleeping(queue):
    t0 = utcnow()
    task_id = queue.add_task(H + "KeyFails", max_retries=3, retry_backoff=60)
    assert queue.run_pending(now=utc(t0)) == 1
    task = queue.get_task(task_id)
    assert task.status == "retrying" and not task.given_up
    retry_at = task.next_run_on
    assert utc(t0 + timedelta(seconds=29)) < retry_at <= utc(t0 + timedelta(seconds=61))
    assert queue.run_pending(now=retry_at - timedelta(seconds=1)) == 0    # backoff holds
    assert queue.run_pending(now=retry_at) == 1
    assert queue.run_pending(now=utc(t0 + timedelta(days=1))) == 1
    task = queue.get_task(task_id)
    assert task.given_up and task.runs == 3
    assert [r.attempt for r in queue.runs_of(task_id)] == [1, 2, 3]


def test_run_pending_takes_no_runner_slot(database):
    queue = database.queue(runner={"limit": 1})
    liveness.register(queue.store)          # this host's only slot is taken
    task_id = queue.add_task("taskrunner.handlers.Echo", data={"x": 1})
    assert queue.run_pending() == 1
    assert final_run(queue, task_id).status == "success"
    queue.close()


def test_run_pending_refuses_a_naive_now(queue):
    from taskrunner import InputError
    with pytest.raises(InputError, match="aware"):
        queue.run_pending(now=utcnow())


# -- 3. wait --------------------------------------------------------------------------------

def test_wait_returns_the_outcome_of_success_give_up_and_cancel(queue):
    done = queue.add_task("taskrunner.handlers.Echo", data={"x": 1})
    failed = queue.add_task(H + "KeyFails", max_retries=1)
    cancelled = queue.add_task("taskrunner.handlers.Echo", scheduled_on=utc(
        utcnow() + timedelta(hours=1)))
    queue.cancel(cancelled)
    queue.run_pending()
    outcome = queue.wait(done, timeout=5)
    assert (outcome.status, outcome.ok, outcome.results, outcome.error_code) == (
        "success", True, {"x": 1}, None)
    outcome = queue.wait(failed, timeout=5)
    assert (outcome.status, outcome.ok, outcome.error_code, outcome.error_message) == (
        "given-up", False, "KeyError", "'amount'")
    assert 'return invoice["amount"]' in outcome.traceback
    outcome = queue.wait(cancelled)
    assert (outcome.status, outcome.ok) == ("cancelled", False)
    assert outcome.to_json()["finished_on"].endswith("+00:00")


def test_wait_times_out_while_the_task_is_retrying(queue):
    t0 = utcnow()
    task_id = queue.add_task(H + "KeyFails", max_retries=3)
    queue.run_pending(now=utc(t0))
    from taskrunner import WaitTimeout      # imported here: the module loads on older code
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match="task %d did not end within 0.3s" % task_id):
        queue.wait(task_id, timeout=0.3)
    assert 0.25 < time.monotonic() - started < 2


def test_wait_is_woken_when_the_run_ends_on_this_host(database):
    """The waiter sleeps on the same-host wake-up: it returns well before its poll."""
    waiter, worker = database.queue(), database.queue()
    task_id = waiter.add_task("taskrunner.handlers.Echo", data={"y": 2},
                              scheduled_on=utc(utcnow() + timedelta(seconds=1)))
    ended = []

    def work():
        wait_for(lambda: time.sleep(0.05) or worker.run_pending() == 1, timeout=30,
                 message="the task to run")
        ended.append(time.monotonic())
    thread = threading.Thread(target=work)
    thread.start()
    outcome = waiter.wait(task_id, timeout=30)
    returned = time.monotonic()
    thread.join()
    assert outcome.results == {"y": 2}
    assert returned - ended[0] < 0.5 if ended else True
    waiter.close()
    worker.close()


def test_cli_wait_exit_codes_and_output(database):
    queue = database.queue()
    done = queue.add_task("taskrunner.handlers.Echo", data={"x": 1})
    failed = queue.add_task(H + "KeyFails", max_retries=1)
    queue.run_pending()
    waiting = queue.add_task("taskrunner.handlers.Echo", scheduled_on=utc(
        utcnow() + timedelta(hours=1)))
    result = taskrunner("wait", str(done), url=database.url)
    assert result.returncode == 0 and "success" in result.stdout and '"x": 1' in result.stdout
    result = taskrunner("wait", str(done), "--json", url=database.url)
    assert result.returncode == 0
    assert json.loads(result.stdout)["results"] == {"x": 1}
    result = taskrunner("wait", str(failed), url=database.url)
    assert result.returncode == 1 and "given-up" in result.stdout
    assert 'return invoice["amount"]' in result.stdout
    assert json.loads(taskrunner("wait", str(failed), "--json", url=database.url).stdout)[
        "status"] == "given-up"
    result = taskrunner("wait", str(waiting), "--timeout", "0.2", url=database.url)
    assert result.returncode == 3 and "did not end within" in result.stderr
    result = taskrunner("wait", str(waiting), "--timeout", "0.2", "--json", url=database.url)
    assert result.returncode == 3
    assert json.loads(result.stdout) == {"task_id": waiting, "status": "timeout"}
    queue.close()


# -- 2. live results ------------------------------------------------------------------------

def test_results_are_visible_to_other_processes_while_the_run_goes_on(database, tmp_path, procs):
    config = database.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\n")
    queue = database.queue()
    go = str(tmp_path / "go")
    task_id = queue.add_task(H + "LiveResults", data={"go": go})
    procs.spawn("runner", config=config, name="runner")

    def results():
        runs = queue.runs_of(task_id)
        return runs and runs[-1].status == "running" and runs[-1].results
    assert wait_for(results, timeout=START_TIMEOUT, message="results of a running run") == {
        "step": 1}
    open(go, "w").close()
    changed = time.monotonic()
    wait_for(lambda: results() == {"step": 2}, timeout=5, message="the changed results")
    assert time.monotonic() - changed < 1.5     # within a second, and a loaded machine
    assert "step" in ok(taskrunner("show", str(task_id), url=database.url))
    open(go + ".2", "w").close()
    outcome = queue.wait(task_id, timeout=30)
    assert outcome.results == {"step": 3, "done": True}
    assert final_run(queue, task_id).results == {"step": 3, "done": True}
    queue.close()


def test_async_handler_is_stopped_by_max_runtime_like_a_sync_one(sqlite_db, tmp_path, procs):
    config = sqlite_db.write_config(tmp_path / "c.toml", (
        "[runner]\npoll_interval = 0.1\nheartbeat_interval = 0.2\n"
        "[overseer]\nkill_grace = 1\n"))
    queue = sqlite_db.queue()
    log = str(tmp_path / "async.log")
    task_id = queue.add_task(H + "AsyncSleeper", data={"log": log, "ignore_stop": True},
                             max_runtime=1.5, max_retries=1)
    after = queue.add_task("taskrunner.handlers.Echo", data={"after": True}, priority=-1)
    procs.spawn("runner", config=config, name="runner")
    outcome = queue.wait(task_id, timeout=START_TIMEOUT)
    assert (outcome.status, outcome.error_code) == ("given-up", "MaxRuntime")
    # The run is ended first (by the runner's own watch), then the coroutine is interrupted.
    wait_for(lambda: read_lines(log) == ["should_stop", "cancelled"], timeout=10,
             message="the coroutine to be cancelled")
    assert queue.wait(after, timeout=START_TIMEOUT).results == {"after": True}
    queue.close()


# -- 7. statistics and the stopping state ---------------------------------------------------

def _crash_one_run(queue):
    """A run whose runner process died: claimed by a registered runner, which is then
    declared dead (what the overseer does for a kill -9)."""
    from taskrunner.runs import lifecycle
    runner = liveness.register(queue.store, take_slot=False)
    assert lifecycle.claim(queue.store, runner.id) is not None
    assert liveness.mark_runner_dead(queue.store, runner.id, "killed in a test")


def test_run_statistics_per_handler_count_crashes_apart(database):
    from taskrunner.reads import records as reads
    queue = database.queue()
    echo = "taskrunner.handlers.Echo"
    for n in range(2):
        queue.add_task(echo, data={"n": n})
    queue.add_task(H + "KeyFails", max_retries=1)
    queue.run_pending()
    queue.add_task(H + "KeyFails", max_retries=1)
    _crash_one_run(queue)
    queue.add_task(echo, scheduled_on=utc(utcnow() + timedelta(hours=1)))   # never run
    stats = reads.run_stats(queue.store)
    assert set(stats) == {echo, H + "KeyFails"}
    ok_stats, bad = stats[echo], stats[H + "KeyFails"]
    assert (ok_stats.runs, ok_stats.successes, ok_stats.errors, ok_stats.crashes) == (2, 2, 0, 0)
    assert (bad.runs, bad.successes, bad.errors, bad.crashes) == (2, 0, 1, 1)
    assert ok_stats.last_success is not None and ok_stats.last_success.tzinfo is not None
    assert ok_stats.last_finish >= ok_stats.last_start
    assert bad.last_success is None and bad.last_finish >= bad.last_start
    assert 0 <= ok_stats.avg_duration <= ok_stats.p95_duration < 60
    assert bad.avg_duration is not None      # the crash is not among the durations

    status = json.loads(ok(taskrunner("status", "--json", url=database.url)))
    assert status["handlers"][echo]["successes"] == 2
    assert status["handlers"][H + "KeyFails"]["crashes"] == 1
    assert status["handlers"][echo]["last_success"].endswith("+00:00")
    assert (status["retrying"], status["given_up"]) == (0, 2)
    text = ok(taskrunner("status", url=database.url))
    assert "failed tasks: 0 retrying, 2 given up" in text
    [line] = [line for line in text.splitlines() if line.startswith(H + "KeyFails")]
    assert line.split()[1:5] == ["2", "0", "1", "1"]
    queue.close()


def test_consecutive_crashes_are_kept_apart_reset_and_back_off_a_crash(database):
    """Issue 30, TimescaleDB's crash accounting: runs ended by a dead runner are counted in a
    row per task and per periodic task, next to the totals; a run that ends by itself resets
    the count, a success resets everything; a crash found at an overseer's start waits
    crash_grace doubled by each crash before it in a row."""
    from taskrunner.periodic import scheduler as periodic
    from taskrunner.runs import lifecycle
    queue = database.queue()
    store = queue.store
    t = utcnow()
    periodic.add_periodic(store, "nightly", "taskrunner.handlers.Echo", "every 1h",
                          max_retries=10, now=t - timedelta(hours=1, seconds=1))
    periodic.PeriodicScheduler(store).run_pending(now=t)
    [task_id] = [task.id for task in queue.tasks()]

    def claimed_run(now):
        runner = liveness.register(store, take_slot=False)
        lifecycle.create_missing_runs(store, now=now)
        claimed = lifecycle.claim(store, runner.id, now=now)
        assert claimed is not None and claimed.task_id == task_id
        return runner.id, claimed

    def crash(now, grace=None):
        runner_id, _ = claimed_run(now)
        retry_at = now + timedelta(seconds=grace) if grace else None
        assert liveness.mark_runner_dead(store, runner_id, "killed", now=now, retry_at=retry_at)

    def end(now, status):
        runner_id, claimed = claimed_run(now)
        assert lifecycle.end_run(store, claimed.run_id, task_id, status, runner_id=runner_id,
                                 error_code="Boom" if status == "error" else None, now=now,
                                 periodic_task_id=claimed.periodic_task_id)

    def counts():
        task = queue.get_task(task_id)
        [row] = json.loads(ok(taskrunner("periodic", "list", "--json", url=database.url)))
        shown = json.loads(ok(taskrunner("show", str(task_id), "--json", url=database.url)))
        assert (shown["runs_crashed"], shown["crash_count"]) == (task.runs_crashed,
                                                                 task.crash_count)
        return (task.runs_failed, task.runs_crashed, task.crash_count,
                row["consecutive_failures"], row["consecutive_crashes"], row["crash_count"])

    def waits(now):
        return (queue.get_task(task_id).next_run_on - utc(now)).total_seconds()

    crash(t, grace=60)
    assert counts() == (1, 1, 1, 1, 1, 1)
    assert 59 <= waits(t) <= 61                  # crash_grace
    t += timedelta(hours=2)
    crash(t, grace=60)
    assert counts() == (2, 2, 2, 2, 2, 2)
    assert 119 <= waits(t) <= 121                # doubled: the second crash in a row
    t += timedelta(hours=2)
    end(t, "error")                              # a failure of its own: no crash loop
    assert counts() == (3, 0, 2, 3, 0, 2)
    t += timedelta(hours=2)
    crash(t, grace=60)
    assert counts() == (4, 1, 3, 4, 1, 3)
    # Counted again from the first: crash_grace, or the backoff of 4 failures if longer.
    assert 59 <= waits(t) <= 81
    table = ok(taskrunner("periodic", "list", "--wide", url=database.url)).splitlines()
    header = table[0].split()
    assert header[header.index("FAILURES") + 1] == "CRASHED"
    [line] = [line for line in table if line.startswith("nightly ")]
    assert re.search(r" timeout +4 +1 ", line), line
    tasks = ok(taskrunner("tasks", url=database.url)).splitlines()
    assert tasks[0].split()[4:6] == ["FAILED", "CRASHED"]
    assert tasks[1].split()[4:6] == ["4", "1"]
    t += timedelta(hours=2)
    end(t, "success")
    assert counts() == (0, 0, 3, 0, 0, 3)
    queue.close()


def test_statistics_of_a_periodic_task_in_periodic_list(database):
    from taskrunner.periodic import scheduler as periodic
    queue = database.queue()
    periodic.add_periodic(queue.store, "hourly", H + "KeyFails", "every 1h", max_retries=1,
                          now=utcnow() - timedelta(hours=1, seconds=1))
    periodic.add_periodic(queue.store, "idle", H + "KeyFails", "every 1h")
    periodic.PeriodicScheduler(queue.store).run_pending()
    assert queue.run_pending() == 1
    rows = json.loads(ok(taskrunner("periodic", "list", "--json", url=database.url)))
    stats = {r["name"]: r["stats"] for r in rows}
    assert (stats["hourly"]["runs"], stats["hourly"]["errors"], stats["hourly"]["crashes"]) == (
        1, 1, 0)
    assert stats["hourly"]["last_finish"].endswith("+00:00")
    assert stats["idle"]["runs"] == 0 and stats["idle"]["avg_duration"] is None
    table = ok(taskrunner("periodic", "list", "--wide", url=database.url)).splitlines()
    assert table[0].split()[-6:] == ["RUNS", "OK", "ERRORS", "CRASHES", "AVG", "P95"]
    [line] = [line for line in table if line.startswith("hourly ")]
    assert line.split()[-6:-2] == ["1", "0", "1", "0"]
    queue.close()


def test_a_runner_winding_down_its_run_shows_as_stopping(sqlite_db, tmp_path, procs):
    import signal
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\n")
    queue = sqlite_db.queue()
    go = str(tmp_path / "go")
    task_id = queue.add_task(H + "LiveResults", data={"go": go})
    runner = procs.spawn("runner", config=config, name="runner")

    def state():
        rows = json.loads(ok(taskrunner("status", "--json", url=sqlite_db.url)))["runners"]
        return [(r["state"], r["task_id"]) for r in rows]
    wait_for(lambda: state() == [("running", task_id)], timeout=START_TIMEOUT,
             message="the runner to run the task")
    os.kill(runner.pid, signal.SIGTERM)      # graceful: it finishes the run first
    wait_for(lambda: state() == [("stopping", task_id)], timeout=5, message="stopping")
    assert "stopping" in ok(taskrunner("status", url=sqlite_db.url))
    open(go, "w").close()
    open(go + ".2", "w").close()
    assert procs.wait(runner) == 0
    assert queue.wait(task_id, timeout=10).status == "success"
    assert state() == []
    queue.close()


def test_a_run_past_its_max_runtime_shows_as_stopping_until_the_runner_exits(
        database_sp, tmp_path, procs):
    """Issue 30, TimescaleDB's TERMINATING: a handler that ignores TERM and every
    interruption; its run timed out (MaxRuntime) by the queue pass, a heartbeat before its
    runner notices. From that moment until the runner's hard exit after kill_grace, `status`
    shows the runner stopping, why and since when — not ``running`` with no run."""
    config = database_sp.write_config(tmp_path / "c.toml", (
        # A heartbeat every 6 s: the reads below, between the pass and the runner's own
        # notice, fit in it even at a load average of 25 (2 s did not).
        "[runner]\npoll_interval = 0.1\nheartbeat_interval = 6\n[overseer]\nkill_grace = 3\n"))
    queue = database_sp.queue()
    log = str(tmp_path / "run.log")
    task_id = queue.add_task(H + "Stubborn", data={"log": log}, max_runtime=1, max_retries=1)
    runner = procs.spawn("runner", config=config, name="runner")
    wait_for(lambda: read_lines(log) == ["started"], timeout=START_TIMEOUT,
             message="the handler to start")

    def runners():
        return json.loads(ok(taskrunner("status", "--json", url=database_sp.url)))["runners"]

    def queue_pass():
        ok(taskrunner("run-event", "task-queue:OnProcess", url=database_sp.url))
        return final_run(queue, task_id).status == "timeout"
    wait_for(queue_pass, timeout=10, message="the queue pass to time the run out")
    [row] = runners()
    run = final_run(queue, task_id)
    assert row["state"] == "stopping", row
    assert row["stopping_reason"] == "run %d timed out: running longer than 1s (max_runtime)" \
        % run.id
    since = row["stopping_since"]
    assert datetime.fromisoformat(since) == run.finished_on
    assert (row["run_id"], row["task_id"]) == (run.id, task_id)      # the run it stops
    text = ok(taskrunner("status", url=database_sp.url))
    assert "runner %d stopping since " % row["id"] in text and "(max_runtime)" in text
    [shown] = json.loads(ok(taskrunner("runs", str(task_id), "--json", url=database_sp.url)))
    assert (shown["status"], shown["stopping_reason"], shown["stopping_since"]) == (
        "timeout", row["stopping_reason"], since)
    lines = ok(taskrunner("runs", str(task_id), url=database_sp.url)).splitlines()
    assert lines[1].split()[:3] == [str(run.id), "1", "stopping"]
    assert "run %d stopping since " % run.id in lines[3]   # after the table and its zone line
    # The runner noticed and interrupted its handler, which runs on: its own reason, the
    # same since.
    wait_for(lambda: "interrupted" in (runners()[0]["stopping_reason"] or ""), timeout=15,
             message="the runner's own reason")
    assert runners()[0]["stopping_since"] == since
    assert procs.wait(runner) != 0           # exited hard after kill_grace
    queue_pass()                             # notices it gone
    assert runners() == []
    [shown] = queue.runs_of(task_id)
    assert (shown.status, shown.stopping_reason) == ("timeout", None)
    queue.close()


# -- 8. cancel of a running task ------------------------------------------------------------

@pytest.mark.parametrize("stubborn", [False, True], ids=["cooperative", "interrupted"])
def test_cancel_of_a_running_task_stops_it_and_ends_it_cancelled(database_sp, tmp_path, procs,
                                                                   stubborn):
    config = database_sp.write_config(tmp_path / "c.toml", (
        "[runner]\npoll_interval = 0.1\nheartbeat_interval = 0.3\n[overseer]\nkill_grace = 1\n"))
    queue = database_sp.queue()
    log = str(tmp_path / "run.log")
    task_id = queue.add_task(H + "UntilStopped", data={"log": log, "stubborn": stubborn})
    after = queue.add_task("taskrunner.handlers.Echo", data={"next": 1}, priority=-1)
    runner = procs.spawn("runner", config=config, name="runner")
    wait_for(lambda: read_lines(log) == ["started"], timeout=START_TIMEOUT,
             message="the handler to start")
    out = ok(taskrunner("cancel", str(task_id), url=database_sp.url))
    assert "is asked to stop" in out
    outcome = queue.wait(task_id, timeout=30)
    assert outcome.status == "cancelled"
    run = final_run(queue, task_id)
    assert (run.status, run.error_code) == ("cancelled", "Cancelled")
    assert run.results["done"] >= 1
    assert read_lines(log) == ["started", "should_stop"]
    if stubborn:
        assert "interrupted" in run.error_message
    assert queue.wait(after, timeout=30).results == {"next": 1}    # the runner goes on
    assert runner.poll() is None

    def states():
        return [r["state"] for r in json.loads(ok(taskrunner(
            "status", "--json", url=database_sp.url)))["runners"]]
    wait_for(lambda: states() == ["running"], timeout=10, message="running again")
    queue.close()


# -- 8. the operator's filters and bulk verbs -----------------------------------------------

def test_tasks_filters_offset_all_and_showing_n_of_m(database):
    queue = database.queue()
    echo = "taskrunner.handlers.Echo"
    t0 = utcnow()
    ids = [enqueue_at(queue, echo, t0 + timedelta(minutes=n)) for n in range(5)]
    fails = [enqueue_at(queue, H + "KeyFails", t0 + timedelta(minutes=10 + n), max_retries=3)
             for n in range(2)]
    queue.run_pending(now=utc(t0 + timedelta(minutes=20)))
    url = database.url
    out = ok(taskrunner("tasks", "--handler", echo, "--limit", "2", url=url))
    assert [line.split()[0] for line in out.splitlines()[1:3]] == [str(ids[4]), str(ids[3])]
    assert out.splitlines()[-1].startswith("showing 2 of 5 tasks (--offset, --limit or --all "
                                           "for the others); times are local: ")
    out = ok(taskrunner("tasks", "--handler", echo, "--limit", "2", "--offset", "2", url=url))
    assert [line.split()[0] for line in out.splitlines()[1:3]] == [str(ids[2]), str(ids[1])]
    listed = json.loads(ok(taskrunner("tasks", "--all", "--json", url=url)))
    assert [t["id"] for t in listed] == list(reversed(ids + fails))
    since = utc(t0 + timedelta(minutes=1)).isoformat()
    until = utc(t0 + timedelta(minutes=3)).isoformat()
    listed = json.loads(ok(taskrunner("tasks", "--since", since, "--until", until, "--json",
                                      url=url)))
    assert [t["id"] for t in listed] == [ids[2], ids[1]]
    # A task waiting to retry shows when it runs next, and its error.
    out = ok(taskrunner("tasks", "--handler", H + "KeyFails", url=url))
    assert "NEXT RUN" in out.splitlines()[0]
    line = out.splitlines()[1]
    retry_at = queue.get_task(fails[1]).next_run_on.astimezone()     # local, to the second
    assert retry_at.strftime("%H:%M:%S") in line and "KeyError: 'amount'" in line
    assert "+00:00" not in out                  # compact times in tables, ISO in --json
    assert out.splitlines()[-1].startswith("showing 2 of 2 tasks; times are local: ")
    queue.close()


def enqueue_at(queue, handler, when, **options):
    from taskrunner.runs import enqueue
    return enqueue.add_task(queue.store, handler, scheduled_on=utc(when), now=when, **options)


def test_retry_and_cancel_many_by_ids_and_by_filter(database):
    queue = database.queue()
    t0 = utcnow()
    failed = [enqueue_at(queue, H + "KeyFails", t0, max_retries=1) for _ in range(3)]
    ok_id = enqueue_at(queue, "taskrunner.handlers.Echo", t0)
    queue.run_pending(now=utc(t0))
    url = database.url
    out = ok(taskrunner("retry", str(failed[0]), str(failed[1]), str(ok_id), url=url))
    assert out.splitlines()[0] == "re-armed 2 of 3 task(s)"
    assert "task %d is success" % ok_id in out
    assert [queue.get_task(i).status for i in failed] == ["scheduled", "scheduled", "given-up"]
    out = ok(taskrunner("retry", "--status", "given-up", "--handler", H + "KeyFails", url=url))
    assert out.splitlines()[0] == "re-armed 1 of 1 task(s)"
    out = ok(taskrunner("cancel", "--handler", H + "KeyFails", url=url))
    assert out.splitlines()[0] == "cancelled (or asked to stop) 3 of 3 task(s)"
    assert {queue.get_task(i).status for i in failed} == {"cancelled"}
    assert queue.get_task(ok_id).status == "success"
    assert json.loads(ok(taskrunner("retry", str(ok_id), str(failed[0]), "--json", url=url))) == {
        "changed": [], "refused": ["task %d is success; only a failed or given-up task can be "
                                   "retried" % ok_id,
                                   "task %d is cancelled; only a failed or given-up task can "
                                   "be retried" % failed[0]], "missing": []}
    late = enqueue_at(queue, "taskrunner.handlers.Echo", t0 + timedelta(days=1))
    assert json.loads(ok(taskrunner("cancel", str(late), "--json", url=url))) == {
        "task_id": late, "status": "cancelled", "run_id": None}
    result = taskrunner("retry", url=url)
    assert result.returncode == 2 and "give task ids, or filters" in result.stderr
    result = taskrunner("cancel", "--periodic", "nope", url=url)
    assert result.returncode == 2 and "no periodic task named 'nope'" in result.stderr
    queue.close()


# -- 8. CLI polish ------------------------------------------------------------------------

def test_version_option():
    from taskrunner import __version__
    result = taskrunner("--version")
    assert (result.returncode, result.stdout) == (0, "taskrunner %s\n" % __version__)


def test_a_closed_pipe_ends_the_command_quietly(sqlite_db):
    import subprocess
    from conftest import process_env
    queue = sqlite_db.queue()
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "data": {"n": n}}
                     for n in range(3000)])
    queue.close()
    proc = subprocess.Popen([sys.executable, "-m", "taskrunner", "--database", sqlite_db.url,
                             "tasks", "--all"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=process_env())
    assert proc.stdout.readline().startswith(b"ID ")
    proc.stdout.close()                       # `| head -1`
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141           # 128 + SIGPIPE, as a shell reports it
    assert stderr == "", stderr


def test_first_command_on_a_new_database_prints_no_migration_lines(tmp_path):
    url = "sqlite:///%s" % (tmp_path / "new.db")
    result = taskrunner("add", "taskrunner.handlers.Echo", url=url)
    assert (result.returncode, result.stdout, result.stderr) == (0, "1\n", "")


def test_rotate_json(sqlite_db):
    sqlite_db.queue().close()
    assert json.loads(ok(taskrunner("rotate", "--json", url=sqlite_db.url))) == {
        "success": 0, "failed": 0, "runners": 0}


def test_json_log_format_one_object_per_line_with_the_run_fields(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "c.toml", '[log]\nformat = "json"\n')
    queue = sqlite_db.queue()
    good = queue.add_task("taskrunner.handlers.Echo", data={"x": 1})
    bad = queue.add_task(H + "KeyFails", max_retries=1)
    queue.close()
    result = taskrunner("runner", "--burst", config=config)
    assert result.returncode == 0, result.stderr
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    assert all({"time", "level", "logger", "pid", "message"} <= set(e) for e in entries)
    finished = {e["task_id"]: e for e in entries if "run_id" in e and e["status"] != "given-up"}
    assert (finished[good]["status"], finished[good]["handler"], finished[good]["level"]) == (
        "success", "taskrunner.handlers.Echo", "INFO")
    assert finished[good]["duration"] >= 0 and finished[good]["time"].endswith("+00:00")
    assert (finished[bad]["status"], finished[bad]["error_code"], finished[bad]["level"]) == (
        "error", "KeyError", "WARNING")
    assert 'return invoice["amount"]' in finished[bad]["message"]
    [gave_up] = [e for e in entries if e.get("status") == "given-up"]
    assert (gave_up["task_id"], gave_up["level"]) == (bad, "ERROR")


def test_runner_process_is_named_apart_in_ps(sqlite_db, tmp_path, procs):
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\n")
    sqlite_db.queue().close()
    runner = procs.spawn("runner", config=config, name="runner")

    def comm():
        with open("/proc/%d/comm" % runner.pid) as fh:
            return fh.read().strip()
    wait_for(lambda: comm() == "tr-runner-1", timeout=START_TIMEOUT, message="the name")


def test_a_cancelled_run_whose_runner_dies_ends_its_task_cancelled_not_retried(queue):
    from taskrunner.runs import lifecycle
    task_id = queue.add_task("taskrunner.handlers.Echo", max_retries=5)
    runner = liveness.register(queue.store, take_slot=False)
    claimed = lifecycle.claim(queue.store, runner.id)
    assert queue.cancel(task_id) == claimed.run_id
    assert liveness.mark_runner_dead(queue.store, runner.id, "killed before it noticed")
    task = queue.get_task(task_id)
    assert (task.status, task.next_run_on, task.finished_on is not None) == (
        "cancelled", None, True)
    assert final_run(queue, task_id).error_code == "RunnerDied"
    assert queue.wait(task_id, timeout=5).status == "cancelled"


def test_overseer_process_is_named_apart_in_ps(sqlite_db, tmp_path, procs):
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\nlimit = 1\n")
    sqlite_db.queue().close()
    overseer = procs.spawn("overseer", config=config, name="overseer")

    def comm():
        with open("/proc/%d/comm" % overseer.pid) as fh:
            return fh.read().strip()
    wait_for(lambda: comm() == "tr-overseer", timeout=START_TIMEOUT, message="the name")


def test_json_of_init_db_and_the_periodic_verbs(sqlite_db):
    url = sqlite_db.url
    assert json.loads(ok(taskrunner("init-db", "--json", url=url))) == {
        "database": url, "schema": "up to date"}
    added = json.loads(ok(taskrunner("periodic", "add", "job", "taskrunner.handlers.Echo",
                                     "every 1h", "--json", url=url)))
    assert (added["name"], added["timer"], added["enabled"]) == ("job", "every 1h", True)
    assert added["nextrun"].endswith("+00:00")
    for verb, done in (("disable", "disabled"), ("enable", "enabled"), ("remove", "removed")):
        assert json.loads(ok(taskrunner("periodic", verb, "job", "--json", url=url))) == {
            "name": "job", "done": done}
    assert ok(taskrunner("periodic", "add", "job", "taskrunner.handlers.Echo", "every 1h",
                         url=url)).startswith("periodic task 'job' added")
    assert ok(taskrunner("periodic", "disable", "job", url=url)) == \
        "periodic task 'job' disabled\n"
