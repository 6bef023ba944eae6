"""The claim reads the next run of a queue from the task_runs_claim index (queue, priority
DESC, scheduled_on, id), in index order, on every database: no scan of the backlog (its own
queue's or another's) and no sort, so it does not slow down as a backlog grows.
The reads of live runs (scheduled, running) use indexes that hold live runs only, so a long
history does not slow them either. (The speed itself is measured by bench/, not here.)"""
import logging
import threading

import pytest

from taskrunner.runs import lifecycle
from taskrunner.runs import sql as runs_sql
from taskrunner.runs.statements import mysql, postgresql, sqlite
from taskrunner.fleet import liveness
from taskrunner.runs import flow, queues
from taskrunner.store.models import Run, utcnow


def _plans(queue, backend, runner_id, name="default"):
    """The plans of the statements claim() (a claim of one), a batch's claim of 16 and
    end_run_and_claim() really send, for runner `runner_id` (registered: MySQL plans nothing
    for a claim whose runner row is missing)."""
    now, r = utcnow(), runner_id
    plans = []
    # Each claim with the slot check (a runner that can be above its queue's limit) and
    # without (shared.needs_slot_check).
    for limit, slot_check in ((1, True), (16, True), (1, False), (16, False)):
        claim = runs_sql.claim_statements(backend, limit, slot_check=slot_check)
        held = (r, name) if slot_check else ()
        if backend == "sqlite":
            # A claim of one reads its run (then starts it by id); of many, UPDATE ... RETURNING.
            params = (name, r, *held) if limit == 1 else (r, now, now, name, r, *held)
            rows = queue.store.db.execute_sql("EXPLAIN QUERY PLAN " + claim[0],
                                              params).fetchall()
            plans.append(" | ".join(str(r[-1]) for r in rows))
        elif backend == "postgresql":
            plans.append(" | ".join(r[0] for r in queue.store.db.execute_sql(
                "EXPLAIN " + claim, (name, r, *held, r, now, now))))
        else:
            cursor = queue.store.db.execute_sql("EXPLAIN " + claim, (name, r, *held))
            names = [d[0] for d in cursor.description]
            plans.append(" | ".join(str(dict(zip(names, r))) for r in cursor.fetchall()))
    if backend == "postgresql":
        for slot_check in (True, False):
            held = (r, name) if slot_check else ()
            plans.append(" | ".join(r[0] for r in queue.store.db.execute_sql(
                "EXPLAIN " + postgresql.success_and_claim(slot_check),
                (1, now, now, None, 1, r, now, now, name, r, *held, r, now, now))))
    return plans


@pytest.mark.timeout(120)
def test_claim_uses_the_claim_index_without_sorting(database):
    queue = database.queue()
    # A backlog in two queues: claiming from either reads only its own range of the index.
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "priority": i % 3,
                      "queue": "reports" if i % 2 else "default"} for i in range(3000)])
    if database.backend == "postgresql":
        # The claim joins the task rows it locks with its runs: both tables' statistics.
        queue.store.db.execute_sql("ANALYZE task_runs, task_queue")
    elif database.backend == "mysql":
        queue.store.db.execute_sql("ANALYZE TABLE task_runs")
    runner_id = liveness.register(queue.store).id
    with queue.store.db.atomic():
        plans = (_plans(queue, database.backend, runner_id)
                 + _plans(queue, database.backend, runner_id, "reports"))
    for plan in plans:
        assert "task_runs_claim" in plan, plan
        assert "TEMP B-TREE" not in plan and "filesort" not in plan and "Sort" not in plan, plan
        if database.backend == "sqlite":
            assert "queue=?" in plan, plan          # the queue bounds the index range
        elif database.backend == "postgresql":
            assert "Index Cond: ((queue)::text =" in plan, plan
    queue.close()


def _explain(queue, backend, sql, params):
    if backend == "sqlite":
        return " | ".join(str(r[-1]) for r in queue.store.db.execute_sql("EXPLAIN QUERY PLAN " + sql, params))
    return " | ".join(r[0] for r in queue.store.db.execute_sql("EXPLAIN " + sql, params))


