"""The claim reads the next run from the task_runs_claim index, in index order, on every
database: no scan of the backlog and no sort, so it does not slow down as the backlog grows.
(The speed itself is measured by bench/, not here.)"""
import pytest

from taskrunner.models import utcnow
from taskrunner.queue import _MYSQL_CLAIM, _PG_CLAIM, _PG_SUCCESS_AND_CLAIM, _SQLITE_CLAIM


def _plans(queue, backend):
    """The plans of the statements claim() and end_run_and_claim() really send."""
    now = utcnow()
    if backend == "sqlite":
        rows = queue.db.execute_sql("EXPLAIN QUERY PLAN " + _SQLITE_CLAIM[0], (1, now, now)).fetchall()
        return [" | ".join(str(r[-1]) for r in rows)]
    if backend == "postgresql":
        plans = []
        for sql, params in ((_PG_CLAIM, (1, now, now, now)),
                            (_PG_SUCCESS_AND_CLAIM, (now, now, None, 1, 1, now, now, 1, now, now, now))):
            plans.append(" | ".join(r[0] for r in queue.db.execute_sql("EXPLAIN " + sql, params)))
        return plans
    cursor = queue.db.execute_sql("EXPLAIN " + _MYSQL_CLAIM)
    names = [d[0] for d in cursor.description]
    return [" | ".join(str(dict(zip(names, r))) for r in cursor.fetchall())]


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
        plans = _plans(queue, database.backend)
    for plan in plans:
        assert "task_runs_claim" in plan, plan
        assert "TEMP B-TREE" not in plan and "filesort" not in plan and "Sort" not in plan, plan
    queue.close()
