"""The queue's rules, attacked directly on each database: one live run per task (rule 1),
claim order and exclusivity (rule 2), run creation and backoff (rule 3), conditional ends
(rule 4), retry, cancel, unique keys and rotation. Time is injected, never slept."""
import json
import logging
import sys
import threading
from datetime import timedelta

import peewee as pw
import psutil
import pytest

from taskrunner.runs import enqueue, lifecycle, rotation
from taskrunner import HandlerError, InputError, StateError, TaskNotFound
from taskrunner.fleet import liveness
from taskrunner.store.models import (CANCELLED, ERROR, RUNNING, SCHEDULED, SUCCESS, TIMEOUT, Run,
                                     Runner, Task, utcnow)
from taskrunner.runs.lifecycle import retry_delay
from taskrunner.fleet.liveness import ResidentSize
from taskrunner.runner import loop

from conftest import Database, direct_only, runs_of, utc

RECORD = "sample_handlers.Record"
ECHO = "taskrunner.handlers.Echo"


@pytest.fixture
def runner_id(queue):
    return liveness.register(queue.store).id


def test_due_task_gets_its_run_in_the_same_transaction(queue):
    task_id = queue.add_task(ECHO, data={"x": 1})
    runs = runs_of(task_id)
    assert [(r.status, r.attempt, r.active_task_id) for r in runs] == [(SCHEDULED, 1, task_id)]


def test_delayed_task_gets_its_run_only_when_due(queue):
    now = utcnow()
    task_id = enqueue.add_task(queue.store, ECHO, scheduled_on=utc(now + timedelta(minutes=5)), now=now)
    assert runs_of(task_id) == []
    assert lifecycle.create_missing_runs(queue.store, now + timedelta(minutes=4)) == 0
    assert runs_of(task_id) == []
    assert lifecycle.create_missing_runs(queue.store, now + timedelta(minutes=5, seconds=1)) == 1
    assert [r.status for r in runs_of(task_id)] == [SCHEDULED]
    assert lifecycle.create_missing_runs(queue.store, now + timedelta(minutes=6)) == 0


def test_rule1_database_refuses_a_second_live_run(queue):
    task_id = queue.add_task(ECHO)
    now = utcnow()
    with pytest.raises(pw.IntegrityError):
        with queue.store.db.atomic():
            Run.create(task_id=task_id, created_on=now, updated_on=now, scheduled_on=now,
                       status=SCHEDULED, active_task_id=task_id)
    assert len(runs_of(task_id)) == 1


def test_rule1_create_missing_runs_never_doubles_a_live_run(queue):
    now = utcnow()
    task_id = queue.add_task(ECHO)
    # Corrupt next_run_on as if a second creator raced: the unique index still holds.
    Task.update(next_run_on=now - timedelta(seconds=1)).where(Task.id == task_id).execute()
    lifecycle.create_missing_runs(queue.store, now)
    assert len(runs_of(task_id)) == 1


def test_a_refused_run_leaves_its_task_as_it_was(queue, runner_id):
    now = utcnow()
    task_id = queue.add_task(ECHO)
    lifecycle.claim(queue.store, runner_id)
    # A creator that raced the running run (its next_run_on still due): its run is refused
    # by the unique index, and the task must not be told of a run that does not exist.
    Task.update(next_run_on=now - timedelta(seconds=1)).where(Task.id == task_id).execute()
    lifecycle.create_missing_runs(queue.store, now)
    task = Task.get_by_id(task_id)
    assert (queue.get_task(task_id).status, task.run_count, len(runs_of(task_id))) == (
        RUNNING, 1, 1)


def test_claim_order_is_priority_then_fifo(queue, runner_id):
    now = utcnow()
    low_old = enqueue.add_task(queue.store, ECHO, scheduled_on=utc(now - timedelta(seconds=30)), now=now)
    high_new = enqueue.add_task(queue.store, ECHO, priority=5, now=now)
    low_new = enqueue.add_task(queue.store, ECHO, now=now)
    high_old = enqueue.add_task(queue.store, ECHO, priority=5, scheduled_on=utc(now - timedelta(seconds=10)), now=now)
    order = [lifecycle.claim(queue.store, runner_id).task_id for _ in range(4)]
    assert order == [high_old, high_new, low_old, low_new]
    assert lifecycle.claim(queue.store, runner_id) is None


