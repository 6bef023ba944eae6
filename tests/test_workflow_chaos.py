"""Workflows under kill -9, on each database (issue 26, point 5): a fan-out of BRANCHES
branches after one task, a chain of CHAIN tasks inside each branch, and a fan-in after every
branch's end, while runners and overseers are killed -9 every few seconds (SQLite: one
overseer, its runners many processes on one file; PostgreSQL: two overseers; MariaDB).
Afterwards every task has ended ``success``; no task started before each of its parents'
successful runs ended (the order of the records the handlers appended, and the database's
times: a dependent's first run created no earlier than its parents finished); none was
released twice (one run of attempt 1; a task's attempts are 1..n, each new one after a kill
-9 ended the one before); none was forgotten (no task left waiting, every edge satisfied);
the fan-in read the results of all its parents.

Scale: 1 + BRANCHES x CHAIN + 1 = 152 tasks of 0.3 s each (the issue's 1,000 scaled down to
keep each database near a minute on a shared two-core machine), at most 4 runners, kills
for up to 40 s. TASKRUNNER_CHAOS_FULL=1 runs the issue's scale: 200 branches, 1,002 tasks,
with deadlines to match (a run by hand, not CI's)."""
import os
import time
from collections import defaultdict
from datetime import timedelta

import pytest

from test_overseer import fresh_overseers, own_tasks, wait_all_final
from taskrunner.store.models import RUNNING, SCHEDULED, SUCCESS, Run, Task

FULL = os.environ.get("TASKRUNNER_CHAOS_FULL") == "1"
BRANCHES, CHAIN = (200 if FULL else 30), 5
OVERSEERS = {"sqlite": 1, "postgresql": 2, "mysql": 1}
STEP = "workflow_handlers.Step"


@pytest.fixture(params=("sqlite", "postgresql", "mysql"))
def overseers(request, tmp_path):
    with fresh_overseers(request.param, tmp_path) as group:
        yield group


def records(path):
    """[(kind, task, run)] in the order the handlers appended them."""
    with open(path) as f:
        return [(kind, int(task), int(run)) for kind, task, run in
                (line.split() for line in f if line.strip())]


def workflow_specs(log):
    data = {"log": log, "sleep": 0.3}
    specs = [{"key": "root", "handler": STEP, "data": data, "max_retries": 100}]
    for b in range(BRANCHES):
        for i in range(CHAIN):
            specs.append({"key": "b%d-%d" % (b, i), "handler": STEP, "data": data,
                          "max_retries": 100,
                          "after": ["root" if i == 0 else "b%d-%d" % (b, i - 1)]})
    specs.append({"key": "fan-in", "handler": STEP, "max_retries": 100,
                  "data": dict(data, count_parents=True),
                  "after": ["b%d-%d" % (b, CHAIN - 1) for b in range(BRANCHES)]})
    return specs


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(1800 if FULL else 420)
def test_chaos_kill_9_runners_and_overseers_releases_every_dependent_once_in_order(
        overseers, tmp_path):
    database = overseers.database
    queue = database.queue(task={"max_retries": 100, "retry_backoff": 0})
    log = str(tmp_path / "records")
    wf = queue.add_workflow(workflow_specs(log), name="chaos")
    assert len(wf.task_ids) == 2 + BRANCHES * CHAIN
    config = overseers.config(limit=4, check_interval=0.5, max_retries=100,
                              heartbeat_interval=1, max_start_failures=1000)
    started = time.monotonic()
    kills, overseer_kills = overseers.chaos(config, OVERSEERS[database.backend])
    assert kills >= 8 and overseer_kills >= 2, "the workflow ended before the chaos had a chance"
    wait_all_final(overseers, timeout=1200 if FULL else 240)
    elapsed = time.monotonic() - started

    # Every task final, successful; none forgotten.
    tasks = {t.id: t for t in own_tasks()}
    assert set(tasks) == set(wf.task_ids)
    assert {t.last_status for t in tasks.values()} == {SUCCESS}, \
        [(t.id, t.last_status) for t in tasks.values() if t.last_status != SUCCESS][:10]
    assert all(t.waiting_parents is None for t in tasks.values())
    Dependency = queue.store.Dependency
    edges = [(d.task_id, d.parent_id, d.satisfied) for d in Dependency.select()]
    assert len(edges) == BRANCHES * CHAIN + BRANCHES and all(s for _, _, s in edges)
    assert queue.get_task(wf.task_ids[-1]).results == {"parents": BRANCHES}
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0

    # Released once: one first run per task; later attempts only after a kill -9 ended the
    # one before (attempts 1..n in run order, each earlier one ended without success).
    runs = defaultdict(list)
    for r in Run.select().order_by(Run.id):
        runs[r.task_id].append(r)
    success_run = {}
    for task_id in wf.task_ids:
        mine = runs[task_id]
        assert [r.attempt for r in mine] == list(range(1, len(mine) + 1)), \
            (task_id, [(r.id, r.attempt, r.status) for r in mine])
        assert [r.status for r in mine].count(SUCCESS) == 1 and mine[-1].status == SUCCESS
        for before, after in zip(mine, mine[1:]):
            assert before.finished_on is not None and before.finished_on <= after.created_on
        success_run[task_id] = mine[-1].id

    # Never early: each dependent's first start comes after the end of each parent's
    # successful run in the records, and its first run was created once they finished.
    order = records(log)
    ended = {(task, run): i for i, (kind, task, run) in enumerate(order) if kind == "end"}
    first_start = {}
    for i, (kind, task, run) in enumerate(order):
        if kind == "start":
            first_start.setdefault(task, i)
    assert set(first_start) == set(wf.task_ids)
    early = []
    for child, parent, _ in edges:
        if not ended[(parent, success_run[parent])] < first_start[child]:
            early.append((child, parent))
        # Times are taken before each statement, not at its commit: two parents ending at
        # once, the one that commits last (and releases the child) may carry the earlier
        # time. The records above give the order; the times may differ by that much.
        if runs[child][0].created_on < tasks[parent].finished_on - timedelta(seconds=1):
            early.append((child, parent, "created"))
    assert not early, early[:10]
    retried = sum(1 for t in wf.task_ids if len(runs[t]) > 1)
    print("backend %s: %d tasks, %d runner kills, %d overseer kills, %d tasks retried after a "
          "kill, %d runs, %.1fs" % (database.backend, len(wf.task_ids), kills, overseer_kills,
                                    retried, sum(len(v) for v in runs.values()), elapsed))
    queue.close()
