"""Durable execution in-process, on SQLite, PostgreSQL and MariaDB (DESIGN "Durable
execution", rule 10): checkpoints seen by the next attempt, steps run once (a step's own
write to the queue's database exactly once), durable sleep and events, and how each is
shown (API, CLI --json and text, dashboard, metrics). The real-process tests (stops, HUP,
kill -9, chaos) are in test_durable_processes.py."""
import json
import threading
from datetime import datetime, timedelta, timezone

import pytest

from conftest import ok, taskrunner, usage_error
from dashboard_helpers import Served, fetch
from durable_handlers import insert_app_row, lines
from taskrunner import EventTimeout
from taskrunner.errors import InputError, StateError, TaskNotFound
from taskrunner.runs import durable
from taskrunner.store.models import Run, Task, utcnow
from taskrunner.web.metrics import exposition

H = "durable_handlers."
T0 = datetime(2030, 1, 7, 9, 0, tzinfo=timezone.utc)     # a Monday


def app_table(queue, name="app_rows"):
    queue.store.db.execute_sql("CREATE TABLE %s (task_id INTEGER NOT NULL, step VARCHAR(64) "
                               "NOT NULL)" % name)
    return name


def app_rows(queue, name="app_rows"):
    return sorted(tuple(r) for r in queue.store.db.execute_sql(
        "SELECT task_id, step FROM %s" % name).fetchall())


@pytest.fixture
def queue(database):
    """The test's queue, retrying at once (retry_backoff 0); closed at the test's end."""
    queue = database.queue(task={"retry_backoff": 0})
    yield queue
    queue.close()


@pytest.fixture
def log(tmp_path):
    """The file the durable handlers append their lines to."""
    return str(tmp_path / "log")


def drain(queue, now=None):
    """run_pending until nothing is left (a retry's run is created by the next pass)."""
    total = 0
    while True:
        done = queue.run_pending(now=now)
        if not done:
            return total
        total += done


@pytest.mark.timeout(120)
def test_a_checkpoint_is_what_the_next_attempt_resumes_from(queue, database, log):
    task_id = queue.add_task(H + "CheckpointThenFail", {"log": log})
    drain(queue)
    assert lines(log) == [["1", "None"], ["2", "{'done':", "3}"]]
    task = queue.get_task(task_id)
    assert task.status == "success" and task.results == {"resumed_from": {"done": 3}}
    assert task.checkpoint == {"done": 3} and task.checkpoint_on is not None
    first = queue.runs_of(task_id)[0]
    assert (first.status, first.percent_completed) == ("error", 30)
    shown = json.loads(ok(taskrunner("show", str(task_id), "--json", url=database.url)))
    assert shown["checkpoint"] == {"done": 3}
    text = ok(taskrunner("show", str(task_id), url=database.url))
    assert 'checkpoint:' in text and '{"done": 3}' in text


@pytest.mark.timeout(120)
def test_steps_run_once_and_a_step_write_commits_exactly_once(queue, database, log):
    """The plain step's function and the transaction step's are called once each, on the
    first attempt; the retry gets their stored results; the app row written inside the step's
    transaction exists once. Listed with status, duration and result in the API, show/runs
    (--json and text)."""
    table = app_table(queue)
    task_id = queue.add_task(H + "StepsThenFail", {"log": log, "table": table})
    drain(queue)
    assert lines(log) == [["charge", "1"], ["write", "1"]]
    assert app_rows(queue) == [(task_id, "write")]
    task = queue.get_task(task_id)
    assert task.status == "success", task
    assert task.results == {"first": {"charged": 42},
                            "second": {"task": task_id, "step": "write"},
                            "key": "taskrunner-%d-charge" % task_id}
    steps = queue.steps_of(task_id)
    assert [(s.name, s.kind, s.status, s.attempt) for s in steps] == [
        ("charge", "step", "done", 1), ("write", "step", "done", 1)]
    assert steps[0].result == {"charged": 42} and steps[0].duration >= 0
    first_run = queue.runs_of(task_id)[0]
    assert [s.name for s in first_run.steps] == ["charge", "write"]
    shown = json.loads(ok(taskrunner("show", str(task_id), "--json", url=database.url)))
    assert [(s["name"], s["status"], s["result"]) for s in shown["steps"]] == [
        ("charge", "done", {"charged": 42}), ("write", "done", {"task": task_id,
                                                               "step": "write"})]
    runs = json.loads(ok(taskrunner("runs", str(task_id), "--json", url=database.url)))
    assert [s["name"] for s in runs[0]["steps"]] == ["charge", "write"] and runs[1]["steps"] == []
    text = ok(taskrunner("runs", str(task_id), url=database.url))
    assert "steps:" in text and "charge" in text and '{"charged":42}' in text
    assert "charge" in ok(taskrunner("show", str(task_id), url=database.url))