def _blocked_in_a_sleep(thread):
    """Whether `thread` is asleep in a relative sleep: SQLite's busy handler (usleep)."""
    try:
        with open("/proc/self/task/%d/syscall" % thread.native_id) as fh:
            return fh.read().split()[0] in ("35", "230")   # x86-64 nanosleep, clock_nanosleep
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("how", ["claim", "end and claim", "batched claim"])
def test_a_run_starts_on_the_record_when_it_is_claimed_not_before_the_wait_for_the_lock(
        sqlite_db, how):
    """A claim that waited for the database's write lock (another process's transaction, a
    busy host) records as the run's start the time it took the lock, not the time it began
    to wait: run_timeout and max_runtime count from it. Before, a runner stamped the claim
    before its write (a success's end and the next claim: the handler's return), and a run
    claimed after a stall was timed out that much early (taskrunner verify: 0.14 s after its
    handler started, the task's next run then executing beside it)."""
    import sqlite3
    import time
    from taskrunner.runner import batches
    from taskrunner.store.models import utcnow
    queue = sqlite_db.queue()
    try:
        store, runner_id = queue.store, liveness.register(queue.store).id
        if how == "end and claim":         # the run its runner ends as it claims the next
            queue.add_task(ECHO)
            first = lifecycle.claim(store, runner_id)
        task_id = queue.add_task(ECHO)
        handler_returned = utcnow()
        results = {}

        def claim():
            if how == "claim":
                results["claimed"] = lifecycle.claim(store, runner_id)
            elif how == "end and claim":
                results["ended"], results["claimed"] = lifecycle.end_run_and_claim(
                    store, first.run_id, first.task_id, SUCCESS, runner_id, now=handler_returned)
            else:
                batch = batches.Batch(store, runner_id, 4, 1.0)
                results["claimed"] = batch.next(["default"], None, 4)

        holder = sqlite3.connect(sqlite_db.url[len("sqlite:///"):], isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        thread = threading.Thread(target=claim)
        thread.start()
        try:
            from conftest import wait_for
            wait_for(lambda: _blocked_in_a_sleep(thread), timeout=30,
                     message="the claim waiting for SQLite's write lock")
            time.sleep(1.0)                    # the lock held a second while it waits
        finally:
            released = utcnow()
            holder.rollback()
            holder.close()
        thread.join(60)
        claimed = results["claimed"]
        assert claimed is not None and claimed.task_id == task_id
        run = Run.get_by_id(claimed.run_id)
        assert run.started_on >= released - timedelta(seconds=0.05), (run.started_on, released)
        assert claimed.started_on == run.started_on
        if how == "end and claim":         # the end keeps its handler's return
            assert results["ended"]
            assert Run.get_by_id(first.run_id).finished_on == handler_returned
    finally:
        queue.close()


def test_a_claim_writes_the_run_alone_and_every_reader_sees_the_task_running(queue, runner_id):
    """Issue 41's data model: the claim writes the run row, not the task's (one row version
    fewer per job); `running` is read from the run."""
    task_id = queue.add_task(ECHO, data={"a": 1})
    before = Task.select().where(Task.id == task_id).dicts().get()
    claimed = lifecycle.claim(queue.store, runner_id)
    assert (claimed.task_id, claimed.handler, claimed.data) == (task_id, ECHO, '{"a":1}')
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.runner_id) == (RUNNING, runner_id)
    assert run.started_on is not None
    assert Task.select().where(Task.id == task_id).dicts().get() == before
    assert before["last_status"] == SCHEDULED
    assert queue.get_task(task_id).status == queue.status_of(task_id) == RUNNING
    with pytest.raises(StateError, match="task %d is running; only a failed" % task_id):
        queue.retry(task_id)
    assert [t.id for t in queue.tasks(status=RUNNING)] == [task_id]
    assert queue.tasks(status=SCHEDULED) == []
    # The batched claim (many runs) and a runner's success with its next claim: the same.
    more = [queue.add_task(ECHO) for _ in range(3)]
    rows = {i: Task.select().where(Task.id == i).dicts().get() for i in more}
    claimed_many = queue.store.write(lambda: lifecycle.claim_many(
        queue.store, runner_id, ["default"], utcnow(), 2, share=False))
    ended, following = lifecycle.end_run_and_claim(
        queue.store, claimed.run_id, task_id, SUCCESS, runner_id, results="null")
    assert ended and following is not None
    assert sorted([c.task_id for c in claimed_many] + [following.task_id]) == more
    assert {i: Task.select().where(Task.id == i).dicts().get() for i in more} == rows
    assert {queue.status_of(i) for i in more} == {RUNNING}


def test_concurrent_claims_take_each_run_once(database):
    queue = database.queue()
    queue.add_tasks([{"handler": ECHO} for _ in range(200)])
    runner_ids = [liveness.register(queue.store).id for _ in range(4)]
    claimed, errors = [], []

    def claim_all(rid):
        try:
            while (c := lifecycle.claim(queue.store, rid)) is not None:
                claimed.append(c.run_id)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            queue.store.db.close()

    threads = [threading.Thread(target=claim_all, args=(rid,)) for rid in runner_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(claimed) == 200 and len(set(claimed)) == 200
    queue.close()


def test_success_aggregates_the_task(queue, runner_id):
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert lifecycle.end_run(queue.store, claimed.run_id, task_id, SUCCESS, runner_id=runner_id, results='{"r":1}')
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed, task.next_run_on) == (SUCCESS, 0, None)
    assert task.finished_on is not None and task.active_key is None
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.percent_completed, run.results, run.active_task_id) == \
        (SUCCESS, 100, '{"r":1}', None)


@pytest.mark.parametrize("status", [SUCCESS, ERROR])
def test_end_run_and_claim_ends_one_run_and_starts_the_next(queue, runner_id, status):
    first, second = queue.add_tasks([{"handler": ECHO, "priority": 1}, {"handler": ECHO}])
    claimed = lifecycle.claim(queue.store, runner_id)
    assert claimed.task_id == first
    ended, following = lifecycle.end_run_and_claim(queue.store, claimed.run_id, first, status, runner_id,
                                               results='{"r":1}' if status == SUCCESS else None,
                                               error_code=None if status == SUCCESS else "Boom")
    assert ended and following.task_id == second and following.attempt == 1
    assert (following.handler, following.data) == (ECHO, "null")
    assert Run.get_by_id(claimed.run_id).status == status
    assert Task.get_by_id(first).last_status == status
    run = Run.get_by_id(following.run_id)
    assert (run.status, run.runner_id, queue.get_task(second).status) == \
        (RUNNING, runner_id, RUNNING)
    # Nothing left to claim: the end still happens.
    assert lifecycle.end_run_and_claim(queue.store, following.run_id, second, SUCCESS, runner_id) == (True, None)
    assert Task.get_by_id(second).last_status == SUCCESS


