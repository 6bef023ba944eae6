"""A runner never waits on a task row another transaction holds (issue 46): applications lock
their rows (an admin action, a ``select_for_update()`` of a related model, a long migration),
and a claim that then waited for the lock would stop the runner with work due. Every claim —
one run, a batch, a success with the next claim, a flow claim — skips a task whose row is
locked and takes the next; the locked task runs once the lock is released. PostgreSQL and
MariaDB (SQLite has no row locks: a writer holds the whole database).

The lock is held for real by a second connection. The claiming connection has a lock-wait
timeout of a few seconds, so a claim that waits fails with an error instead of hanging."""
from datetime import timedelta

import pytest

from taskrunner.fleet import liveness
from taskrunner.runs import flow, lifecycle
from taskrunner.store.models import RUNNING, SCHEDULED, SUCCESS, Run, Task, utcnow

from conftest import Database, taskrunner

ECHO = "taskrunner.handlers.Echo"
LOCKING = ("postgresql", "mysql")


@pytest.fixture(params=LOCKING)
def locking_db(request, tmp_path):
    db = Database(request.param, tmp_path)
    yield db
    db.drop()


class HeldLock:
    """A second connection holding ``SELECT id FROM task_queue WHERE id = ? FOR UPDATE``
    in an open transaction, as an application's transaction would."""

    def __init__(self, database, task_id):
        self.queue, self.task_id = database.queue(), task_id

    def __enter__(self):
        db = self.queue.store.db
        self.transaction = db.atomic()
        self.transaction.__enter__()
        db.execute_sql("SELECT id FROM task_queue WHERE id = %s FOR UPDATE", (self.task_id,))
        return self

    def __exit__(self, *exc_info):
        self.transaction.__exit__(*exc_info)
        self.queue.close()


def _impatient(queue, backend):
    """The claiming connection waits at most 3 s for a row lock, then errs."""
    queue.store.db.execute_sql("SET lock_timeout = '3s'" if backend == "postgresql"
                               else "SET SESSION innodb_lock_wait_timeout = 3")


def _claimer(database, **sections):
    queue = database.queue(**sections)
    _impatient(queue, database.backend)
    return queue, liveness.register(queue.store).id


@pytest.mark.timeout(90)
def test_runner_burst_runs_the_other_task_and_leaves_the_locked_one(locking_db, tmp_path):
    queue = locking_db.queue()
    first, second = queue.add_task(ECHO), queue.add_task(ECHO)
    config = locking_db.write_config(tmp_path / "taskrunner.toml")
    with HeldLock(locking_db, first):
        result = taskrunner("runner", "--burst", config=config, timeout=30)
        assert result.returncode == 0, result.stderr
        assert Task.get_by_id(second).last_status == SUCCESS
        assert Task.get_by_id(first).last_status == SCHEDULED
    # The lock released, the task runs.
    result = taskrunner("runner", "--burst", config=config, timeout=30)
    assert result.returncode == 0, result.stderr
    assert Task.get_by_id(first).last_status == SUCCESS
    queue.close()


@pytest.mark.timeout(60)
def test_a_claim_skips_a_locked_task_in_the_claim_order(locking_db):
    queue, runner_id = _claimer(locking_db)
    first, second = queue.add_task(ECHO, priority=1), queue.add_task(ECHO)
    with HeldLock(locking_db, first):
        claimed = lifecycle.claim(queue.store, runner_id)
        assert claimed.task_id == second
        assert lifecycle.claim(queue.store, runner_id) is None
    assert Run.get(Run.task_id == first).status == SCHEDULED
    assert lifecycle.claim(queue.store, runner_id).task_id == first
    queue.close()


@pytest.mark.timeout(60)
def test_a_batch_claim_skips_a_locked_task(locking_db):
    queue, runner_id = _claimer(locking_db)
    ids = [queue.add_task(ECHO) for _ in range(4)]
    with HeldLock(locking_db, ids[1]):
        claimed = queue.store.write(lambda: lifecycle.claim_many(
            queue.store, runner_id, ["default"], utcnow(), 16, share=False))
        assert [c.task_id for c in claimed] == [ids[0], ids[2], ids[3]]
    assert queue.get_task(ids[1]).status == SCHEDULED
    assert Run.get(Run.task_id == ids[1]).status == SCHEDULED
    assert {queue.get_task(i).status for i in ids[::2] + ids[3:]} == {RUNNING}
    queue.close()


@pytest.mark.timeout(60)
def test_a_success_and_the_next_claim_skip_a_locked_task(locking_db):
    queue, runner_id = _claimer(locking_db)
    first, locked, third = (queue.add_task(ECHO, priority=p) for p in (2, 1, 0))
    running = lifecycle.claim(queue.store, runner_id)
    assert running.task_id == first
    with HeldLock(locking_db, locked):
        ended, following = lifecycle.end_run_and_claim(
            queue.store, running.run_id, first, SUCCESS, runner_id, results="null")
        assert ended and following.task_id == third
    assert Run.get(Run.task_id == locked).status == SCHEDULED
    queue.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["rate", "key", "fair"])
def test_a_flow_claim_skips_a_locked_task(locking_db, kind):
    sections = {"queues": {"default": {"rate": "100/s", "burst": 10}}} if kind == "rate" \
        else {"queues": {"default": {"fair_by": "tenant"}}} if kind == "fair" else {}
    queue, runner_id = _claimer(locking_db, **sections)
    if kind == "key":
        queue.set_rate_limit("api", "100/s", burst=10)
    options = {"rate_key": "api"} if kind == "key" else {"tenant": "a"} if kind == "fair" \
        else {}
    first, second = (queue.add_task(ECHO, **options) for _ in range(2))
    flow.prepare(queue.store, ["default"])
    assert flow.claim_flow(queue.store, "default") is not None
    with HeldLock(locking_db, first):
        claimed = lifecycle.claim(queue.store, runner_id, now=utcnow() + timedelta(seconds=1))
        assert claimed is not None and claimed.task_id == second
    assert Run.get(Run.task_id == first).status == SCHEDULED
    queue.close()