@pytest.mark.timeout(120)
def test_a_transaction_step_that_raises_keeps_nothing(queue):
    table = app_table(queue)
    task_id = queue.add_task(H + "FailingTransactionStep", {"table": table}, max_retries=2)
    drain(queue)
    assert queue.get_task(task_id).given_up
    assert app_rows(queue) == [] and queue.steps_of(task_id) == []


@pytest.mark.timeout(120)
def test_two_attempts_racing_on_one_step_record_it_once_and_keep_one_app_write(queue):
    """An attempt that lost its run (timed out while it ran) and the attempt that took over
    both run a transaction step: the unique (task, name) record lets one commit; the other's
    app write rolls back with its transaction and it gets the first one's result."""
    table = app_table(queue)
    task_id = queue.add_task("taskrunner.handlers.Echo")
    a = durable.DurableRun(queue.store, 1, task_id, 1, None)
    b = durable.DurableRun(queue.store, 2, task_id, 2, None)
    a._load(), b._load()          # both read the task before either recorded the step
    first = a.step("pay", lambda conn: insert_app_row(conn, table, task_id, "a"), (), {},
                   in_transaction=True)
    second = b.step("pay", lambda conn: insert_app_row(conn, table, task_id, "b"), (), {},
                    in_transaction=True)
    assert first == second == {"task": task_id, "step": "a"}
    assert app_rows(queue) == [(task_id, "a")]
    assert [s.name for s in queue.steps_of(task_id)] == ["pay"]
    # A plain step: the later value is discarded, the stored one returned.
    assert a.step("n", lambda: 1, (), {}) == 1 and b.step("n", lambda: 2, (), {}) == 1


@pytest.mark.timeout(120)
def test_concurrent_transaction_steps_in_threads_write_once(queue):
    """Eight threads, each its own connection, run the same transaction step of one task at
    once: one app row, one step record, and every thread returns the recorded result."""
    table = app_table(queue)
    task_id = queue.add_task("taskrunner.handlers.Echo")
    results, errors, barrier = [], [], threading.Barrier(8)

    def attempt(n):
        try:
            run = durable.DurableRun(queue.store, n, task_id, n, None)
            run._load()
            barrier.wait(60)
            results.append(run.step("pay", lambda conn: insert_app_row(
                conn, table, task_id, "t%d" % n), (), {}, in_transaction=True))
        except Exception as exc:    # reported below
            errors.append(exc)
        finally:
            queue.store.close()
    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    rows = app_rows(queue)
    assert len(rows) == 1 and results == [{"task": task_id, "step": rows[0][1]}] * 8
    assert len(queue.steps_of(task_id)) == 1


@pytest.mark.timeout(120)
def test_durable_sleep_ends_the_run_waiting_and_resumes_after_the_steps_done(queue, database, log):
    task_id = queue.add_task(H + "SleepBetweenSteps", {"log": log, "seconds": 3600}, max_retries=1)
    assert queue.run_pending(now=T0) == 1
    task = queue.get_task(task_id)
    assert task.status == "waiting" and task.finished_on is None and task.runs_failed == 0
    assert task.waiting_until == T0.replace(tzinfo=timezone.utc) + timedelta(hours=1)
    assert task.waiting_for is None and not task.given_up
    run = queue.runs_of(task_id)[0]
    assert (run.status, run.error_code) == ("waiting", "Sleeping")
    assert Run.select().where(Run.status.in_(["scheduled", "running"])).count() == 0
    # Nothing is due before the time: the claim has nothing to take.
    assert queue.run_pending(now=T0 + timedelta(minutes=59)) == 0
    listed = json.loads(ok(taskrunner("tasks", "--status", "waiting", "--json",
                                      url=database.url)))
    assert [(t["id"], t["status"]) for t in listed] == [(task_id, "waiting")]
    assert listed[0]["waiting_until"].startswith("2030-01-07T10:00:00")
    assert "until" in ok(taskrunner("tasks", url=database.url))
    assert 'taskrunner_tasks{status="waiting"} 1.0' in exposition(queue.store).decode()
    assert queue.run_pending(now=T0 + timedelta(hours=1, seconds=1)) == 1
    task = queue.get_task(task_id)
    assert task.status == "success" and task.results == {"attempt": 2}
    assert lines(log) == [["before", "1"], ["after", "2"]]
    assert [(s.name, s.kind) for s in queue.steps_of(task_id)] == [
        ("before", "step"), ("sleep-1", "sleep"), ("after", "step")]


