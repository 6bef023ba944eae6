"""Migration 0019 on a database with history (SQLite, PostgreSQL, MariaDB), and the plans of
the durable statements: the steps of a task and its unconsumed events are read through
their (task_id, name) indexes, never a scan of every task's steps or events; a waiting task
costs the claim nothing (it has no scheduled run) and is found by the next_run_on index."""
import pytest

from conftest import ALL_BACKENDS, Database
from durable_handlers import lines
from taskrunner.runs import durable
from taskrunner.store.models import utcnow

H = "durable_handlers."


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_migration_0019_keeps_the_history_and_durable_handlers_work_after_it(backend,
                                                                             tmp_path):
    db = Database(backend, tmp_path, empty=True)
    try:
        store = db.store_at("0018_consecutive_crashes_and_stopping_since",
                            task={"retry_backoff": 0})
        param, now = store.db.param, utcnow()
        for status in ("success", "error"):
            store.db.execute_sql(
                "INSERT INTO task_queue (queued_on, scheduled_on, handler, data, priority, "
                "last_status, max_retries, runs_failed, run_count, run_timeout, updated_on, "
                "crash_count, runs_crashed, queue) VALUES (%s)" % ", ".join([param] * 14),
                (now, now, "taskrunner.handlers.Echo", '{"old": true}', 0, status, 5,
                 int(status == "error"), 1, 60.0, now, 0, 0, "default"))
        store.db.execute_sql(
            "INSERT INTO task_runs (task_id, created_on, updated_on, status, attempt, priority, "
            "scheduled_on, queue, percent_completed, results) VALUES (%s)"
            % ", ".join([param] * 10), (1, now, now, "success", 1, 0, now, "default", 100,
                                        '{"kept": 1}'))
        assert store.migrate()[0] == "0019_durable_execution"
        from taskrunner.api import TaskQueue
        queue = TaskQueue(store)
        old = queue.get_task(1)
        assert (old.status, old.data, old.results, old.checkpoint, old.steps) == (
            "success", {"old": True}, {"kept": 1}, None, None)
        assert queue.steps_of(1) == [] and queue.get_task(2).status == "retrying"
        log = str(tmp_path / "log")
        task_id = queue.add_task(H + "CheckpointThenFail", {"log": log})
        while queue.run_pending():
            pass
        assert queue.get_task(task_id).results == {"resumed_from": {"done": 3}}
        assert len(lines(log)) == 2
        store.close()
    finally:
        db.drop()


def _plan(queue, backend, sql, params):
    db = queue.store.db
    if backend == "sqlite":
        return " | ".join(str(r[-1]) for r in db.execute_sql("EXPLAIN QUERY PLAN " + sql,
                                                              params))
    cursor = db.execute_sql("EXPLAIN " + sql, params)
    if backend == "postgresql":
        return " | ".join(r[0] for r in cursor)
    names = [d[0] for d in cursor.description]
    return " | ".join(str(dict(zip(names, r))) for r in cursor.fetchall())


@pytest.mark.timeout(180)
def test_durable_reads_use_their_indexes(database):
    backend = database.backend
    queue = database.queue()
    store = queue.store
    ids = queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for _ in range(300)])
    now = utcnow()
    store.Step.insert_many([{"task_id": t, "name": "s%d" % i, "kind": "step", "result": "1",
                             "finished_on": now} for t in ids for i in range(10)]).execute()
    store.Event.insert_many([{"task_id": t, "name": "e%d" % (i % 5), "payload": "1",
                              "sent_on": now} for t in ids for i in range(10)]).execute()
    if backend == "postgresql":
        store.db.execute_sql("ANALYZE task_steps")
        store.db.execute_sql("ANALYZE task_events")
    elif backend == "mysql":
        store.db.execute_sql("ANALYZE TABLE task_steps, task_events")
    Step, Event = store.Step, store.Event
    statements = {
        "steps": Step.select(Step.name, Step.kind, Step.result).where(Step.task_id == ids[5]),
        "one step": Step.select(Step.kind, Step.result).where(
            (Step.task_id == ids[5]) & (Step.name == "s3")),
        "event": Event.select(Event.id, Event.payload).where(
            (Event.task_id == ids[5]) & (Event.name == "e3") & Event.consumed_on.is_null())
        .order_by(Event.id).limit(1)}
    for what, query in statements.items():
        sql, params = query.sql()
        plan = _plan(queue, backend, sql, params)
        index = "task_events_task_name" if what == "event" else "task_steps_task_name"
        assert index in plan, (what, plan)
        assert "SCAN task_" not in plan and "Seq Scan" not in plan \
            and "'type': 'ALL'" not in plan, (what, plan)
    # The steps and the events of a task are read by the durable side as written.
    assert durable.read_state(store, ids[5])[1]["s3"] == ("step", "1")
    queue.close()
