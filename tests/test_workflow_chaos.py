"""Workflows under kill -9, on each database (issue 26, point 5): a fan-out of BRANCHES
branches after one task, a chain of CHAIN tasks inside each branch, and a fan-in after every
branch's end, while runners and overseers are killed -9 every few seconds (SQLite: one
overseer, its runners many processes on one file; PostgreSQL: two overseers; MariaDB).

What "held" means is `taskrunner verify`'s checker's (taskrunner/verify/checker.py), read
from the same kind of history: the handlers record each start, return and fan-in's reading
of its parents; the test records each task's enqueue with its parents, and what the
database recorded (every run's claim and end, every task's final state). The checker then
says that every task ended ``success`` once (nothing-lost, one-success); no two runs of a
task were live at once (one-live-run); no run was started twice (claimed-once); no dependent
started before the successful run of each of its parents returned, none was released twice,
and the fan-in read every parent (fan-in). Besides: none was forgotten (no task left
waiting, every edge satisfied), and the fan-in's result counts all its parents.

Scale: 1 + BRANCHES x CHAIN + 1 = 152 tasks of 0.3 s each (the issue's 1,000 scaled down to
keep each database near a minute on a shared two-core machine), at most 4 runners, kills
for up to 40 s. TASKRUNNER_CHAOS_FULL=1 runs the issue's scale: 200 branches, 1,002 tasks,
with deadlines to match (a run by hand, not CI's)."""
import os
import time

import pytest

from test_overseer import fresh_overseers, own_tasks, wait_all_final
from taskrunner.store.models import RUNNING, SCHEDULED, Run
from taskrunner.verify import checker, history
from taskrunner.verify.session import collect

FULL = os.environ.get("TASKRUNNER_CHAOS_FULL") == "1"
BRANCHES, CHAIN = (200 if FULL else 30), 5
OVERSEERS = {"sqlite": 1, "postgresql": 2, "mysql": 1}
STEP = "workflow_handlers.Step"


@pytest.fixture(params=("sqlite", "postgresql", "mysql"))
def overseers(request, tmp_path):
    with fresh_overseers(request.param, tmp_path) as group:
        yield group


def workflow_specs(directory):
    data = {"history": directory, "sleep": 0.3}
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
    directory = str(tmp_path / "history")
    os.mkdir(directory)
    specs = workflow_specs(directory)
    wf = queue.add_workflow(specs, name="chaos")
    assert len(wf.task_ids) == 2 + BRANCHES * CHAIN
    keys = {spec["key"]: task_id for spec, task_id in zip(specs, wf.task_ids)}
    for spec, task_id in zip(specs, wf.task_ids):
        history.record(directory, "enqueue", task=task_id, shape=spec["key"],
                       parents=[keys[k] for k in spec.get("after", ())],
                       reads=spec["key"] == "fan-in")
    config = overseers.config(limit=4, check_interval=0.5, max_retries=100,
                              heartbeat_interval=1, max_start_failures=1000)
    started = time.monotonic()
    kills, overseer_kills = overseers.chaos(config, OVERSEERS[database.backend])
    assert kills >= 8 and overseer_kills >= 2, "the workflow ended before the chaos had a chance"
    wait_all_final(overseers, timeout=1200 if FULL else 240)
    elapsed = time.monotonic() - started

    # Held, as `taskrunner verify` says it.
    collect(queue.store, directory, wf.task_ids, effects=False)
    results = checker.check(history.read(directory))
    assert checker.held(results), "\n".join(r.line() for r in results)

    # None forgotten.
    tasks = {t.id: t for t in own_tasks()}
    assert set(tasks) == set(wf.task_ids)
    assert all(t.waiting_parents is None for t in tasks.values())
    Dependency = queue.store.Dependency
    edges = [(d.task_id, d.parent_id, d.satisfied) for d in Dependency.select()]
    assert len(edges) == BRANCHES * CHAIN + BRANCHES and all(s for _, _, s in edges)
    assert queue.get_task(wf.task_ids[-1]).results == {"parents": BRANCHES}
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0
    runs = Run.select().count()
    print("backend %s: %d tasks, %d runner kills, %d overseer kills, %d runs, %.1fs\n%s" % (
        database.backend, len(wf.task_ids), kills, overseer_kills, runs, elapsed,
        "\n".join(r.line() for r in results)))
    queue.close()