@pytest.mark.timeout(120)
def test_live_runs_are_read_from_partial_indexes_not_the_history(database_sp):
    """3,000 runs of history, a few live ones: every read of live runs, and the end of a run,
    goes through an index (task_runs_claim / task_runs_runner hold live runs only) — never
    a scan of task_runs, and never the claim index's range of ended runs."""
    backend = database_sp.backend
    queue = database_sp.queue()
    runner_id = liveness.register(queue.store).id
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for _ in range(3000)])
    Run.update(status="success", active_task_id=None).where(Run.id > 20).execute()
    claimed = lifecycle.claim(queue.store, runner_id)
    if backend == "postgresql":
        queue.store.db.execute_sql("ANALYZE task_runs")
    now = utcnow()
    finish = (postgresql.SUCCESS_AND_CLAIM, (claimed.task_id, now, now, None, claimed.run_id,
                                                runner_id, now,
                                                now, "default", runner_id, runner_id,
                                                "default", runner_id, now, now)) \
        if backend == "postgresql" \
        else (sqlite.SUCCESS[0], (now, now, None, claimed.run_id, runner_id))
    look = queues.claim_order(queue.store, None, with_work=True)      # idle runners' poll
    assert look == (["default"], True)
    # The look as the runner reads it: with flow control's one column (runs/flow.py).
    look_query = queues.queue_rows_query(queue.store, True, (flow.keys_limited,))
    statements = [query.sql() for query in (look_query,
                                            lifecycle.scheduled_runs_query(queue.store, ["default", "reports"]),
                                            lifecycle.running_runs_query(queue.store),
                                            lifecycle.runs_of_runner_query(queue.store, runner_id))]
    for sql, params in statements + [finish]:
        plan = _explain(queue, backend, sql, params)
        assert "Seq Scan on task_runs" not in plan, (sql, plan)
        assert not any(step.strip().startswith("SCAN task_runs") and "INDEX" not in step
                       for step in plan.split(" | ")), (sql, plan)
        assert "task_runs_claim" not in plan or "scheduled" in sql, (sql, plan)
    queue.close()


# NULL for a plain task and its run (task_runs_active_task_id is not: it holds each run until
# it ends, then its NULL; it is checked for its plan only).
NULL_MOSTLY = ("task_queue_periodic_task_id", "task_queue_waiting_key", "task_queue_active_key",
               "task_queue_next_run_on", "task_runs_concurrency_slot", "task_queue_workflow_id")


@pytest.mark.timeout(120)
def test_postgresql_indexes_leave_out_nulls_and_queries_still_use_them(tmp_path):
    """Migration 0016: on PostgreSQL every update of a run or a task that cannot be done in
    place adds an entry to each index whose predicate the row satisfies, so full indexes of
    mostly-NULL columns grew by a NULL entry per update (three per job). Partial ones stay
    empty for plain tasks, and the queries that compare those columns with a value can
    still read them."""
    from conftest import Database
    database = Database("postgresql", tmp_path)
    try:
        queue = database.queue()
        queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for _ in range(1500)])
        assert queue.run_pending() == 1500
        sql = queue.store.db.execute_sql
        sizes = dict(sql("SELECT relname::text, pg_relation_size(oid) FROM pg_class "
                         "WHERE relname = ANY(%s)", (list(NULL_MOSTLY),)).fetchall())
        assert sorted(sizes) == sorted(NULL_MOSTLY)
        # An empty b-tree is its meta page (8 KiB); with full indexes the same jobs left
        # 40-48 KiB in each.
        assert all(size <= 16384 for size in sizes.values()), sorted(sizes.items())
        with queue.store.db.atomic():
            sql("SET LOCAL enable_seqscan = off")
            for index, statement in (
                    ("task_queue_next_run_on", "SELECT id FROM task_queue WHERE next_run_on <= now()"),
                    ("task_queue_active_key", "SELECT id FROM task_queue WHERE active_key = 'k'"),
                    ("task_queue_waiting_key", "SELECT id FROM task_queue WHERE waiting_key = 'k'"),
                    ("task_queue_periodic_task_id",
                     "SELECT id FROM task_queue WHERE periodic_task_id = 1"),
                    ("task_queue_workflow_id", "SELECT id FROM task_queue WHERE workflow_id = 1"),
                    ("task_queue_finished_on", "SELECT id FROM task_queue WHERE finished_on < now() "
                     "AND last_status <> 'success' ORDER BY finished_on LIMIT 10"),
                    ("task_runs_active_task_id", "SELECT id FROM task_runs WHERE active_task_id = 1"),
                    ("task_runs_concurrency_slot", "SELECT id FROM task_runs WHERE "
                     "concurrency_key = 'k' AND concurrency_slot = 1"),
                    ("task_runs_finished_on", "SELECT id FROM task_runs WHERE finished_on < now()")):
                plan = " | ".join(row[0] for row in sql("EXPLAIN " + statement))
                assert index in plan, (statement, plan)
        queue.close()
    finally:
        database.drop()