def test_end_run_and_claim_after_losing_the_race_still_claims(queue, runner_id):
    first, second = queue.add_tasks([{"handler": ECHO, "priority": 1}, {"handler": ECHO}])
    claimed = lifecycle.claim(queue.store, runner_id)
    assert lifecycle.end_run(queue.store, claimed.run_id, first, TIMEOUT, error_code="RunTimeout")
    ended, following = lifecycle.end_run_and_claim(queue.store, claimed.run_id, first, SUCCESS, runner_id)
    assert not ended and following.task_id == second
    assert Run.get_by_id(claimed.run_id).status == TIMEOUT         # rule 4 held


def test_release_run_gives_an_unstarted_claim_back(queue, runner_id):
    other = liveness.register(queue.store).id
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert not lifecycle.release_runs_of(queue.store, other, only=claimed.run_id)             # not its run
    assert lifecycle.release_runs_of(queue.store, runner_id, only=claimed.run_id)
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.runner_id, run.started_on) == (SCHEDULED, None, None)
    assert Task.get_by_id(task_id).last_status == SCHEDULED
    assert not lifecycle.release_runs_of(queue.store, runner_id, only=claimed.run_id)         # already given back
    again = lifecycle.claim(queue.store, other)
    assert (again.run_id, again.attempt) == (claimed.run_id, 1)


def test_a_stopping_runner_gives_back_a_run_claimed_with_its_last_outcome(queue):
    worker = loop.Runner(queue.store, install_signals=False)
    worker.runner_id = liveness.register(queue.store).id
    queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, worker.runner_id)
    assert worker._unless_stopping(claimed) is claimed
    worker.stop_reason = "received SIGTERM"          # arrived while the claim was made
    assert worker._unless_stopping(claimed) is None
    assert Run.get_by_id(claimed.run_id).status == SCHEDULED


def test_resident_size_reads_what_psutil_reads():
    reader = ResidentSize()
    try:
        ballast = b"x" * (256 * 1024 * 1024)        # written, so resident
        ours, theirs = reader(), psutil.Process().memory_info().rss
        assert abs(ours - theirs) < 4 * 1024 * 1024 and ours > len(ballast), (ours, theirs)
    finally:
        reader.close()


def test_a_busy_runner_commits_once_per_run(sqlite_db):
    """Ending a run and claiming the next share one transaction: counted on the real SQLite
    connection, N runs cost N commits plus a constant, not 2 N."""
    queue = sqlite_db.queue()
    queue.add_tasks([{"handler": ECHO} for _ in range(100)])
    statements = []
    queue.store.db.connection().set_trace_callback(statements.append)
    assert loop.Runner(queue.store, install_signals=False, memory_limit=False).work(burst=True) == 100
    commits = sum(1 for sql in statements if sql.strip().upper() == "COMMIT")
    assert 100 <= commits <= 105, commits
    queue.close()


def test_rule4_late_finisher_cannot_overwrite_timeout(queue, runner_id):
    task_id = queue.add_task(ECHO, max_retries=3)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert lifecycle.end_run(queue.store, claimed.run_id, task_id, TIMEOUT, error_code="RunTimeout",
                         error_message="no update")
    # The runner comes back late and reports success: refused, nothing changes.
    assert not lifecycle.end_run(queue.store, claimed.run_id, task_id, SUCCESS, runner_id=runner_id)
    assert not lifecycle.report_progress(queue.store, claimed.run_id, runner_id, 50)
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.error_code) == (TIMEOUT, "RunTimeout")
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed) == (TIMEOUT, 1)


def test_rule4_another_runner_cannot_end_a_run(queue, runner_id):
    other = liveness.register(queue.store).id
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert not lifecycle.end_run(queue.store, claimed.run_id, task_id, ERROR, runner_id=other)
    assert Run.get_by_id(claimed.run_id).status == RUNNING


def test_failures_back_off_then_give_up_after_max_retries(queue, runner_id):
    queue.config.task.retry_backoff = 10
    task_id = queue.add_task(ECHO, max_retries=3)
    now = utcnow()
    for attempt in (1, 2, 3):
        claimed = lifecycle.claim(queue.store, runner_id, now=now)
        assert claimed is not None and claimed.attempt == attempt
        lifecycle.end_run(queue.store, claimed.run_id, task_id, ERROR, runner_id=runner_id, error_code="E",
                      error_message="failed %d" % attempt, now=now)
        task = Task.get_by_id(task_id)
        assert task.runs_failed == attempt
        if attempt == 3:
            break
        delay = (task.next_run_on - now).total_seconds()
        full = 10 * 2 ** (attempt - 1)
        assert full / 2 <= delay <= full
        # Rule 3: not before finished_on + backoff.
        assert lifecycle.create_missing_runs(queue.store, now + timedelta(seconds=full / 2 - 0.5)) == 0
        now = now + timedelta(seconds=full + 1)
        assert lifecycle.create_missing_runs(queue.store, now) == 1
    task = Task.get_by_id(task_id)
    assert task.given_up and task.next_run_on is None and task.finished_on is not None
    assert (task.last_error_code, task.last_error_message) == ("E", "failed 3")
    assert lifecycle.create_missing_runs(queue.store, now + timedelta(days=1)) == 0
    assert [t.id for t in queue.tasks(status="given-up")] == [task_id]


