"""Durable execution under kill -9, on each database (issue 25, point 5): tasks of 10
transaction steps with checkpoints and a durable sleep, while runners and overseers are
killed -9 every few seconds (SQLite: many processes on one file; PostgreSQL: two overseers;
MariaDB). What "held" means is `taskrunner verify`'s checker's (taskrunner/verify/checker.py),
read from the same kind of history: each handler records its start and return, each step's
execution (outside the database, as a side effect would be) and its commit; the test records
each task's enqueue and what the database recorded (every run's claim and end, every task's
final state, the application rows). The checker says that every task ended ``success``
once, with no two runs live at once and no run started twice, that no step executed again
after its record committed, and that each application row written in a step's transaction
exists exactly once (steps-once). Besides: every step is recorded exactly once, as are the
executions the steps logged in their own transaction, and every task slept once.

Scale: CHAOS_TASKS tasks x 10 steps (the issue's 300 x 10 scaled down to 150 x 10, 100 x 10
on MariaDB, to keep each database near a minute on a shared two-core machine), 40 s of kills.
TASKRUNNER_CHAOS_FULL=1 runs the issue's scale, 300 x 10 on every database, with deadlines
to match (a run by hand, not CI's)."""
import os
import time
from collections import Counter

import pytest

from test_overseer import fresh_overseers, own_tasks, wait_all_final
from taskrunner.store.models import SCHEDULED, RUNNING, Run, Step, Task
from taskrunner.verify import checker, history
from taskrunner.verify.session import collect

# Per database: MariaDB's runners go through fewer steps a second here.
FULL = os.environ.get("TASKRUNNER_CHAOS_FULL") == "1"
CHAOS_TASKS = ({"sqlite": 300, "postgresql": 300, "mysql": 300} if FULL
               else {"sqlite": 150, "postgresql": 150, "mysql": 100})
STEPS = 10
OVERSEERS = {"sqlite": 1, "postgresql": 2, "mysql": 1}


def create_tables(queue):
    for table in ("app_rows", "executions"):
        queue.store.db.execute_sql("CREATE TABLE %s (task_id INTEGER NOT NULL, step "
                                   "VARCHAR(64) NOT NULL)" % table)


def rows(queue, table):
    return Counter(tuple(r) for r in queue.store.db.execute_sql(
        "SELECT task_id, step FROM %s" % table).fetchall())


@pytest.fixture(params=("sqlite", "postgresql", "mysql"))
def overseers(request, tmp_path):
    with fresh_overseers(request.param, tmp_path) as group:
        yield group


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(1800 if FULL else 420)
def test_chaos_kill_9_runners_and_overseers_every_step_exactly_once(overseers, tmp_path):
    database = overseers.database
    queue = database.queue(task={"max_retries": 100, "retry_backoff": 0})
    create_tables(queue)
    log = str(tmp_path / "history")
    os.mkdir(log)
    tasks_count = CHAOS_TASKS[database.backend]
    task_ids = queue.add_tasks([{"handler": "durable_handlers.Chaos", "data": {
        "log": log, "steps": STEPS, "sleep": 0.5, "pause": 0.04}} for _ in range(tasks_count)])
    for task_id in task_ids:
        history.record(log, "enqueue", task=task_id, shape="steps", steps=STEPS)
    config = overseers.config(limit=4, check_interval=0.5, max_retries=100,
                              heartbeat_interval=1, max_start_failures=1000)
    started = time.monotonic()
    kills, overseer_kills = overseers.chaos(config, OVERSEERS[database.backend], limit=4)
    assert kills >= 8 and overseer_kills >= 2, "the tasks ended before the chaos had a chance"
    # The last overseer started carries on alone while the others' runners wind down.
    wait_all_final(overseers, timeout=1200 if FULL else 240)

    # Held, as `taskrunner verify` says it.
    collect(queue.store, log, task_ids, effects=False)
    for (task, step), count in rows(queue, "app_rows").items():
        history.record(log, "effect", task=task, step=step, count=count)
    results = checker.check(history.read(log))
    assert checker.held(results), "\n".join(r.line() for r in results)

    assert len(list(own_tasks(Task.id))) == tasks_count
    expected = Counter((t, "s%d" % i) for t in task_ids for i in range(STEPS))
    assert rows(queue, "executions") == expected, "a committed step executed twice"
    steps = Counter((s.task_id, s.name) for s in Step.select(Step.task_id, Step.name))
    assert all(n == 1 for n in steps.values())
    assert {k for k in steps if k[1][1:].isdigit()} == set(expected)
    assert {k[0] for k in steps if k[1] == "sleep-1"} == set(task_ids)
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0
    waited = Run.select().where(Run.status == "waiting").count()
    print("backend %s: %d tasks x %d steps, %d runner kills, %d overseer kills, %d waiting "
          "runs, %.1fs\n%s" % (database.backend, tasks_count, STEPS, kills, overseer_kills,
                               waited, time.monotonic() - started,
                               "\n".join(r.line() for r in results)))
    queue.close()
