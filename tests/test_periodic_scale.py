"""Rule 9 at scale (the throughput issue): N periodic tasks due at once, schedulers racing
and killed -9 in the middle of their pass, on SQLite and PostgreSQL. Whatever is killed when,

- every due time yields exactly one task, on its due time, and the periodic task's nextrun,
  last_due and counters say so;
- a due time is skipped while the previous task of its periodic task is unfinished;
- after downtime, the missed due times produce one task (catch-up once).

N is ``TASKRUNNER_TEST_PERIODIC_SCALE`` (default 2,000, what CI runs; the issue's figure is
10,000: ``TASKRUNNER_TEST_PERIODIC_SCALE=10000 pytest tests/test_periodic_scale.py``).
"""
import os
import signal
from datetime import timedelta

import peewee as pw
import pytest

from conftest import ok, taskrunner, wait_for
from taskrunner.periodic.definitions import check_periodic
from taskrunner.periodic.timers import IntervalTimer
from taskrunner.store.models import SUCCESS, PeriodicTask, Task, utcnow

SCALE = int(os.environ.get("TASKRUNNER_TEST_PERIODIC_SCALE", "2000"))
PASS_TIMEOUT = 60 + SCALE / 50      # a pass is ~1,000 a second or better; two shared cores
RUN_TIMEOUT = 120 + SCALE / 10      # four runners draining SCALE Echo tasks, on a busy machine
HOUR = timedelta(hours=1)


def add_due_periodic_tasks(queue, count, due):
    """`count` periodic tasks ("every 1h", Echo) due at `due`, inserted in bulk."""
    values, _ = check_periodic(queue.config, "burst", "taskrunner.handlers.Echo", "every 1h")
    now = utcnow()
    rows = [dict(values, name="burst-%05d" % n, nextrun=due, created=due - HOUR,
                 updated_on=now) for n in range(count)]
    with queue.store.db.atomic():
        for start in range(0, count, 500):
            PeriodicTask.insert_many(rows[start:start + 500]).execute()


def burst():
    return PeriodicTask.name.startswith("burst-")


def tasks_per_periodic_task():
    """{periodic task id: its number of tasks} for every burst periodic task."""
    counts = dict.fromkeys((r.id for r in PeriodicTask.select(PeriodicTask.id).where(burst())), 0)
    for periodic_task_id, n in (Task.select(Task.periodic_task_id, pw.fn.COUNT(Task.id))
                                .where(Task.periodic_task_id.in_(list(counts)))
                                .group_by(Task.periodic_task_id).tuples()):
        counts[periodic_task_id] = n
    return counts


def race_and_kill(procs, config, schedulers=3, killed=2):
    """`schedulers` one-pass schedulers (run-event periodic-task:OnProcess) at once; once
    the first batch is in, `killed` of them are killed -9 in the middle of their pass; the
    others run to their end, and one more pass takes whatever the killed ones held.
    Returns how many were killed while their pass was under way."""
    started = [procs.spawn("run-event", "periodic-task:OnProcess", config=config,
                           name="scheduler") for _ in range(schedulers)]
    wait_for(lambda: PeriodicTask.select().where(burst() & (PeriodicTask.nextrun > utcnow()))
             .exists(), timeout=PASS_TIMEOUT, message="a first batch\n" + procs.logs(started))
    hit = 0
    for proc in started[:killed]:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            hit += 1
    for proc in started[killed:]:
        assert procs.wait(proc, timeout=PASS_TIMEOUT) == 0, procs.logs([proc])
    for proc in started[:killed]:
        procs.wait(proc, timeout=30)
    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config, timeout=PASS_TIMEOUT))
    return hit


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(600 + SCALE // 5)
def test_rule_9_holds_at_scale_with_schedulers_killed_mid_pass(database_sp, procs, tmp_path):
    queue = database_sp.queue()
    config = database_sp.write_config(tmp_path / "c.toml")
    first_due = utcnow().replace(microsecond=0) - timedelta(seconds=1)
    add_due_periodic_tasks(queue, SCALE, first_due)

    # 1. Every due time yields exactly one task, however many schedulers are killed when.
    hit = race_and_kill(procs, config)
    counts = tasks_per_periodic_task()
    assert sorted(set(counts.values())) == [1], {n: list(counts.values()).count(n)
                                                 for n in set(counts.values())}
    wrong = Task.select().join(PeriodicTask, on=Task.periodic_task_id == PeriodicTask.id).where(
        burst() & ((Task.scheduled_on != first_due) | (PeriodicTask.last_due != first_due)
                   | (PeriodicTask.nextrun != first_due + HOUR)
                   | (PeriodicTask.submitted_count != 1) | (PeriodicTask.skipped_count != 0)
                   | (PeriodicTask.last_task_id != Task.id)
                   | PeriodicTask.marked.is_null(False))).count()
    assert wrong == 0
    print("%d periodic tasks: %d schedulers killed mid-pass" % (SCALE, hit))

    # 2. Their next due time (moved to now) is skipped: every previous task is unfinished.
    second_due = utcnow().replace(microsecond=0) - timedelta(seconds=1)
    PeriodicTask.update(nextrun=second_due).where(burst()).execute()
    hit = race_and_kill(procs, config, schedulers=2, killed=1)
    assert sorted(set(tasks_per_periodic_task().values())) == [1]
    wrong = PeriodicTask.select().where(burst() & (
        (PeriodicTask.skipped_count != 1) | (PeriodicTask.submitted_count != 1)
        | (PeriodicTask.nextrun != second_due + HOUR) | (PeriodicTask.last_due != second_due)))
    assert wrong.count() == 0
    print("skipped while unfinished: %d killed mid-pass" % hit)

    # 3. The tasks run; then downtime: five due times missed produce one task each.
    runners = [procs.spawn("runner", "--burst", config=config, name="runner") for _ in range(4)]
    for proc in runners:
        assert procs.wait(proc, timeout=RUN_TIMEOUT) == 0, procs.logs([proc])
    assert Task.select().where(Task.last_status != SUCCESS).count() == 0
    missed = utcnow().replace(microsecond=0) - 5 * HOUR - timedelta(seconds=1)
    PeriodicTask.update(nextrun=missed).where(burst()).execute()
    pass_start = utcnow()
    hit = race_and_kill(procs, config, schedulers=2, killed=1)
    counts = tasks_per_periodic_task()
    assert sorted(set(counts.values())) == [2]
    grid = IntervalTimer(3600, "1h").next_after(pass_start, anchor=missed)
    wrong = Task.select().join(PeriodicTask, on=Task.periodic_task_id == PeriodicTask.id).where(
        burst() & (PeriodicTask.last_task_id == Task.id) & (
            (Task.scheduled_on != missed) | (PeriodicTask.submitted_count != 2)
            | (PeriodicTask.nextrun < grid) | (PeriodicTask.nextrun > grid + HOUR)))
    assert wrong.count() == 0
    print("catch-up once: %d killed mid-pass" % hit)
    queue.close()