def test_success_resets_runs_failed(queue, runner_id):
    queue.config.task.retry_backoff = 0
    task_id = queue.add_task(ECHO, max_retries=5)
    claimed = lifecycle.claim(queue.store, runner_id)
    lifecycle.end_run(queue.store, claimed.run_id, task_id, ERROR, runner_id=runner_id, error_code="E")
    lifecycle.create_missing_runs(queue.store, utcnow() + timedelta(seconds=1))
    claimed = lifecycle.claim(queue.store, runner_id)
    assert claimed.attempt == 2
    lifecycle.end_run(queue.store, claimed.run_id, task_id, SUCCESS, runner_id=runner_id)
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed, task.last_error_code) == (SUCCESS, 0, "E")


def test_retry_delay_is_exponential_capped_and_jittered():
    assert retry_delay(1, 10, 3600, rand=lambda: 0) == 5
    assert retry_delay(1, 10, 3600, rand=lambda: 1) == 10
    assert retry_delay(4, 10, 3600, rand=lambda: 1) == 80
    assert retry_delay(30, 10, 3600, rand=lambda: 1) == 3600
    # "Retry for ever" (a huge max_retries) must not overflow after ~1,000 failures.
    assert retry_delay(5000, 10, 3600, rand=lambda: 1) == 3600


def test_retry_rearms_a_given_up_task(queue, runner_id):
    task_id = queue.add_task(ECHO, max_retries=1)
    claimed = lifecycle.claim(queue.store, runner_id)
    lifecycle.end_run(queue.store, claimed.run_id, task_id, ERROR, runner_id=runner_id, error_code="E")
    assert Task.get_by_id(task_id).given_up
    queue.retry(task_id)
    task = Task.get_by_id(task_id)
    assert (task.runs_failed, task.finished_on, task.given_up) == (0, None, False)
    assert [r.status for r in runs_of(task_id)] == [ERROR, SCHEDULED]
    with pytest.raises(StateError):
        queue.retry(task_id)  # it has a live run now


def test_retry_refuses_a_successful_task_and_unknown_ids(queue, runner_id):
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    lifecycle.end_run(queue.store, claimed.run_id, task_id, SUCCESS, runner_id=runner_id)
    with pytest.raises(StateError):
        queue.retry(task_id)
    with pytest.raises(TaskNotFound):
        queue.retry(999999)


def test_cancel_scheduled_task(queue):
    task_id = queue.add_task(ECHO)
    queue.cancel(task_id)
    task = Task.get_by_id(task_id)
    assert task.last_status == CANCELLED and task.finished_on is not None
    assert [r.status for r in runs_of(task_id)] == [CANCELLED]
    with pytest.raises(StateError):
        queue.cancel(task_id)


def test_cancel_delayed_task_stops_it_for_good(queue):
    now = utcnow()
    task_id = queue.add_task(ECHO, scheduled_on=utc(now + timedelta(seconds=5)))
    queue.cancel(task_id)
    assert lifecycle.create_missing_runs(queue.store, now + timedelta(minutes=1)) == 0
    assert runs_of(task_id) == []


def test_cancel_of_a_running_task_asks_its_run_to_stop(queue, runner_id):
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert queue.cancel(task_id) == claimed.run_id
    # Not final yet: the runner stops the run and ends it cancelled (test_visibility).
    assert queue.get_task(task_id).status == RUNNING
    run = Run.get_by_id(claimed.run_id)
    assert run.status == RUNNING and run.cancel_requested_on is not None
    assert lifecycle.taken_away_on(queue.store, claimed.run_id, runner_id) == (None, True)
    assert queue.runs_of(task_id)[0].cancel_requested_on is not None


def test_unique_key_returns_the_live_task(queue, runner_id):
    first = queue.add_task(ECHO, unique_key="report-42")
    assert queue.add_task(ECHO, unique_key="report-42") == first
    assert Task.select().count() == 1
    claimed = lifecycle.claim(queue.store, runner_id)
    lifecycle.end_run(queue.store, claimed.run_id, first, SUCCESS, runner_id=runner_id)
    second = queue.add_task(ECHO, unique_key="report-42")
    assert second != first


def test_unique_key_race_yields_one_task(database):
    queue = database.queue()
    ids, errors = [], []
    barrier = threading.Barrier(8)

    def add():
        try:
            barrier.wait()
            ids.append(queue.add_task(ECHO, unique_key="only-one"))
        except Exception as exc:
            errors.append(exc)
        finally:
            queue.store.db.close()

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(set(ids)) == 1 and len(ids) == 8
    assert Task.select().where(Task.unique_key == "only-one").count() == 1
    queue.close()


@pytest.mark.parametrize("handler,match", [
    ("nosuchmodule.Handler", "cannot be imported"),
    ("taskrunner.handlers.Missing", "not found"),
    ("sample_handlers.NotAHandler", "not a TaskHandler"),
    ("not a path", "invalid handler"),
])
def test_add_refuses_bad_handlers_and_stores_nothing(queue, handler, match):
    with pytest.raises(HandlerError, match=match):
        queue.add_task(handler)
    assert Task.select().count() == 0 and Run.select().count() == 0


