"""Durable execution under kill -9, on each database (issue 25, point 5): tasks of 10
transaction steps with checkpoints and a durable sleep, while runners and overseers are
killed -9 every few seconds (SQLite: many processes on one file; PostgreSQL: two overseers;
MariaDB). Afterwards every task has ended ``success``; every step is recorded exactly once;
the application rows written inside the steps' transactions exist exactly once, as do the
executions the steps logged in their own transaction; and no step executed again after it
completed (the log outside the database: no ``exec`` of a step after its ``done``).

Scale: CHAOS_TASKS tasks x 10 steps (the issue's 300 x 10 scaled down to 150 x 10, 100 x 10
on MariaDB, to keep each database near a minute on a shared two-core machine), 40 s of kills.
TASKRUNNER_CHAOS_FULL=1 runs the issue's scale, 300 x 10 on every database, with deadlines
to match (a run by hand, not CI's)."""
import os
import time
from collections import Counter

import pytest

from durable_handlers import lines
from test_overseer import fresh_overseers, own_tasks, wait_all_final
from taskrunner.store.models import SCHEDULED, RUNNING, SUCCESS, Run, Step, Task

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
    log = str(tmp_path / "steps")
    tasks_count = CHAOS_TASKS[database.backend]
    task_ids = queue.add_tasks([{"handler": "durable_handlers.Chaos", "data": {
        "log": log, "steps": STEPS, "sleep": 0.5, "pause": 0.04}} for _ in range(tasks_count)])
    config = overseers.config(limit=4, check_interval=0.5, max_retries=100,
                              heartbeat_interval=1, max_start_failures=1000)
    started = time.monotonic()
    kills, overseer_kills = overseers.chaos(config, OVERSEERS[database.backend], limit=4)
    assert kills >= 8 and overseer_kills >= 2, "the tasks ended before the chaos had a chance"
    # The last overseer started carries on alone while the others' runners wind down.
    wait_all_final(overseers, timeout=1200 if FULL else 240)

    tasks = list(own_tasks(Task.id, Task.last_status))
    assert len(tasks) == tasks_count
    assert {t.last_status for t in tasks} == {SUCCESS}, \
        [(t.id, t.last_status) for t in tasks if t.last_status != SUCCESS][:10]
    expected = Counter((t, "s%d" % i) for t in task_ids for i in range(STEPS))
    assert rows(queue, "app_rows") == expected, "an app row is missing or written twice"
    assert rows(queue, "executions") == expected, "a committed step executed twice"
    steps = Counter((s.task_id, s.name) for s in Step.select(Step.task_id, Step.name))
    assert all(n == 1 for n in steps.values())
    assert {k for k in steps if k[1][1:].isdigit()} == set(expected)
    assert {k[0] for k in steps if k[1] == "sleep-1"} == set(task_ids)
    # No step executed again once it had completed (the log outside the database).
    done, again = set(), []
    for kind, task, step in lines(log):
        if kind == "done":
            done.add((task, step))
        elif (task, step) in done:
            again.append((task, step))
    assert not again, again[:10]
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0
    waited = Run.select().where(Run.status == "waiting").count()
    print("backend %s: %d tasks x %d steps, %d runner kills, %d overseer kills, %d waiting "
          "runs, %d executions outside the database for %d steps, %.1fs" % (
              database.backend, tasks_count, STEPS, kills, overseer_kills, waited,
              sum(1 for line in lines(log) if line[0] == "exec"), len(expected),
              time.monotonic() - started))
    queue.close()