@pytest.mark.timeout(120)
def test_an_event_wakes_its_waiting_task_at_once_with_its_payload(queue, log):
    task_id = queue.add_task(H + "WaitForApproval", {"log": log})
    assert queue.run_pending() == 1
    task = queue.get_task(task_id)
    assert (task.status, task.waiting_for, task.waiting_until) == ("waiting", "approved", None)
    assert queue.run_pending() == 0           # waits for ever: no due time, no run
    # Another event is kept, and wakes nothing.
    assert queue.send_event(task_id, "other", 1) is False
    assert queue.get_task(task_id).status == "waiting"
    assert queue.send_event(task_id, "approved", {"by": "ann"}) is True
    # The run was created with the event, in its transaction.
    assert Run.select().where((Run.task_id == task_id) & (Run.status == "scheduled")).count() == 1
    assert queue.run_pending() == 1
    task = queue.get_task(task_id)
    assert task.status == "success" and task.results == {"approved": {"by": "ann"}}
    assert [(s.name, s.result) for s in queue.steps_of(task_id)] == [
        ("event:approved", {"payload": {"by": "ann"}})]
    with pytest.raises(StateError):
        queue.send_event(task_id, "approved", 2)
    with pytest.raises(TaskNotFound):
        queue.send_event(task_id + 1000, "approved")
    with pytest.raises(InputError):
        queue.send_event(task_id, "", 1)


@pytest.mark.timeout(120)
def test_an_event_sent_before_the_wait_is_kept_for_it(queue, log):
    task_id = queue.add_task(H + "WaitForApproval", {"log": log})
    assert queue.send_event(task_id, "approved", "early") is False
    assert queue.run_pending() == 1
    assert queue.get_task(task_id).results == {"approved": "early"}
    assert lines(log) == [["start", "1"]]


@pytest.mark.timeout(120)
def test_a_wait_with_a_timeout_fails_with_event_timeout_when_nothing_comes(queue, log):
    """Uncaught, EventTimeout gives the task up at once: max_retries more runs would each
    fail the same way on the recorded timeout."""
    task_id = queue.add_task(H + "WaitForApproval", {"log": log, "timeout": 600}, max_retries=5)
    queue.run_pending(now=T0)
    task = queue.get_task(task_id)
    assert task.status == "waiting" and task.waiting_for == "approved"
    assert task.waiting_until == T0 + timedelta(minutes=10)
    assert drain(queue, now=T0 + timedelta(minutes=11)) == 1
    task = queue.get_task(task_id)
    assert task.given_up and task.last_error_code == "EventTimeout", task
    assert task.runs_failed == 1 and [r.status for r in queue.runs_of(task_id)] == [
        "waiting", "error"]
    assert issubclass(EventTimeout, Exception)


@pytest.mark.timeout(120)
def test_a_second_wait_of_one_name_waits_for_a_second_event(queue, log):
    """Issue 40: the second ``wait_for("shipped")`` of an attempt waits for (and consumes) a
    second event, recorded as the step ``event-2:shipped``; it does not return the first
    payload again."""
    task_id = queue.add_task(H + "WaitTwice", {"log": log})
    assert queue.run_pending() == 1
    assert queue.send_event(task_id, "shipped", "parcel-1") is True
    assert queue.run_pending() == 1
    task = queue.get_task(task_id)
    assert (task.status, task.waiting_for) == ("waiting", "shipped"), task
    assert queue.run_pending() == 0         # the first event is consumed: nothing wakes it
    assert queue.send_event(task_id, "shipped", "parcel-2") is True
    assert queue.run_pending() == 1
    task = queue.get_task(task_id)
    assert task.status == "success" and task.results == {"shipped": ["parcel-1", "parcel-2"]}
    assert lines(log) == [["first", "2", "parcel-1"], ["first", "3", "parcel-1"],
                          ["second", "3", "parcel-2"]]
    assert [(s.name, s.kind, s.result) for s in queue.steps_of(task_id)] == [
        ("event:shipped", "event", {"payload": "parcel-1"}),
        ("event-2:shipped", "event", {"payload": "parcel-2"})]