def test_allow_list_is_checked_before_import(database, monkeypatch):
    queue = database.queue(handlers={"allow": ["taskrunner.handlers.*"]})
    queue.add_task(ECHO)
    # Put back afterwards: later tests of this process share state with the module object
    # their handlers run in (sample_handlers.GATES).
    monkeypatch.delitem(sys.modules, "sample_handlers", raising=False)
    with pytest.raises(HandlerError, match="not allowed"):
        queue.add_task(RECORD)
    assert "sample_handlers" not in sys.modules
    assert Task.select().count() == 1


@pytest.mark.parametrize("data", [{"x": object()}, {"x": float("nan")}, "x" * 2000])
def test_add_refuses_bad_data_and_stores_nothing(database, data):
    queue = database.queue(task={"max_data_size": 1024})
    with pytest.raises(HandlerError):
        queue.add_task(ECHO, data=data)
    assert Task.select().count() == 0


def test_bulk_add_is_all_or_nothing(queue):
    with pytest.raises(InputError):
        queue.add_tasks([{"handler": ECHO}, {"handler": "nosuch.Handler"}])
    assert Task.select().count() == 0
    ids = queue.add_tasks([{"handler": ECHO, "data": i} for i in range(1000)])
    assert len(ids) == len(set(ids)) == 1000
    assert Run.select().where(Run.status == SCHEDULED).count() == 1000


def _stored(task_id):
    task = Task.get_by_id(task_id).__data__
    runs = [r.__data__ for r in Run.select().where(Run.task_id == task_id)]
    for row in [task] + runs:
        for key in ("id", "task_id", "active_task_id", "active_key", "unique_key"):
            row.pop(key, None)
    return task, runs


def test_bulk_add_stores_what_single_adds_store_in_order(queue):
    """add_tasks() writes multi-row INSERTs (several chunks here): the rows must be those
    add_task() writes, and the ids must come back in the order of the specs."""
    now = utcnow()
    specs = [{"handler": ECHO, "data": {"i": i, "text": "naïve 'quoted' \"x\" ✓"},
              "priority": i % 7 - 3, "queued_by": "bulk-test"} for i in range(1100)]
    specs[5].update(scheduled_on=utc(now + timedelta(minutes=5)), max_retries=2, run_timeout=12.5,
                    max_runtime=30, retry_backoff=4)
    specs[600].update(data=None, unique_key="only-once")
    ids = enqueue.add_tasks(queue.store, specs, now=now)
    assert len(set(ids)) == len(specs)
    assert [json.loads(Task.get_by_id(i).data) for i in ids] == [spec["data"] for spec in specs]
    assert [Task.get_by_id(i).priority for i in ids] == [spec["priority"] for spec in specs]
    assert Task.get_by_id(ids[600]).active_key == "only-once"
    assert Run.select().count() == len(specs) - 1           # the delayed one has no run yet
    for index in (0, 5, 499, 500, 600, 1099):
        spec = dict(specs[index], unique_key=None)
        single = enqueue.add_task(queue.store, now=now, **spec)
        assert _stored(single) == _stored(ids[index]), index


def test_run_timeout_without_update_marks_run_timeout(queue, runner_id):
    task_id = queue.add_task(ECHO, run_timeout=60, max_retries=2)
    claimed = lifecycle.claim(queue.store, runner_id)
    now = utcnow()
    assert lifecycle.timeout_overdue_runs(queue.store, now + timedelta(seconds=59)) == []
    assert lifecycle.report_progress(queue.store, claimed.run_id, runner_id, 40, now=now + timedelta(seconds=50))
    assert lifecycle.timeout_overdue_runs(queue.store, now + timedelta(seconds=100)) == []
    ended = lifecycle.timeout_overdue_runs(queue.store, now + timedelta(seconds=111))
    assert ended == [(claimed.run_id, runner_id)]
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.error_code, run.percent_completed) == (TIMEOUT, "RunTimeout", 40)
    assert Task.get_by_id(task_id).runs_failed == 1


def test_max_runtime_marks_run_timeout(queue, runner_id):
    queue.add_task(ECHO, max_runtime=30)
    claimed = lifecycle.claim(queue.store, runner_id)
    now = utcnow()
    lifecycle.report_progress(queue.store, claimed.run_id, runner_id, 90, now=now + timedelta(seconds=29))
    assert lifecycle.timeout_overdue_runs(queue.store, now + timedelta(seconds=31)) == [(claimed.run_id, runner_id)]
    assert Run.get_by_id(claimed.run_id).error_code == "MaxRuntime"


def test_dead_runner_rows_become_timeout_with_their_runs(queue, runner_id):
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    # A row of this host whose PID is alive but whose create_time differs: PID reuse.
    Runner.update(pid_create_time=Runner.pid_create_time - 1000).where(
        Runner.id == runner_id).execute()
    result = queue.process_queue()
    assert result["dead_runners"] == [runner_id]
    assert Runner.get_by_id(runner_id).status == TIMEOUT
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.error_code) == (TIMEOUT, "RunnerDied")
    assert Task.get_by_id(task_id).runs_failed == 1


def test_a_claim_committed_after_its_runner_was_marked_dead_is_ended_at_the_next_check(
        queue, runner_id):
    """The runner was killed with its claim in flight: the overseer marked it dead, then the
    server committed the claim it had received (its snapshot still saw the row ``running``,
    so the claim's own check let it through). Seen in the kill -9 chaos test on PostgreSQL
    under load: the run stayed running under the ended runner until its run_timeout."""
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)  # the claim, as its snapshot saw it...
    Runner.update(status=TIMEOUT, exit_reason="exited with signal SIGKILL").where(
        Runner.id == runner_id).execute()              # ...and a mark that did not see the run
    assert Run.get_by_id(claimed.run_id).status == RUNNING
    queue.process_queue()
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.error_code) == (TIMEOUT, "RunnerDied")
    task = Task.get_by_id(task_id)
    assert (task.runs_failed, task.finished_on) == (1, None)     # to be retried, not given up