FLOWS = [(True, False, False), (False, True, False), (False, False, True), (True, True, True)]


@pytest.mark.timeout(180)
def test_flow_claims_read_the_claim_indexes_too(database):
    """The claims of issue 27 (a queue's rate, keys' rates, fairness between tenants): the
    runs are read off task_runs_claim (or task_runs_fair, for a tenant's), never by a scan
    of task_runs; the buckets and tenants by their primary keys and index."""
    from taskrunner.runs import flow
    backend = database.backend
    queue = database.queue(queues={"api": {"rate": "10/s", "fair_by": "tenant"}})
    queue.set_rate_limit("k:*", "5/s")
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "queue": "api",
                      "tenant": "t%d" % (i % 7), "rate_key": "k:%d" % (i % 3) if i % 2 else None,
                      "priority": i % 3} for i in range(3000)])
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for i in range(500)])
    if backend == "postgresql":
        queue.store.db.execute_sql("ANALYZE")
    elif backend == "mysql":
        queue.store.db.execute_sql("ANALYZE TABLE task_runs, task_tenants, task_rate_buckets")
    runner_id = liveness.register(queue.store).id
    flow.prepare(queue.store, ["api"])
    now = utcnow()
    values = {"q": "api", "runner": runner_id, "at": now, "e": runs_sql.epoch_seconds(now)}
    for mode in FLOWS:
        statements = runs_sql.flow_claim_statements(backend, *mode)
        if backend == "sqlite":
            plan = " | ".join(str(r[-1]) for r in queue.store.db.execute_sql(
                "EXPLAIN QUERY PLAN " + statements[0], dict(values, at=now.isoformat(" "))))
            assert not any(step.strip().startswith("SCAN task_runs") and "INDEX" not in step
                           for step in plan.split(" | ")), (mode, plan)
        elif backend == "postgresql":
            with queue.store.db.atomic():
                plan = " | ".join(r[0] for r in queue.store.db.execute_sql(
                    "EXPLAIN " + statements, values))
            assert "Seq Scan on task_runs" not in plan, (mode, plan)
        else:
            cursor = queue.store.db.execute_sql("EXPLAIN " + statements[1], values)
            names = [d[0] for d in cursor.description]
            rows = [dict(zip(names, r)) for r in cursor.fetchall()]
            plan = " | ".join(str(r) for r in rows)
            assert all(r["type"] != "ALL" for r in rows if r["table"] in ("r", "w")), (
                mode, "\n".join(plan.split(" | ")))
        expected = "task_runs_fair" if mode[2] else "task_runs_claim"
        assert expected in plan, (mode, plan)
        assert "filesort" not in plan or mode[2], (mode, plan)
    queue.close()


def _plan_any(queue, backend, statement, params):
    """The plan of `statement` (written with %s) on `backend`, one line per step; MySQL's
    rows as dicts' text."""
    db = queue.store.db
    if backend == "sqlite":
        return " | ".join(str(r[-1]) for r in db.execute_sql(
            "EXPLAIN QUERY PLAN " + statement.replace("%s", "?"), params))
    if backend == "postgresql":
        return " | ".join(r[0] for r in db.execute_sql("EXPLAIN " + statement, params))
    cursor = db.execute_sql("EXPLAIN " + statement, params)
    names = [d[0] for d in cursor.description]
    return " | ".join(str(dict(zip(names, r))) for r in cursor.fetchall())


def _mysql_rows(plan):
    import ast
    return [ast.literal_eval(step) for step in plan.split(" | ")]