@pytest.mark.timeout(120)
def test_events_sent_before_the_waits_are_taken_in_order_and_replayed_alike(queue, log):
    """Events kept before the waits go to the waits of their name in the order sent, one
    each; a later attempt replays the same payloads and consumes no more events."""
    task_id = queue.add_task(H + "WaitTwice", {"log": log, "fail_first": True}, max_retries=2)
    for payload in ("a", "b", "c"):
        assert queue.send_event(task_id, "shipped", payload) is False
    drain(queue)
    task = queue.get_task(task_id)
    assert task.status == "success" and task.results == {"shipped": ["a", "b"]}, task
    assert lines(log) == [["first", "1", "a"], ["second", "1", "b"],
                          ["on_failure", "1", "TaskError"], ["first", "2", "a"],
                          ["second", "2", "b"]]
    Event = queue.store.Event
    assert [(e.payload, e.consumed_on is not None) for e in Event.select().where(
        Event.task_id == task_id).order_by(Event.id)] == [
        ('"a"', True), ('"b"', True), ('"c"', False)]


@pytest.mark.timeout(120)
def test_an_uncaught_event_timeout_gives_up_at_once_whatever_max_retries(queue, log):
    """Issue 40: an uncaught EventTimeout is not retried (every retry would fail at once on
    the recorded timeout): the task gives up after that one failed run, with the error kept
    and on_give_up called. Each wait of a name has its own deadline (``deadline:NAME``,
    ``deadline-2:NAME``), counted from its own first call."""
    task_id = queue.add_task(H + "WaitTwice", {"log": log, "timeout": 600}, max_retries=5)
    queue.run_pending(now=T0)
    assert queue.get_task(task_id).waiting_until == T0 + timedelta(minutes=10)
    assert queue.send_event(task_id, "shipped", "parcel-1") is True
    queue.run_pending(now=T0 + timedelta(minutes=5))
    task = queue.get_task(task_id)
    assert task.status == "waiting" and task.waiting_until == T0 + timedelta(minutes=15), task
    assert queue.run_pending(now=T0 + timedelta(minutes=14)) == 0
    assert drain(queue, now=T0 + timedelta(minutes=16)) == 1
    assert drain(queue, now=T0 + timedelta(days=1)) == 0          # no further run
    task = queue.get_task(task_id)
    assert task.given_up and task.finished_on is not None, task
    assert (task.status, task.runs_failed, task.last_error_code) == ("given-up", 1, "EventTimeout")
    assert "'shipped'" in task.last_error_message
    assert [t.id for t in queue.tasks(status="given-up")] == [task_id]
    assert [r.status for r in queue.runs_of(task_id)] == ["waiting", "waiting", "error"]
    assert lines(log) == [["first", "2", "parcel-1"], ["first", "3", "parcel-1"],
                          ["on_failure", "3", "EventTimeout"], ["on_give_up", "EventTimeout", "1"]]
    assert [(s.name, s.kind) for s in queue.steps_of(task_id)] == [
        ("deadline:shipped", "deadline"), ("event:shipped", "event"),
        ("deadline-2:shipped", "deadline"), ("event-2:shipped", "event")]
    assert queue.steps_of(task_id)[-1].result == {"timeout": True}


@pytest.mark.timeout(120)
def test_a_waiting_task_can_be_cancelled(queue, log):
    task_id = queue.add_task(H + "WaitForApproval", {"log": log})
    drain(queue)
    assert queue.cancel(task_id) is None
    assert queue.get_task(task_id).status == "cancelled"
    with pytest.raises(StateError):
        queue.send_event(task_id, "approved")