def test_a_runner_whose_row_is_no_longer_running_claims_nothing_but_ends_its_run(
        queue, runner_id):
    """Declared dead while it was cut off from the database (its row ``timeout``), a runner
    that comes back finishes the run it holds as rule 4 allows, and claims nothing: neither
    alone nor with that success (PostgreSQL's one statement). Seen: a host cut off for 40 s
    claimed 6 runs after the heal, which another host timed out and ran again."""
    first, second = queue.add_task(ECHO), queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    Runner.update(status=TIMEOUT).where(Runner.id == runner_id).execute()
    ended, following = lifecycle.end_run_and_claim(queue.store, claimed.run_id, claimed.task_id,
                                                   SUCCESS, runner_id)
    assert (ended, following) == (True, None)
    assert lifecycle.claim(queue.store, runner_id) is None
    assert [r.status for r in runs_of(first)] == [SUCCESS]
    assert [(r.status, r.runner_id) for r in runs_of(second)] == [(SCHEDULED, None)]


def test_other_hosts_are_dead_by_heartbeat_age_on_the_database_clock(queue):
    """Heartbeats are aged by the database server's clock, whatever the checker's clock
    says: a checker ten minutes ahead (or behind) declares nobody dead for it."""
    now = utcnow()
    fresh = Runner.create(host="elsewhere", boot_id="b", pid=1, pid_create_time=0,
                          started_on=now, heartbeat_on=now - timedelta(seconds=30), slot=1)
    old = Runner.create(host="elsewhere", boot_id="b", pid=2, pid_create_time=0,
                        started_on=now, heartbeat_on=now - timedelta(seconds=90), slot=2)
    for skew in (timedelta(minutes=10), -timedelta(minutes=10), timedelta(0)):
        assert liveness.refresh_runners(queue.store, now=now + skew) in ([], [old.id])
        assert Runner.get_by_id(fresh.id).status == RUNNING
    assert Runner.get_by_id(old.id).status == TIMEOUT
    assert "no heartbeat from elsewhere" in Runner.get_by_id(old.id).exit_reason


def test_heartbeats_are_written_with_the_database_clock(queue):
    """A heartbeat written by a process whose clock is ten minutes behind still carries the
    server's time, so another host does not see it as ten minutes old."""
    runner_id = liveness.register(queue.store).id
    Runner.update(heartbeat_on=utcnow() - timedelta(minutes=10)).where(
        Runner.id == runner_id).execute()
    assert liveness.heartbeat(queue.store, runner_id)
    written = Runner.get_by_id(runner_id).heartbeat_on
    assert abs((written - utcnow()).total_seconds()) < 5
    Runner.update(host="elsewhere").where(Runner.id == runner_id).execute()
    assert liveness.refresh_runners(queue.store, now=utcnow() + timedelta(minutes=10)) == []


def test_a_heartbeat_renders_no_query(queue):
    """A runner's heartbeat is one UPDATE written once per shape: rendered by peewee on every
    beat it ran about 70 Python calls of the query builder per column set, as much work as
    a job (counted under callgrind: 0.9M instructions a beat, with every runner beating)."""
    runner_id = liveness.register(queue.store).id
    assert liveness.heartbeat(queue.store, runner_id, rss=1, runs_done=2)   # its statement
    calls = []

    def count(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)
    sys.setprofile(count)
    try:
        written = liveness.heartbeat(queue.store, runner_id, rss=3, runs_done=4)
    finally:
        sys.setprofile(None)
    assert written
    assert "__sql__" not in calls and len(calls) < 100, (len(calls), calls.count("__sql__"))
    row = Runner.get_by_id(runner_id)
    assert (row.rss, row.runs_done) == (3, 4)
    # Winding down, then going on: the same columns as ever.
    assert liveness.heartbeat(queue.store, runner_id, stopping="told to stop", stopping_run_id=7)
    row = Runner.get_by_id(runner_id)
    assert (row.exit_reason, row.stopping_run_id) == ("stopping: told to stop", 7)
    since = row.stopping_since
    assert since is not None
    assert liveness.heartbeat(queue.store, runner_id, stopping="again", stopping_run_id=7)
    assert Runner.get_by_id(runner_id).stopping_since == since
    assert liveness.heartbeat(queue.store, runner_id, stopping="")
    row = Runner.get_by_id(runner_id)
    assert (row.exit_reason, row.stopping_since, row.stopping_run_id) == (None, None, None)
    Runner.update(status=TIMEOUT).where(Runner.id == runner_id).execute()
    assert not liveness.heartbeat(queue.store, runner_id)


def test_heartbeats_missed_during_an_outage_count_against_nobody(queue):
    """Once the database is back (here: the checker got it back at `reachable_since`), a
    heartbeat is judged only after it has been reachable for heartbeat_timeout (60 s):
    nobody could write one while it was down."""
    now = utcnow()
    row = Runner.create(host="elsewhere", boot_id="b", pid=1, pid_create_time=0, started_on=now,
                        heartbeat_on=now - timedelta(seconds=300), slot=1)
    back = now - timedelta(seconds=59)
    assert liveness.refresh_runners(queue.store, now=now, reachable_since=back) == []
    back = now - timedelta(seconds=61)
    assert liveness.refresh_runners(queue.store, now=now, reachable_since=back) == [row.id]


