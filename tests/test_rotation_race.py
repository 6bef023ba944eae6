"""Rotation against an operator's retry on the databases with row locks: the retry commits
after rotation selected the task and before its DELETE ran; the task, live again, survives.

The interleaving is forced by a real lock, not by timing: a second connection makes the
retry and holds its commit; rotation's SELECT reads the task as last committed (ended, old)
and its DELETE waits for the retried row's lock; the retry commits only once the server
shows rotation's DELETE running."""
import queue as queues
import threading
from datetime import timedelta

import pytest
from conftest import direct_only, wait_for

from taskrunner import TaskQueue
from taskrunner.runs import control, lifecycle, rotation
from taskrunner.fleet import liveness
from taskrunner.store.models import ERROR, SCHEDULED, utcnow

ECHO = "taskrunner.handlers.Echo"


@pytest.fixture
def database(database_pm):
    return database_pm


def _session_id(store):
    sql = "SELECT pg_backend_pid()" if store.backend == "postgresql" else "SELECT CONNECTION_ID()"
    return store.db.execute_sql(sql).fetchone()[0]


def _deleting(store, session):
    """The rotation session is executing a DELETE: PostgreSQL reports it waiting
    for a lock; MariaDB lists the statement (its locking read cannot pass the row lock the
    test holds, so the condition is read after the retry commits either way)."""
    if store.backend == "postgresql":
        sql = ("SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
               " AND query LIKE 'DELETE FROM %%'")
    else:
        sql = ("SELECT count(*) FROM information_schema.processlist "
               "WHERE id = %s AND info LIKE 'DELETE FROM %%'")
    return store.db.execute_sql(sql, (session,)).fetchone()[0] > 0


def test_a_retry_committed_between_rotation_select_and_delete_survives(database):
    direct_only(database, "the rotation's session is found by its backend pid")
    rotating, operator, observer = (TaskQueue(database.config(), migrate=True) for _ in range(3))
    try:
        now = utcnow()
        keep_failed = rotating.config.rotation.keep_failed
        store = operator.store
        task_id = operator.add_task(ECHO, max_retries=1)
        runner_id = liveness.register(store).id
        claimed = lifecycle.claim(store, runner_id)
        lifecycle.end_run(store, claimed.run_id, task_id, ERROR, runner_id=runner_id,
                          now=now - timedelta(seconds=keep_failed + 3600))
        assert store.Task.get_by_id(task_id).given_up

        sessions, outcome = queues.Queue(), queues.Queue()

        def rotate():
            try:
                sessions.put(_session_id(rotating.store))
                outcome.put(rotation.rotate(rotating.store, now))
            except Exception as exc:  # reported to the test thread
                outcome.put(exc)
            finally:
                rotating.store.close()

        with store.db.atomic():
            # The retry, on its own connection, committed only once rotation's DELETE runs:
            # rotation's SELECT still sees the task ended and old.
            control.retry(store, task_id)
            thread = threading.Thread(target=rotate, daemon=True)
            thread.start()
            session = sessions.get(timeout=30)
            wait_for(lambda: _deleting(observer.store, session), timeout=30,
                     message="rotation's DELETE to wait for the retried task's row lock")
        thread.join(timeout=60)
        result = outcome.get(timeout=1)
        if isinstance(result, Exception):
            raise result
        assert result["failed"] == 0
        task = store.Task.get_or_none(store.Task.id == task_id)
        assert task is not None and task.finished_on is None and not task.given_up
        runs = list(store.Run.select().where(store.Run.task_id == task_id).order_by(store.Run.id))
        assert [r.status for r in runs] == [ERROR, SCHEDULED]
        # Once ended and old again, the next rotation takes it with all its runs.
        assert rotation.rotate(rotating.store, now)["failed"] == 0
    finally:
        for q in (rotating, operator, observer):
            q.close()