@pytest.mark.timeout(120)
def test_send_event_command(queue, database, log):
    task_id = queue.add_task(H + "WaitForApproval", {"log": log})
    drain(queue)
    shown = ok(taskrunner("show", str(task_id), url=database.url))
    assert "waiting_for:" in shown and "approved" in shown
    out = json.loads(ok(taskrunner("send-event", str(task_id), "approved", "--data",
                                   '{"ok": true}', "--json", url=database.url)))
    assert out == {"task_id": task_id, "event": "approved", "woken": True}
    usage_error(taskrunner("send-event", str(task_id), "approved", "--data", "{nope",
                           url=database.url), "JSON")
    usage_error(taskrunner("send-event", "99999", "approved", url=database.url), "99999")
    drain(queue)
    assert queue.get_task(task_id).results == {"approved": {"ok": True}}
    usage_error(taskrunner("send-event", str(task_id), "approved", url=database.url),
                "has ended")


@pytest.mark.timeout(120)
def test_the_dashboard_task_page_shows_checkpoint_steps_and_waiting(queue, log):
    table = app_table(queue)
    stepped = queue.add_task(H + "StepsThenFail", {"log": log, "table": table})
    waiting = queue.add_task(H + "WaitForApproval", {"log": log, "timeout": 3600})
    checkpointed = queue.add_task(H + "CheckpointThenFail", {"log": log})
    drain(queue)
    served = Served(queue.store)
    try:
        status, body, _ = fetch(served.url + "/tasks/%d" % stepped)
        assert status == 200 and "<h2>Steps</h2>" in body and "charge" in body
        status, body, _ = fetch(served.url + "/tasks/%d" % waiting)
        assert "Waiting for" in body and "approved" in body and "status-waiting" in body
        status, body, _ = fetch(served.url + "/tasks/%d" % checkpointed)
        assert "Checkpoint" in body and "&quot;done&quot;: 3" in body
    finally:
        served.stop()


@pytest.mark.timeout(60)
def test_bad_arguments_of_the_durable_verbs_are_refused(sqlite_db, tmp_path):
    queue = sqlite_db.queue()
    task_id = queue.add_task("taskrunner.handlers.Echo")
    run = durable.DurableRun(queue.store, 1, task_id, 1, None)
    for call, fragment in (
            (lambda: run.sleep(), "one of them"), (lambda: run.sleep(5, until=T0), "one of"),
            (lambda: run.sleep(until=datetime(2030, 1, 1)), "aware"),
            (lambda: run.sleep(-1), "seconds"), (lambda: run.step("", len, (), {}), "empty"),
            (lambda: run.wait_for("x" * 201), "longer"),
            (lambda: run.wait_for("x", timeout="soon"), "seconds")):
        with pytest.raises(InputError, match=fragment):
            call()
    from taskrunner import TaskError
    with pytest.raises(TaskError, match="not JSON"):
        run.step("s", lambda: object(), (), {})
    assert run.idempotency_key("é" * 3) == run.idempotency_key("é" * 3) != \
        run.idempotency_key("e")
    queue.close()


def test_a_step_result_or_checkpoint_over_max_result_size_fails_the_run_and_is_not_stored(
        database):
    queue = database.queue(task={"retry_backoff": 0, "max_result_size": 1000})
    task_id = queue.add_task(H + "BigStep", {"size": 2000}, max_retries=1)
    drain(queue)
    task = queue.get_task(task_id)
    assert task.given_up and task.last_error_code == "TooLarge", task
    assert "max_result_size (1000)" in queue.runs_of(task_id)[-1].error_message
    assert [step.name for step in queue.steps_of(task_id)] == ["small"]
    run = durable.DurableRun(queue.store, 1, task_id, 1, None)
    from taskrunner import TaskError
    with pytest.raises(TaskError, match="checkpoint is 1002 bytes"):
        run.checkpoint("x" * 1000)
    queue.close()


def test_ids_too_large_for_any_database_are_refused_as_input(sqlite_db):
    """2**70 names no task: a clear error, not the driver's OverflowError."""
    queue = sqlite_db.queue()
    huge = 2 ** 70
    with pytest.raises(InputError, match="neither a task id"):
        queue.add_task("taskrunner.handlers.Echo", after=[huge])
    with pytest.raises(TaskNotFound):
        queue.send_event(huge, "approved")
    with pytest.raises(InputError):
        queue.send_event("1", "approved")
    for read_or_act in (queue.get_task, queue.cancel, queue.retry, queue.runs_of):
        with pytest.raises(TaskNotFound):
            read_or_act(huge)
    queue.close()