def test_progress_missed_during_an_outage_does_not_time_a_run_out(queue, runner_id):
    queue.add_task(ECHO, run_timeout=30)
    claimed = lifecycle.claim(queue.store, runner_id)
    later = utcnow() + timedelta(seconds=300)
    back = later - timedelta(seconds=29)
    assert lifecycle.timeout_overdue_runs(queue.store, later, reachable_since=back) == []
    back = later - timedelta(seconds=31)
    assert lifecycle.timeout_overdue_runs(queue.store, later, reachable_since=back) == [
        (claimed.run_id, runner_id)]


def test_the_database_is_writable_since_its_server_started(queue):
    """A server restart is an outage everyone missed: the server's start (from its uptime,
    so that only this host's clock is read) bounds the heartbeats judged. SQLite has none."""
    now = utcnow()
    since = queue.store.writable_since()
    if queue.store.is_sqlite:
        assert since is None
    else:
        assert since <= now
    assert queue.store.writable_since(now) == now


def test_rotation_deletes_only_old_ended_tasks(queue, runner_id):
    now = utcnow()
    old_success = queue.add_task(ECHO)
    old_failed = queue.add_task(ECHO, max_retries=1)
    for task_id, status in ((old_success, SUCCESS), (old_failed, ERROR)):
        claimed = lifecycle.claim(queue.store, runner_id)
        assert claimed.task_id == task_id
        lifecycle.end_run(queue.store, claimed.run_id, task_id, status, runner_id=runner_id,
                      now=now - timedelta(days=8))
    live = queue.add_task(ECHO, scheduled_on=utc(now + timedelta(days=60)))
    recent = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    lifecycle.end_run(queue.store, claimed.run_id, claimed.task_id, SUCCESS, runner_id=runner_id)
    queue.config.rotation.batch_size = 1
    result = rotation.rotate(queue.store, now)
    assert result["success"] == 1 and result["failed"] == 0
    remaining = {t.id for t in Task.select()}
    assert remaining == {old_failed, live, recent}
    assert Run.select().where(Run.task_id == old_success).count() == 0
    result = rotation.rotate(queue.store, now + timedelta(days=23))
    assert (result["success"], result["failed"]) == (1, 1)
    assert {t.id for t in Task.select()} == {live}


@pytest.mark.parametrize("field,value", [("priority", 2 ** 31), ("priority", -2 ** 31),
                                         ("max_retries", 0), ("max_retries", 2 ** 31)])
def test_add_refuses_integers_the_columns_cannot_hold(queue, field, value):
    with pytest.raises(InputError, match=field):
        queue.add_task(ECHO, **{field: value})
    assert Task.select().count() == 0


@pytest.fixture(params=("postgresql", "mysql"))
def server_database(request, tmp_path):
    """A database behind a connection that the server can cut."""
    db = Database(request.param, tmp_path)
    yield db
    db.drop()


def _cut_connection(database, queue):
    """The server ends the queue's connection, as a restart or a network cut would."""
    if database.backend == "postgresql":
        pid = queue.store.db.execute_sql("SELECT pg_backend_pid()").fetchone()[0]
        sql = "SELECT pg_terminate_backend(%d)" % pid
    else:
        pid = queue.store.db.execute_sql("SELECT CONNECTION_ID()").fetchone()[0]
        sql = "KILL %d" % pid
    with database.admin.cursor() as cur:
        cur.execute(sql)


def test_runs_claimed_as_the_connection_was_lost_are_given_back(server_database):
    """A claim can commit and its reply be lost with the connection: the runner does not know
    the run is its own, and it would stay `running` until run_timeout (a day by default).
    After reconnecting, the runner gives back every run it has running but the one it is
    ending, before it claims again."""
    direct_only(server_database, "a server connection the server ends is replaced unseen; the client's is not cut")
    queue = server_database.queue()
    worker = loop.Runner(queue.store, install_signals=False)
    worker.runner_id = liveness.register(queue.store).id
    ending, lost, waiting = queue.add_tasks([{"handler": ECHO, "priority": p} for p in (3, 2, 1)])
    in_hand = lifecycle.claim(queue.store, worker.runner_id)
    orphan = lifecycle.claim(queue.store, worker.runner_id)          # committed; its reply "never came"
    assert (in_hand.task_id, orphan.task_id) == (ending, lost)
    _cut_connection(server_database, queue)
    ended, following = worker._with_database(
        lambda: lifecycle.end_run_and_claim(queue.store, in_hand.run_id, ending, SUCCESS, worker.runner_id),
        reconnected=lambda: worker._give_back_lost_claims(keep=in_hand.run_id))
    assert ended and following.run_id == orphan.run_id       # back in the queue, claimed anew
    assert Run.get_by_id(in_hand.run_id).status == SUCCESS
    running = [r.id for r in Run.select().where(Run.status == RUNNING)]
    assert running == [orphan.run_id]
    assert Task.get_by_id(waiting).last_status == SCHEDULED
    queue.close()