@pytest.mark.timeout(120)
def test_postgresql_batched_success_returns_its_rows_without_joining_its_ctes(tmp_path):
    """A batched runner's successes (postgresql.SUCCESSES) come back from the task's UPDATE
    itself: a final join of the runs' and the tasks' CTEs was planned as a nested loop (the
    planner does not estimate a CTE's rows), B x B rows compared per batch of B — a fifth
    of the statement's server instructions at B = 100 (bench/server_phases.py)."""
    from conftest import Database
    database = Database("postgresql", tmp_path)
    try:
        queue = database.queue()
        queue.add_tasks([{"handler": "taskrunner.handlers.Echo"} for _ in range(300)])
        queue.store.db.execute_sql("ANALYZE task_runs, task_queue")
        runner_id = liveness.register(queue.store).id
        now = utcnow()
        with queue.store.db.atomic():
            claimed = lifecycle.claim_many(queue.store, runner_id, ["default"], now, 100,
                                           share=False)
            ids = [c.run_id for c in claimed]
            plan = [r[0] for r in queue.store.db.execute_sql(
                "EXPLAIN " + postgresql.SUCCESSES,
                (ids, [now] * len(ids), [None] * len(ids), runner_id))]
        # The statement's own step (the plan's first line) reads one CTE: no join on top.
        assert plan[0].startswith("CTE Scan on ended_task"), "\n".join(plan)
        queue.close()
    finally:
        database.drop()


@pytest.mark.timeout(180)
def test_graph_success_guard_and_release_read_by_index(database):
    """Issue 26's statements on the hot path: the guard of a success reading the task's
    `dependents` (PostgreSQL's KEY SHARE CTE; SQLite's RETURNING; MySQL's "AND dependents =
    0") reads the task by its primary key; a release reads and satisfies the parent's edges
    off the (parent_id, task_id) index (dependency_parent_id_task_id) and writes the
    dependents by primary key — none scans task_queue or task_dependencies (here about 4,000 tasks
    and 3,000 edges)."""
    from taskrunner.runs import graph
    backend = database.backend
    queue = database.queue()
    echo = "taskrunner.handlers.Echo"
    groups = [queue.group([echo] * 100, then=echo) for _ in range(20)]
    chains = [queue.chain(*[echo] * 10) for _ in range(100)]
    queue.add_tasks([{"handler": echo} for _ in range(920)])
    if backend == "postgresql":
        queue.store.db.execute_sql("ANALYZE")
    elif backend == "mysql":
        queue.store.db.execute_sql("ANALYZE TABLE task_queue, task_dependencies, task_runs")
    runner_id = liveness.register(queue.store).id
    claimed = lifecycle.claim(queue.store, runner_id)
    now = utcnow()
    parent, child = groups[5].task_ids[3], groups[5].task_ids[-1]
    some = [chains[7].task_ids[4], child, chains[9].task_ids[1]]
    marks = ", ".join(["%s"] * len(some))
    at = now.isoformat(" ") if backend == "sqlite" else now
    release = [(graph.RELEASE_CHILDREN, (parent,)), (graph.RELEASE_RUN_ANYWAY, (parent,)),
               (graph.RELEASE_SATISFY, (True, parent)),
               (graph.RELEASE_SATISFY_SOME % marks, [True, parent] + some),
               (graph.RELEASE_COUNT % marks, [at] + some),
               (graph.RELEASE_READY % marks, some), (graph.RELEASE_MARK % marks, some)]
    if backend == "postgresql":
        guard = [(postgresql.SUCCESS, (claimed.task_id, now, now, None, claimed.run_id,
                                        runner_id, now, now)),
                 (postgresql.SUCCESS_AND_CLAIM, (claimed.task_id, now, now, None,
                                                 claimed.run_id, runner_id, now, now,
                                                 "default", runner_id, runner_id, "default",
                                                 runner_id, now, now))]
    elif backend == "sqlite":
        guard = [(sqlite.SUCCESS[2].replace("?", "%s"),
                  (at, at, claimed.task_id))]
    else:
        guard = [(mysql.SUCCESS[1], (now, now, claimed.task_id))]
    with queue.store.db.atomic():
        for statement, params in guard + release:
            plan = _plan_any(queue, backend, statement, params)
            if backend == "sqlite":
                steps = [step.strip() for step in plan.split(" | ")]
                assert not any(step.startswith(("SCAN task_queue", "SCAN task_dependencies",
                                                "SCAN t", "SCAN d"))
                               and "INDEX" not in step for step in steps), (statement, plan)
                if "task_dependencies" in statement:
                    assert "dependency_parent_id_task_id" in plan, (statement, plan)
            elif backend == "postgresql":
                # "task_queue ": not the queues' own small table (task_queues), which the
                # claim's slot check (SLOT_WITHIN_LIMIT) reads.
                for table in ("task_queue", "task_dependencies", "task_runs"):
                    assert "Seq Scan on %s " % table not in plan, (statement, plan)
                if "task_dependencies" in statement:
                    assert "dependency_parent_id_task_id" in plan, (statement, plan)
                else:
                    assert "task_queue_pkey" in plan, (statement, plan)
            else:
                rows = _mysql_rows(plan)
                assert all(r["type"] != "ALL" for r in rows), (statement, plan)
                keys = {r["key"] for r in rows}
                if "task_dependencies" in statement:
                    assert "dependency_parent_id_task_id" in keys, (statement, plan)
                else:
                    # By primary key, or by (finished_on, id): InnoDB's secondary index ends
                    # with the primary key, so "finished_on IS NULL AND id IN (...)" is a
                    # range of one entry per id.
                    assert all(r["key"] == "PRIMARY" or int(r["rows"]) <= len(some)
                               for r in rows), (statement, plan)
    queue.close()


