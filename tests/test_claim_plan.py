"""The claim reads the next run from the task_runs_claim index, in index order, on every
database: no scan of the backlog and no sort, so it does not slow down as the backlog grows.
(The speed itself is measured by bench/, not here.)"""
import pytest


def _plan(queue, backend):
    sql, params = queue.claim_query().sql()
    if backend == "sqlite":
        rows = queue.db.execute_sql("EXPLAIN QUERY PLAN " + sql, params).fetchall()
        return " | ".join(str(r[-1]) for r in rows)
    if backend == "postgresql":
        rows = queue.db.execute_sql("EXPLAIN " + sql, params).fetchall()
        return " | ".join(r[0] for r in rows)
    cursor = queue.db.execute_sql("EXPLAIN " + sql, params)
    names = [d[0] for d in cursor.description]
    return " | ".join(str(dict(zip(names, r))) for r in cursor.fetchall())


@pytest.mark.timeout(120)
def test_claim_uses_the_claim_index_without_sorting(database):
    queue = database.queue()
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "priority": i % 3}
                     for i in range(3000)])
    if database.backend == "postgresql":
        queue.db.execute_sql("ANALYZE task_runs")
    elif database.backend == "mysql":
        queue.db.execute_sql("ANALYZE TABLE task_runs")
    with queue.db.atomic():
        plan = _plan(queue, database.backend)
    assert "task_runs_claim" in plan, plan
    assert "TEMP B-TREE" not in plan and "filesort" not in plan and "Sort" not in plan, plan
    queue.close()