def test_an_end_that_committed_before_the_reply_was_lost_counts_as_ended(queue, runner_id):
    task_id = queue.add_task(ECHO)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert lifecycle.end_run(queue.store, claimed.run_id, task_id, SUCCESS, runner_id=runner_id)
    assert lifecycle.was_ended_by(queue.store, claimed.run_id, runner_id, SUCCESS)
    other = queue.add_task(ECHO)
    timed_out = lifecycle.claim(queue.store, runner_id)
    lifecycle.end_run(queue.store, timed_out.run_id, other, TIMEOUT, error_code="RunTimeout")
    assert not lifecycle.was_ended_by(queue.store, timed_out.run_id, runner_id, SUCCESS)


def test_a_runner_leaving_through_an_error_ends_the_run_it_still_had(queue, runner_id):
    """retire() with a run still `running` (the runner is leaving through an exception): the
    run ends `error` / RunnerExited and the task will be retried, instead of waiting for
    its run_timeout (no check visits the run of a retired runner)."""
    task_id = queue.add_task(ECHO, max_retries=3)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert liveness.retire(queue.store, runner_id, "crashed")
    run = Run.get_by_id(claimed.run_id)
    assert (run.status, run.error_code) == (ERROR, "RunnerExited")
    task = Task.get_by_id(task_id)
    assert (task.last_status, task.runs_failed) == (ERROR, 1) and task.next_run_on is not None
    assert Runner.get_by_id(runner_id).status == SUCCESS


def test_giving_back_runs_leaves_a_run_timed_out_meanwhile_alone(queue, runner_id):
    task_id = queue.add_task(ECHO, max_retries=3)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert lifecycle.end_run(queue.store, claimed.run_id, task_id, TIMEOUT, error_code="RunTimeout")
    assert lifecycle.release_runs_of(queue.store, runner_id) == 0
    assert Run.get_by_id(claimed.run_id).status == TIMEOUT       # rule 4 held
    assert Task.get_by_id(task_id).last_status == TIMEOUT


@pytest.mark.parametrize("name", ["run_timeout", "max_runtime", "retry_backoff"])
def test_spans_beyond_a_century_are_refused(queue, name):
    with pytest.raises(InputError):
        queue.add_task(ECHO, **{name: 1e300})
    assert Task.select().count() == 0


def test_data_and_results_up_to_max_data_size_are_stored_whole(queue, runner_id):
    """1 MiB is the default max_data_size; MySQL's TEXT would hold 64 KiB of it."""
    data = {"text": "é" * 300_000}                   # about 600 KB of JSON
    task_id = queue.add_task(ECHO, data=data)
    claimed = lifecycle.claim(queue.store, runner_id)
    assert json.loads(claimed.data) == data
    results = json.dumps({"echo": data})
    assert lifecycle.end_run(queue.store, claimed.run_id, task_id, SUCCESS, runner_id=runner_id, results=results)
    assert Run.get_by_id(claimed.run_id).results == results


# -- add_task on PostgreSQL: one round trip -----------------------------------------------------

class _Statements(logging.Handler):
    """The statements peewee sends from this thread (its DEBUG log of each query; the suite
    prepares the next databases in a thread of its own), while attached."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.sent = []
        self.thread = threading.get_ident()

    def emit(self, record):
        # Handlers run in the logging thread (record.thread is None once a CLI call in this
        # process set logging.logThreads off).
        if threading.get_ident() == self.thread:
            self.sent.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("peewee")
        self.level, self.sent = logger.level, []
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("peewee")
        logger.removeHandler(self)
        logger.setLevel(self.level)


def test_add_task_on_postgresql_is_one_statement_that_also_wakes_other_hosts(tmp_path, request):
    """What a web request queueing work waits for: the task, its first run and the NOTIFY
    to other hosts' hubs in one statement (one round trip; BEGIN, two INSERTs, the NOTIFY and
    COMMIT before), with the same rows and news as before."""
    import psycopg
    from taskrunner.host import wakeup
    from taskrunner.store.models import utcnow as task_now
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    direct_only(database, "no LISTEN through the pooler")
    queue = database.queue()
    queue.add_task(ECHO)                       # the queue's row, once per queue and process
    with psycopg.connect(database.url.replace("postgresql://", "postgres://"),
                         autocommit=True) as other_host:
        other_host.execute("LISTEN %s" % wakeup.CHANNEL)
        with _Statements() as statements:
            due = queue.add_task(ECHO, data={"n": 1}, priority=3)
            later = queue.add_task(ECHO, scheduled_on=utc(task_now()) + timedelta(hours=1))
        assert len(statements.sent) == 2, statements.sent
        [news] = [wakeup.parse_news(n.payload) for n in other_host.notifies(timeout=5,
                                                                            stop_after=1)]
        assert news[:2] == (1, "default")
        assert not list(other_host.notifies(timeout=0.2)), "a task not due woke other hosts"

    task = Task.get_by_id(due)
    [run] = runs_of(due)
    assert (run.status, run.attempt, run.active_task_id, run.priority, run.queue,
            run.scheduled_on, run.created_on) == (SCHEDULED, 1, due, 3, task.queue,
                                                  task.scheduled_on, task.queued_on)
    assert (task.last_status, task.run_count, task.data) == (SCHEDULED, 1, '{"n":1}')
    assert runs_of(later) == [] and Task.get_by_id(later).next_run_on is not None
    with pytest.raises(pw.IntegrityError):     # rule 1 still holds for the run it made
        Run.create(task_id=due, active_task_id=due, attempt=2, status=SCHEDULED,
                   queue=task.queue, priority=0, scheduled_on=task.scheduled_on,
                   created_on=task.queued_on, updated_on=task.queued_on, percent_completed=0)
    queue.close()