class _Sent(logging.Handler):
    """The (sql, params) peewee sends from this thread while attached (its DEBUG log)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.sent, self.thread = [], threading.get_ident()

    def emit(self, record):
        if threading.get_ident() == self.thread and isinstance(record.msg, tuple):
            self.sent.append(record.msg)

    def __enter__(self):
        logger = logging.getLogger("peewee")
        self.level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("peewee").removeHandler(self)
        logging.getLogger("peewee").setLevel(self.level)


@pytest.mark.timeout(180)
def test_workflow_reads_read_the_workflow_index(database):
    """Migration 0022: task_queue_workflow_id leaves out the tasks added outside a workflow
    on SQLite and PostgreSQL (a partial index), and every read of a workflow's tasks — its
    counts, its graph, its unfinished ids, rotation's check for workflows left empty — still
    reads it (their `= ?` and `IN (...)` say the column is not NULL), on MySQL the full one.
    Here 2,000 plain tasks and 20 workflows of 5."""
    from taskrunner.reads import workflows as workflow_reads
    from taskrunner.runs import rotation
    backend = database.backend
    queue = database.queue()
    echo = "taskrunner.handlers.Echo"
    queue.add_tasks([{"handler": echo} for _ in range(1000)])
    chains = [queue.chain(*[echo] * 5) for _ in range(10)]
    with _Sent() as reads:
        queue.workflow(chains[3].id)
        workflow_reads.workflow_task_ids(queue.store, chains[3].id, unfinished=True)
    assert queue.run_pending() == 1050
    queue.store.Task.update(finished_on=utcnow().replace(year=2000)).execute()
    with _Sent() as rotating:
        rotation.rotate(queue.store, utcnow())
    # (the count of a workflow's running tasks reads the running runs first: a few rows)
    statements = [s for s in reads.sent + rotating.sent
                  if s[0].startswith("SELECT") and "workflow_id" in s[0].split(" WHERE ")[-1]
                  and "task_runs" not in s[0].split(" WHERE ")[0]]
    assert len(statements) == 4 and any(" IN (" in s[0] for s in statements), statements
    queue.add_tasks([{"handler": echo} for _ in range(2000)])
    chains = [queue.chain(*[echo] * 5) for _ in range(20)]
    if backend == "sqlite":
        [sql] = [r[0] for r in queue.store.db.execute_sql(
            "SELECT sql FROM sqlite_master WHERE name = 'task_queue_workflow_id'")]
        assert "IS NOT NULL" in sql, sql
    elif backend == "postgresql":
        [sql] = [r[0] for r in queue.store.db.execute_sql(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'task_queue_workflow_id'")]
        assert "IS NOT NULL" in sql, sql
        queue.store.db.execute_sql("ANALYZE")
    else:
        queue.store.db.execute_sql("ANALYZE TABLE task_queue")
    for statement, params in statements:
        plan = _plan_any(queue, backend, statement, params)
        if backend == "mysql":
            assert any("task_queue_workflow_id" in (r["key"] or "") for r in _mysql_rows(plan)), (
                statement, plan)
        else:
            assert "task_queue_workflow_id" in plan, (statement, plan)
    queue.close()
