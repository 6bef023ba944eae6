"""The periodic scheduler (DESIGN rule 9 and the periodic-tasks issue): timers without drift,
one task per due time however many schedulers run, skip-not-stack, catch-up after downtime,
stale marks, outcomes, min_spacing, the config sync, the CLI, and real scheduler processes.

In-process tests inject `now` (run_pending(now=...), add_periodic(..., now=...)) instead of
sleeping; T0 is a fixed instant on a whole minute, so interval and calendar timers share a
grid. The process tests run real `taskrunner` processes and check what they did both in the
database and in the schedulers' own log lines.
"""
import json
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime, timedelta

import psutil
import pytest

from conftest import ok, runs_of, taskrunner, usage_error, wait_for
from taskrunner import Config, InputError
from taskrunner.fleet.liveness import default_host_id as hostname
from taskrunner.store.models import (CANCELLED, ERROR, SCHEDULED, SUCCESS, PeriodicTask, Runner,
                                     Task, utcnow)
from taskrunner.periodic.scheduler import (BUILTIN_ROTATION, PeriodicScheduler, add_periodic,
                                           parse_timer, set_enabled, sync_definitions)

ECHO = "taskrunner.handlers.Echo"
T0 = datetime(2024, 1, 1, 12, 0, 0)
START_TIMEOUT = 90.0
EXIT_TIMEOUT = 60.0


def at(seconds):
    return T0 + timedelta(seconds=seconds)


def row(name):
    return PeriodicTask.get(PeriodicTask.name == name)


def tasks_of(name):
    return list(Task.select().where(Task.periodic_task_id == row(name).id).order_by(Task.id))


def unfinished(name):
    return [t for t in tasks_of(name) if t.finished_on is None and t.last_status != CANCELLED]


def snapshot():
    """Every periodic task row, every field: what "nothing stored / nothing changed" compares."""
    return [sorted(r.__data__.items()) for r in PeriodicTask.select().order_by(PeriodicTask.id)]


def config_with(database, periodic_entries, **sections):
    data = {"database": {"url": database.url}, "periodic": periodic_entries}
    data.update(sections)
    return Config.from_dict(data)


def on_grid(value, anchor, interval, tolerance=0.002):
    steps = (value - anchor).total_seconds() / interval
    return abs(steps - round(steps)) * interval <= tolerance


# == 1. in-process logic, on SQLite, PostgreSQL and MariaDB ================================

@pytest.mark.timeout(30)
def test_interval_timer_arithmetic_is_anchored():
    timer = parse_timer("every 1h 30min")
    assert timer.seconds == 5400
    anchor = T0
    # Strictly after the base, on anchor + k * interval, however late the base is.
    for late in (0, 0.000001, 1, 5399, 5399.999999):
        for k in (0, 1, 7, 1000):
            base = anchor + timedelta(seconds=k * 5400 + late)
            expected = anchor + timedelta(seconds=(k + 1) * 5400)
            assert timer.next_after(base, anchor=anchor) == expected, (k, late)
    assert timer.next_after(anchor - timedelta(seconds=10), anchor=anchor) == anchor
    assert parse_timer("every 30s").seconds == 30
    assert parse_timer("every 5min").seconds == 300
    for bad in ("every", "every 0s", "every 0.5s", "every 5 parsecs", "every -1s", "",
                "Mon..Funday 07:30", "*-*-32 00:00", "nonsense"):
        with pytest.raises(InputError, match="invalid timer"):
            parse_timer(bad)


@pytest.mark.timeout(120)
def test_interval_due_times_stay_on_the_anchor_grid_when_passes_are_late(queue):
    created = add_periodic(queue.store, "tick", ECHO, "every 30s", data={"n": 1}, now=T0)
    assert created.nextrun == at(30)
    scheduler = PeriodicScheduler(queue.store)

    # Just before the due time: nothing.
    assert scheduler.run_pending(now=at(29.999)) == {"submitted": [], "skipped": []}
    # Passes late by varying amounts, always less than one interval: the due times stay
    # T0 + 30k (no drift towards the pass times).
    lateness = [0, 29.9, 0.001, 17, 29.999999, 3]
    for k, late in enumerate(lateness, start=1):
        due = at(30 * k)
        result = scheduler.run_pending(now=due + timedelta(seconds=late))
        assert len(result["submitted"]) == 1, (k, late, result)
        assert result["skipped"] == []
        task = Task.get_by_id(result["submitted"][0])
        assert task.scheduled_on == due, (k, late)
        assert task.periodic_task_id == created.id
        current = row("tick")
        assert current.nextrun == at(30 * (k + 1)), (k, late)
        assert current.last_due == due
        assert current.worker is None and current.marked is None
        assert queue.run_pending() == 1  # the task finishes before the next due time
    tasks = tasks_of("tick")
    assert [t.scheduled_on for t in tasks] == [at(30 * k) for k in range(1, len(lateness) + 1)]
    assert {t.last_status for t in tasks} == {SUCCESS}
    current = row("tick")
    assert current.submitted_count == len(lateness) and current.skipped_count == 0
    assert current.last_status == SUCCESS and current.last_task_id == tasks[-1].id


@pytest.mark.timeout(120)
def test_a_pass_submits_one_task_per_due_periodic_task_and_a_second_pass_nothing(queue):
    add_periodic(queue.store, "a", ECHO, "every 10s", data={"who": "a"}, now=T0, priority=3,
                 max_runtime="5min", max_retries=2)
    add_periodic(queue.store, "b", ECHO, "every 20s", data={"who": "b"}, now=T0, owner="bob",
                 submitter="cron-b")
    add_periodic(queue.store, "c", ECHO, "every 1h", now=T0)               # not due yet
    add_periodic(queue.store, "d", ECHO, "every 10s", now=T0, enabled=False)  # disabled
    scheduler = PeriodicScheduler(queue.store)
    assert scheduler.next_due() == at(10)

    result = scheduler.run_pending(now=at(20))
    assert result["skipped"] == []
    assert len(result["submitted"]) == 2
    by_name = {row(n).id: n for n in "abcd"}
    tasks = {by_name[t.periodic_task_id]: t for t in
             Task.select().where(Task.id.in_(result["submitted"]))}
    assert set(tasks) == {"a", "b"}
    # a was due at T0+10 (and T0+20: missed due times collapse into one task);
    # b exactly at T0+20.
    assert tasks["a"].scheduled_on == at(10) and tasks["b"].scheduled_on == at(20)
    assert json.loads(tasks["a"].data) == {"who": "a"}
    assert tasks["a"].priority == 3 and tasks["a"].max_runtime == 300.0
    assert tasks["a"].max_retries == 2
    assert tasks["a"].handler == ECHO
    assert tasks["a"].queued_by == "periodic:a" and tasks["b"].queued_by == "cron-b"
    # Submitted due tasks are runnable at once: each has its scheduled run.
    assert all(len(runs_of(t.id)) == 1 for t in tasks.values())
    assert row("a").nextrun == at(30) and row("b").nextrun == at(40)
    assert row("c").nextrun == at(3600) and row("c").submitted_count == 0
    assert row("d").submitted_count == 0
    assert scheduler.next_due() == at(30)

    before = snapshot()
    count = Task.select().count()
    assert scheduler.run_pending(now=at(20)) == {"submitted": [], "skipped": []}
    assert Task.select().count() == count
    assert snapshot() == before


@pytest.mark.timeout(120)
def test_a_pass_restricted_to_queues_leaves_every_other_periodic_task_due(queue):
    """`taskrunner verify`'s schedulers: the pass of its own periodic queue only."""
    add_periodic(queue.store, "mine", ECHO, "every 10s", now=T0, queue="verify")
    add_periodic(queue.store, "theirs", ECHO, "every 5s", now=T0, queue="emails")
    scheduler = PeriodicScheduler(queue.store)
    assert scheduler.next_due(queues=["verify"]) == at(10)
    assert scheduler.next_due(queues=["nothing"]) is None

    result = scheduler.run_pending(now=at(10), queues=["verify"])
    assert [t.queue for t in Task.select().where(Task.id.in_(result["submitted"]))] == ["verify"]
    assert tasks_of("theirs") == [] and row("theirs").nextrun == at(5)
    assert row("mine").nextrun == at(20)
    assert scheduler.next_due() == at(5)


@pytest.mark.timeout(120)
def test_a_due_time_is_skipped_not_stacked_while_the_previous_task_is_unfinished(queue):
    add_periodic(queue.store, "slow", ECHO, "every 10s", now=T0)
    scheduler = PeriodicScheduler(queue.store)
    first = scheduler.run_pending(now=at(10))["submitted"]
    assert len(first) == 1

    # The task of T0+10 has not run: T0+20 and T0+30 are skipped, and counted.
    for k, due in enumerate((20, 30), start=1):
        assert scheduler.run_pending(now=at(due + 1)) == {"submitted": [], "skipped": ["slow"]}
        current = row("slow")
        assert current.skipped_count == k and current.submitted_count == 1
        assert current.last_due == at(due) and current.nextrun == at(due + 10)
        assert [t.id for t in tasks_of("slow")] == first

    # A task waiting for a retry is unfinished too.
    assert queue.run_pending() == 1
    add_periodic(queue.store, "retrying", "sample_handlers.FailTimes", "every 10s",
                 data={"fail": 1}, max_retries=3, now=at(30))
    assert len(scheduler.run_pending(now=at(41))["submitted"]) == 2  # slow and retrying
    queue.run_pending()  # retrying: attempt 1 fails, its retry waits for the backoff
    waiting = tasks_of("retrying")[0]
    assert waiting.last_status == ERROR and waiting.finished_on is None
    result = scheduler.run_pending(now=at(50))
    assert result["skipped"] == ["retrying"] and len(result["submitted"]) == 1  # slow: finished

    # A cancelled task does not block the next due time.
    queue.cancel(waiting.id)
    result = scheduler.run_pending(now=at(60))
    assert "retrying" not in result["skipped"]
    assert [t.scheduled_on for t in tasks_of("retrying")] == [at(40), at(60)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timer", ["every 1min", "minutely"])
def test_catch_up_once_after_downtime_submits_one_task_on_the_original_grid(queue, timer):
    add_periodic(queue.store, "catchup", ECHO, timer, now=T0)
    assert row("catchup").nextrun == at(60)
    scheduler = PeriodicScheduler(queue.store)
    # No scheduler ran for ten intervals and a bit.
    now = at(60 + 600 + 25)
    result = scheduler.run_pending(now=now)
    assert len(result["submitted"]) == 1 and result["skipped"] == []
    [task] = tasks_of("catchup")
    assert task.scheduled_on == at(60)  # the first missed due time stands for all of them
    current = row("catchup")
    assert current.nextrun == at(720)  # the next due time after now, on the original grid
    assert current.submitted_count == 1 and current.skipped_count == 0
    assert scheduler.run_pending(now=now) == {"submitted": [], "skipped": []}
    assert queue.run_pending() == 1
    assert scheduler.run_pending(now=at(720.5))["submitted"] != []
    assert [t.scheduled_on for t in tasks_of("catchup")] == [at(60), at(720)]


@pytest.mark.timeout(120)
def test_catch_up_skip_after_downtime_submits_nothing(queue):
    add_periodic(queue.store, "skipper", ECHO, "every 10s", now=T0, catch_up="skip")
    scheduler = PeriodicScheduler(queue.store)
    result = scheduler.run_pending(now=at(10 + 100 + 3))
    assert result == {"submitted": [], "skipped": ["skipper"]}
    assert tasks_of("skipper") == []
    current = row("skipper")
    assert current.nextrun == at(120) and current.skipped_count == 1
    assert current.submitted_count == 0
    # A due time that is merely a little late is not a missed one.
    result = scheduler.run_pending(now=at(121))
    assert len(result["submitted"]) == 1
    assert [t.scheduled_on for t in tasks_of("skipper")] == [at(120)]


@pytest.mark.timeout(120)
def test_a_disabled_periodic_task_submits_nothing_and_is_re_anchored_when_enabled(queue):
    add_periodic(queue.store, "off", ECHO, "every 10s", now=T0, enabled=False)
    add_periodic(queue.store, "on", ECHO, "every 10s", now=T0)
    scheduler = PeriodicScheduler(queue.store)
    set_enabled(queue.store, "on", False, now=at(5))
    assert scheduler.next_due() is None
    assert scheduler.run_pending(now=at(1000)) == {"submitted": [], "skipped": []}
    assert Task.select().count() == 0
    assert row("off").skipped_count == 0 and row("on").skipped_count == 0

    # Enabling starts a fresh schedule from then: no catch-up for the disabled time.
    set_enabled(queue.store, "off", True, now=at(1003))
    assert row("off").nextrun == at(1013)
    assert scheduler.run_pending(now=at(1012)) == {"submitted": [], "skipped": []}
    assert len(scheduler.run_pending(now=at(1013))["submitted"]) == 1
    assert [t.scheduled_on for t in tasks_of("off")] == [at(1013)]
    assert tasks_of("on") == []


@pytest.mark.timeout(120)
def test_stale_marks_are_cleared_and_fresh_marks_of_live_schedulers_kept(queue):
    host = hostname()
    scheduler = PeriodicScheduler(queue.store)
    dead_pid = 999999
    while psutil.pid_exists(dead_pid):
        dead_pid -= 1
    my_create_time = psutil.Process(os.getpid()).create_time()
    # A mark as a scheduler of an earlier version left it (host:pid:create_time).
    me = "%s:%d:%.3f" % (host, os.getpid(), my_create_time)
    now = at(100)
    marks = {
        "dead-pid": ("%s:%d:1.0" % (host, dead_pid), now),
        "reused-pid": ("%s:%d:%.3f" % (host, os.getpid(), my_create_time - 1000), now),
        "old-mark": ("elsewhere:4242:1.0", now - timedelta(minutes=2)),
        "old-mark-of-live-process": (me, now - timedelta(minutes=2)),
        "live-here": (me, now - timedelta(seconds=1)),
        "fresh-elsewhere": ("elsewhere:4242:1.0", now - timedelta(seconds=30)),
        "unmarked": (None, None),
    }
    for name, (worker, marked) in marks.items():
        add_periodic(queue.store, name, ECHO, "every 10s", now=T0)
        PeriodicTask.update(worker=worker, marked=marked).where(
            PeriodicTask.name == name).execute()
    stale = {"dead-pid", "reused-pid", "old-mark", "old-mark-of-live-process"}
    kept = {"live-here", "fresh-elsewhere"}

    assert scheduler.clear_stale_marks(now=now) == len(stale)
    for name in stale | {"unmarked"}:
        assert row(name).worker is None and row(name).marked is None, name
    for name in kept:
        assert (row(name).worker, row(name).marked) == marks[name], name

    # A row marked by someone else is not submitted in a pass (nor advanced).
    result = PeriodicScheduler(queue.store).run_pending(now=now)
    assert result["skipped"] == []
    done = {t.periodic_task_id for t in Task.select().where(Task.id.in_(result["submitted"]))}
    assert done == {row(n).id for n in stale | {"unmarked"}}
    for name in kept:
        assert row(name).nextrun == at(10) and tasks_of(name) == [], name
        assert row(name).submitted_count == 0


@pytest.mark.timeout(120)
def test_last_status_and_consecutive_failures_follow_the_runs(database):
    queue = database.queue(task={"retry_backoff": 0})
    add_periodic(queue.store, "boom", "sample_handlers.Boom", "every 10s", now=T0, max_retries=1)
    add_periodic(queue.store, "flaky", "sample_handlers.FailTimes", "every 10s", data={"fail": 1},
                 now=T0, max_retries=3)
    scheduler = PeriodicScheduler(queue.store)
    assert row("boom").last_status is None and row("boom").consecutive_failures == 0

    for k in (1, 2, 3):
        scheduler.run_pending(now=at(10 * k))
        queue.run_pending()  # boom fails and is given up; flaky's first attempt fails
        boom = row("boom")
        assert boom.last_status == ERROR and boom.consecutive_failures == k
        assert boom.last_run is not None
        flaky = row("flaky")
        assert flaky.last_status == ERROR and flaky.consecutive_failures == 1
        queue.run_pending()  # flaky's retry succeeds
        flaky = row("flaky")
        assert flaky.last_status == SUCCESS and flaky.consecutive_failures == 0, k
    assert [t.last_status for t in tasks_of("boom")] == [ERROR] * 3
    assert [t.last_status for t in tasks_of("flaky")] == [SUCCESS] * 3
    queue.close()


@pytest.mark.timeout(120)
def test_a_cancelled_task_of_a_periodic_task_reaches_its_outcome(database):
    """A cancel ends its task through the run lifecycle like every other end, so the
    periodic task reads it: a scheduled run cancelled, and a task cancelled while it waits
    for its retry (no run at all) — last status ``cancelled``, failures not counted."""
    queue = database.queue(task={"retry_backoff": 3600})
    add_periodic(queue.store, "tick", ECHO, "every 10s", now=T0)
    add_periodic(queue.store, "flaky", "sample_handlers.FailTimes", "every 10s",
                 data={"fail": 1}, max_retries=3, now=T0)
    scheduler = PeriodicScheduler(queue.store)
    scheduler.run_pending(now=at(10))
    [tick] = tasks_of("tick")
    assert [r.status for r in runs_of(tick.id)] == [SCHEDULED]
    assert queue.run_pending(max_runs=2) == 2        # tick succeeds, flaky's attempt 1 fails
    assert (row("tick").last_status, row("flaky").last_status) == (SUCCESS, ERROR)

    scheduler.run_pending(now=at(20))                # flaky's task is unfinished: skipped
    [_, tick] = tasks_of("tick")
    assert queue.cancel(tick.id) is None
    assert [r.status for r in runs_of(tick.id)] == [CANCELLED]
    assert row("tick").last_status == CANCELLED and row("tick").consecutive_failures == 0

    [flaky] = tasks_of("flaky")
    assert flaky.last_status == ERROR and flaky.finished_on is None     # waits for its retry
    assert queue.cancel(flaky.id) is None
    assert row("flaky").last_status == CANCELLED and row("flaky").consecutive_failures == 1
    queue.close()


@pytest.mark.timeout(120)
def test_min_spacing_drops_a_task_started_too_soon_after_the_previous_one(queue):
    add_periodic(queue.store, "spaced", ECHO, "every 10s", data={"x": 1}, now=T0, min_spacing="1h")
    add_periodic(queue.store, "free", ECHO, "every 10s", now=T0)
    scheduler = PeriodicScheduler(queue.store)

    scheduler.run_pending(now=at(10))
    assert queue.run_pending() == 2
    first_start = row("spaced").last_run
    assert first_start is not None
    scheduler.run_pending(now=at(20))
    assert queue.run_pending() == 2

    first, second = tasks_of("spaced")
    assert first.last_status == SUCCESS
    assert second.last_status == CANCELLED and second.finished_on is not None
    [dropped] = runs_of(second.id)
    assert dropped.status == CANCELLED and dropped.error_code == "MinSpacing"
    assert dropped.results is None  # the handler did not run
    spaced = row("spaced")
    assert spaced.last_run == first_start  # a dropped task does not count as a start
    assert spaced.last_status == CANCELLED and spaced.consecutive_failures == 0
    assert [t.last_status for t in tasks_of("free")] == [SUCCESS, SUCCESS]

    # Once the previous start is min_spacing ago, the next task runs.
    PeriodicTask.update(last_run=utcnow() - timedelta(hours=1, seconds=1)).where(
        PeriodicTask.name == "spaced").execute()
    scheduler.run_pending(now=at(30))
    queue.run_pending()
    assert tasks_of("spaced")[-1].last_status == SUCCESS
    assert row("spaced").last_status == SUCCESS


@pytest.mark.timeout(120)
def test_min_spacing_does_not_drop_a_retry_of_the_same_task(database):
    queue = database.queue(task={"retry_backoff": 0})
    add_periodic(queue.store, "spaced-flaky", "sample_handlers.FailTimes", "every 1h",
                 data={"fail": 1}, max_retries=3, min_spacing="1h", now=T0)
    PeriodicScheduler(queue.store).run_pending(now=at(3600))
    queue.run_pending()  # attempt 1 fails
    queue.run_pending()  # attempt 2: a retry of the same task, not "the next one"
    [task] = tasks_of("spaced-flaky")
    assert [r.status for r in runs_of(task.id)] == [ERROR, SUCCESS]
    assert task.last_status == SUCCESS
    queue.close()


# -- config sync --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_config_sync_adds_updates_disables_and_leaves_api_rows_alone(queue, database):
    add_periodic(queue.store, "api-row", ECHO, "every 1h", data={"api": True}, now=T0)
    add_periodic(queue.store, "shadowed", ECHO, "every 1h", now=T0)  # a config entry of this name
    api_before = [r for r in snapshot() if dict(r)["name"] in ("api-row", "shadowed")]

    version1 = [
        {"name": "cfg-a", "handler": ECHO, "timer": "every 10s", "data": {"v": 1}},
        {"name": "cfg-b", "handler": ECHO, "timer": "every 1min", "owner": "ops"},
        {"name": "shadowed", "handler": "sample_handlers.Boom", "timer": "every 1s"},
    ]
    sync_definitions(queue.store, config_with(database, version1), now=T0)
    a, b = row("cfg-a"), row("cfg-b")
    assert (a.source, a.timer, a.nextrun, json.loads(a.data)) == ("config", "every 10s", at(10),
                                                                   {"v": 1})
    assert (b.source, b.nextrun, b.owner, b.enabled) == ("config", at(60), "ops", True)
    rotate = row(BUILTIN_ROTATION)
    assert rotate.enabled and rotate.timer == "hourly" and rotate.source == "config"
    assert rotate.handler == "taskrunner.handlers.Rotate"
    assert rotate.nextrun == at(3600)

    # Unchanged entries are not touched by a re-sync (nextrun keeps its anchor).
    before = snapshot()
    sync_definitions(queue.store, config_with(database, version1), now=at(7))
    assert snapshot() == before

    version2 = [
        {"name": "cfg-a", "handler": ECHO, "timer": "every 20s", "data": {"v": 2},
         "priority": 5},
        {"name": "cfg-c", "handler": ECHO, "timer": "every 1h", "catch_up": "skip",
         "max_runtime": "10min", "min_spacing": 30},
    ]
    sync_definitions(queue.store, config_with(database, version2, rotation={"timer": "daily"}),
                     now=at(5))
    a = row("cfg-a")
    assert (a.timer, a.priority, json.loads(a.data)) == ("every 20s", 5, {"v": 2})
    assert a.nextrun == at(25), "a timer change moves nextrun"
    assert a.enabled
    assert not row("cfg-b").enabled, "removed from the file: disabled"
    c = row("cfg-c")
    assert (c.catch_up, c.max_runtime, c.min_spacing, c.nextrun) == ("skip", 600.0, 30.0,
                                                                      at(3605))
    assert row(BUILTIN_ROTATION).timer == "daily"
    assert [r for r in snapshot() if dict(r)["name"] in ("api-row", "shadowed")] == api_before

    # Back in the file: enabled again, with a fresh schedule.
    sync_definitions(queue.store, config_with(database, version1), now=at(100))
    b = row("cfg-b")
    assert b.enabled and b.nextrun == at(160)
    assert [r for r in snapshot() if dict(r)["name"] in ("api-row", "shadowed")] == api_before


@pytest.mark.timeout(120)
def test_builtin_rotation_disabled_by_the_operator_stays_disabled_after_a_resync(queue,
                                                                                database):
    sync_definitions(queue.store, config_with(database, []), now=T0)
    assert row(BUILTIN_ROTATION).enabled
    set_enabled(queue.store, BUILTIN_ROTATION, False, now=at(1))
    sync_definitions(queue.store, config_with(database, []), now=at(2))
    assert not row(BUILTIN_ROTATION).enabled
    sync_definitions(queue.store, config_with(database, [], rotation={"timer": "daily"}), now=at(3))
    assert not row(BUILTIN_ROTATION).enabled and row(BUILTIN_ROTATION).timer == "daily"
    set_enabled(queue.store, BUILTIN_ROTATION, True, now=at(4))
    sync_definitions(queue.store, config_with(database, []), now=at(5))
    assert row(BUILTIN_ROTATION).enabled


BAD_DEFINITIONS = [
    ("bad-timer", {"timer": "every 5 fortnights"}, "invalid timer"),
    ("bad-calendar", {"timer": "Mon..Funday 07:30"}, "invalid timer"),
    ("unknown-handler", {"handler": "sample_handlers.NoSuchHandler"}, "NoSuchHandler"),
    ("not-importable", {"handler": "no_such_module_xyz.Handler"}, "cannot be imported"),
    ("not-a-handler", {"handler": "sample_handlers.NotAHandler"}, "not a TaskHandler"),
    ("bad-catch-up", {"catch_up": "twice"}, "catch_up"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("override,fragment", [c[1:] for c in BAD_DEFINITIONS],
                         ids=[c[0] for c in BAD_DEFINITIONS])
def test_a_bad_definition_raises_input_error_and_stores_nothing(queue, database, override,
                                                               fragment):
    add_periodic(queue.store, "existing", ECHO, "every 1h", now=T0)
    before = snapshot()
    spec = dict({"handler": ECHO, "timer": "every 1min"}, **override)
    with pytest.raises(InputError, match=re.escape(fragment)):
        add_periodic(queue.store, "new", now=T0, **spec)
    assert snapshot() == before
    # In the config, one bad entry changes nothing, not even the good ones before it.
    entries = [{"name": "good", "handler": ECHO, "timer": "every 1min"},
               dict({"name": "new"}, **spec)]
    with pytest.raises(InputError, match=re.escape(fragment)):
        sync_definitions(queue.store, config_with(database, entries), now=T0)
    assert snapshot() == before


@pytest.mark.timeout(120)
def test_duplicate_names_raise_input_error_and_store_nothing(queue, database):
    add_periodic(queue.store, "dup", ECHO, "every 1h", now=T0)
    before = snapshot()
    with pytest.raises(InputError, match="already exists"):
        add_periodic(queue.store, "dup", ECHO, "every 1min", now=T0)
    with pytest.raises(InputError, match="already exists"):
        add_periodic(queue.store, "  dup  ", ECHO, "every 1min", now=T0)
    assert snapshot() == before
    entries = [{"name": "twice", "handler": ECHO, "timer": "every 1min"},
               {"name": "twice", "handler": ECHO, "timer": "every 1h"}]
    with pytest.raises(InputError, match="duplicate name"):
        sync_definitions(queue.store, config_with(database, entries), now=T0)
    entries = [{"name": BUILTIN_ROTATION, "handler": ECHO, "timer": "every 1min"}]
    with pytest.raises(InputError, match="reserved"):
        sync_definitions(queue.store, config_with(database, entries), now=T0)
    assert snapshot() == before
    # The queue is still usable after the refused insert (no aborted transaction left).
    add_periodic(queue.store, "after", ECHO, "every 1h", now=T0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", [{"max_runtime": 0}, {"max_retries": 0}],
                         ids=["max_runtime-0", "max_retries-0"])
def test_an_option_add_task_would_refuse_is_refused_at_definition(queue, option):
    before = snapshot()
    with pytest.raises(InputError):
        add_periodic(queue.store, "never", ECHO, "every 10s", now=T0, **option)
    assert snapshot() == before


@pytest.mark.timeout(120)
def test_concurrent_config_syncs_create_each_row_once(database, monkeypatch):
    if database.backend == "sqlite":
        pytest.skip("SQLite serialises the sync with BEGIN IMMEDIATE")
    queue = database.queue()
    config = config_with(database, [])
    # Both syncs have read "no such row"; then one inserts and commits before the other
    # inserts: what two overseers starting (or HUP'd) at the same moment can do.
    arrived = threading.Barrier(2, timeout=10)
    first_done = threading.Event()
    lock = threading.Lock()
    order = []
    original = PeriodicTask.create.__func__

    def create(cls, **values):
        with lock:
            order.append(threading.get_ident())
            position = len(order)
        if position <= 2:
            try:
                arrived.wait()
            except threading.BrokenBarrierError:
                pass  # a sync that lets only one of them insert: go on
            if position == 2:
                first_done.wait(timeout=10)
        return original(cls, **values)
    monkeypatch.setattr(PeriodicTask, "create", classmethod(create))
    errors = []

    def sync():
        try:
            sync_definitions(queue.store, config)
        except Exception as exc:  # the assertion below shows what it was
            errors.append(exc)
        finally:
            queue.close()
            if order and order[0] == threading.get_ident():
                first_done.set()
    threads = [threading.Thread(target=sync) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert PeriodicTask.select().where(PeriodicTask.name == BUILTIN_ROTATION).count() == 1


# == 2. the CLI ===========================================================================

def fresh_schema(db):
    """Create the schema first, so a command's stderr holds nothing but its own lines."""
    return db.queue()


def due_now(queue, name, handler=ECHO, timer="every 1h", **options):
    """A periodic task whose first due time has just passed (and the next is an hour away)."""
    return add_periodic(queue.store, name, handler, timer,
                        now=utcnow() - timedelta(hours=1, seconds=1), **options)


REFUSED_PERIODIC_ADDS = [
    ("bad-timer", ["job", ECHO, "every 5 fortnights"], "invalid timer"),
    ("zero-interval", ["job", ECHO, "every 0s"], "at least 1s"),
    ("unknown-handler", ["job", "sample_handlers.NoSuchHandler", "every 1min"], "NoSuchHandler"),
    ("duplicate", ["existing", ECHO, "every 1min"], "already exists"),
    ("bad-catch-up", ["job", ECHO, "every 1min", "--catch-up", "twice"], "catch-up"),
    ("bad-span", ["job", ECHO, "every 1min", "--min-spacing", "5 parsecs"], "min_spacing"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,fragment", [c[1:] for c in REFUSED_PERIODIC_ADDS],
                         ids=[c[0] for c in REFUSED_PERIODIC_ADDS])
def test_cli_periodic_add_refusals_exit_2_with_one_line_and_store_nothing(sqlite_db, args,
                                                                          fragment):
    queue = fresh_schema(sqlite_db)
    add_periodic(queue.store, "existing", ECHO, "every 1h")
    before = snapshot()
    usage_error(taskrunner("periodic", "add", *args, url=sqlite_db.url), fragment)
    assert snapshot() == before
    queue.close()


PERIODIC_FIELDS = {"name", "enabled", "handler", "data", "timer", "nextrun", "last_due",
                   "last_run", "last_task_id", "last_status", "consecutive_failures",
                   "submitted", "skipped", "priority", "catch_up", "max_runtime", "min_spacing",
                   "owner", "source", "worker", "marked"}


@pytest.mark.timeout(180)
def test_cli_periodic_add_and_list_show_the_schedule_and_the_outcomes(sqlite_db):
    queue = fresh_schema(sqlite_db)
    url = sqlite_db.url
    out = ok(taskrunner("periodic", "add", "nightly", ECHO, "*-*-* 03:00 UTC", "--data", '{"k": 1}',
                        "--priority", "2", "--catch-up", "skip", "--max-runtime", "10min",
                        "--min-spacing", "1h", "--max-retries", "2", "--owner", "alice",
                        url=url))
    assert "nightly" in out and "03:00:00+00:00" in out
    ok(taskrunner("periodic", "add", "tick", ECHO, "every 30s", "--disabled", url=url))
    due_now(queue, "failing", "sample_handlers.Boom", max_retries=1)
    ok(taskrunner("run-event", "periodic-task:OnProcess", url=url))
    # A failing handler's traceback is logged (WARNING): no ok(), which forbids one.
    burst = taskrunner("runner", "--burst", url=url)
    assert burst.returncode == 0, burst.stderr

    rows = json.loads(ok(taskrunner("periodic", "list", "--json", url=url)))
    assert [r["name"] for r in rows] == ["failing", "nightly", "taskrunner.rotate", "tick"]
    for r in rows:
        assert set(r) >= PERIODIC_FIELDS, sorted(PERIODIC_FIELDS - set(r))
    by_name = {r["name"]: r for r in rows}
    nightly = by_name["nightly"]
    assert (nightly["timer"], nightly["enabled"], nightly["data"], nightly["priority"],
            nightly["catch_up"], nightly["max_runtime"], nightly["min_spacing"],
            nightly["owner"], nightly["source"]) == ("*-*-* 03:00 UTC", True, {"k": 1}, 2, "skip",
                                                     600.0, 3600.0, "alice", "api")
    next_run = datetime.fromisoformat(nightly["nextrun"])
    assert next_run.tzinfo is not None and (next_run.hour, next_run.minute) == (3, 0)
    assert (nightly["last_run"], nightly["last_status"], nightly["consecutive_failures"]) == (
        None, None, 0)
    assert by_name["tick"]["enabled"] is False
    failing = by_name["failing"]
    assert failing["last_status"] == ERROR and failing["consecutive_failures"] == 1
    assert failing["last_run"] is not None and failing["submitted"] == 1
    assert datetime.fromisoformat(failing["nextrun"]) > datetime.fromisoformat(
        failing["last_run"])
    assert Task.get_by_id(failing["last_task_id"]).last_status == ERROR

    table = ok(taskrunner("periodic", "list", "--wide", url=url)).splitlines()
    for header in ("NAME", "TIMER", "NEXT RUN", "LAST RUN", "LAST STATUS", "FAILURES"):
        assert header in table[0]
    [line] = [l for l in table if l.startswith("failing ")]
    # Tables show compact local times; --json keeps ISO 8601 UTC.
    from taskrunner.cli.runs import when
    assert "every 1h" in line and " error " in line and when(failing["last_run"]) in line
    assert when(failing["nextrun"]) in line
    assert json.loads(ok(taskrunner("periodic", "list", "--owner", "alice", "--json",
                                    url=url)))[0]["name"] == "nightly"
    queue.close()


@pytest.mark.timeout(180)
def test_cli_enable_disable_remove_and_owner_mismatch(sqlite_db):
    queue = fresh_schema(sqlite_db)
    url = sqlite_db.url
    ok(taskrunner("periodic", "add", "job", ECHO, "every 1h", "--owner", "alice", url=url))
    ok(taskrunner("periodic", "add", "other", ECHO, "every 1h", url=url))

    before = snapshot()
    usage_error(taskrunner("periodic", "disable", "job", "--owner", "bob", url=url),
                   "job", "bob")
    usage_error(taskrunner("periodic", "remove", "job", "--owner", "bob", url=url), "bob")
    usage_error(taskrunner("periodic", "enable", "nosuch", url=url), "nosuch")
    assert snapshot() == before

    ok(taskrunner("periodic", "disable", "job", "--owner", "alice", url=url))
    assert not row("job").enabled and row("other").enabled
    enabled_at = utcnow()
    ok(taskrunner("periodic", "enable", "job", url=url))
    job = row("job")
    assert job.enabled
    # Enabling starts a fresh schedule from now.
    assert enabled_at + timedelta(minutes=59) < job.nextrun
    assert job.nextrun < utcnow() + timedelta(hours=1, seconds=1)
    ok(taskrunner("periodic", "remove", "job", "--owner", "alice", url=url))
    assert PeriodicTask.get_or_none(PeriodicTask.name == "job") is None
    usage_error(taskrunner("periodic", "remove", "job", url=url), "no periodic task")
    assert row("other").enabled
    queue.close()


@pytest.mark.timeout(180)
def test_run_event_periodic_does_one_pass_and_an_operator_disabled_rotation_stays_off(
        sqlite_db, tmp_path):
    queue = fresh_schema(sqlite_db)
    config = sqlite_db.write_config(tmp_path / "c.toml")
    due = due_now(queue, "hourly-job", data={"n": 1}).nextrun
    add_periodic(queue.store, "later", ECHO, "every 1h")

    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config))
    [task] = tasks_of("hourly-job")
    assert task.scheduled_on == due and json.loads(task.data) == {"n": 1}
    assert row("hourly-job").nextrun == due + timedelta(hours=1)
    assert tasks_of("later") == []
    assert row(BUILTIN_ROTATION).enabled  # created by the sync, enabled by default

    ok(taskrunner("periodic", "disable", BUILTIN_ROTATION, config=config))
    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config))
    assert len(tasks_of("hourly-job")) == 1  # one pass per event; nothing else is due
    assert not row(BUILTIN_ROTATION).enabled
    config = sqlite_db.write_config(tmp_path / "c.toml", '[rotation]\ntimer = "daily"\n')
    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config))
    rotate = row(BUILTIN_ROTATION)
    assert not rotate.enabled and rotate.timer == "daily"
    queue.close()


BAD_CONFIGS = [
    ("bad-timer", '[[periodic]]\nname = "a"\nhandler = "%s"\ntimer = "every 5 fortnights"\n'
     % ECHO, "invalid timer"),
    ("unknown-handler", '[[periodic]]\nname = "a"\nhandler = "sample_handlers.Nope"\n'
     'timer = "every 1min"\n', "Nope"),
    ("duplicate", ('[[periodic]]\nname = "a"\nhandler = "%s"\ntimer = "every 1min"\n' % ECHO) * 2,
     "duplicate name"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("text,fragment", [c[1:] for c in BAD_CONFIGS],
                         ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_periodic_config_is_refused_by_run_event_and_overseer(sqlite_db, tmp_path, text,
                                                                    fragment):
    queue = fresh_schema(sqlite_db)
    add_periodic(queue.store, "existing", ECHO, "every 1h")
    before = snapshot()
    config = sqlite_db.write_config(tmp_path / "c.toml",
                                    '[[periodic]]\nname = "good"\nhandler = "%s"\n'
                                    'timer = "every 1h"\n%s' % (ECHO, text))
    usage_error(taskrunner("run-event", "periodic-task:OnProcess", config=config), fragment)
    usage_error(taskrunner("overseer", config=config, timeout=90), fragment)
    assert snapshot() == before
    assert Runner.select().count() == 0
    queue.close()


# == 3. real scheduler processes ==========================================================

DUE_LINE = re.compile(r"periodic task '([^']*)': (?:submitted task (\d+) for|due time) "
                      r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)( skipped)?")


def scheduler_events(texts):
    """{name: [(due, "submitted"|"skipped", task_id)]} from schedulers' log lines."""
    events = {}
    for text in texts:
        for match in DUE_LINE.finditer(text):
            name, task_id, due, skipped = match.groups()
            events.setdefault(name, []).append(
                (datetime.fromisoformat(due), "skipped" if skipped else "submitted",
                 int(task_id) if task_id else None))
    return events


def wait_overseer(proc, procs):
    def registered():
        if proc.poll() is not None:
            raise AssertionError("overseer %d exited %s\n%s"
                                 % (proc.pid, proc.returncode, procs.logs([proc])))
        return Runner.get_or_none((Runner.pid == proc.pid) & (Runner.kind == "overseer"))
    return wait_for(registered, timeout=START_TIMEOUT, message="overseer %d" % proc.pid)


def process_config(database, tmp_path, extra="", name="c.toml"):
    return database.write_config(
        tmp_path / name,
        "[runner]\nlimit = 3\npoll_interval = 0.1\n[overseer]\ncheck_interval = 0.5\n"
        "graceful_timeout = 15\n%s" % extra)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_overseers_submit_each_due_time_at_most_once(database_sp, procs, tmp_path):
    queue = database_sp.queue()
    sync_definitions(queue.store)  # the built-in row exists before the overseers race to sync
    names = ["p%02d" % i for i in range(20)]
    for name in names:
        add_periodic(queue.store, name, ECHO, "every 1s", data={"name": name})
    # Runs longer than its interval: its due times must be skipped, never stacked.
    spans = str(tmp_path / "spans")
    add_periodic(queue.store, "slow", "sample_handlers.Span", "every 1s",
                 data={"log": spans, "sleep": 2.5})
    names.append("slow")
    config = process_config(database_sp, tmp_path)

    overseers = [procs.spawn("overseer", config=config, name="overseer") for _ in range(3)]
    for proc in overseers:
        wait_overseer(proc, procs)
    deadline = time.monotonic() + 10     # ten due times of every periodic task, raced by three
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in overseers), procs.logs()
        time.sleep(0.5)
    for proc in overseers:
        proc.send_signal(signal.SIGTERM)
    for proc in overseers:
        assert procs.wait(proc) == 0, procs.logs([proc])
    window_end = utcnow()

    events = scheduler_events(procs.log(p) for p in overseers)
    assert Runner.select().where((Runner.kind == "runner")).count() >= 1
    for name in names:
        current = row(name)
        tasks = tasks_of(name)
        dues = [t.scheduled_on for t in tasks]
        # Rule 9: a due time yields at most one task...
        assert len(set(dues)) == len(dues), (name, sorted(dues))
        # ...on the timer's grid, anchored at its creation.
        off_grid = [d for d in dues if not on_grid(d, current.created, 1.0)]
        assert off_grid == [], (name, current.created, off_grid)
        assert current.submitted_count == len(tasks), name
        # Every due time was handled once, by one scheduler, across all three logs.
        handled = events.get(name, [])
        handled_dues = [due for due, _, _ in handled]
        assert len(set(handled_dues)) == len(handled_dues), (name, sorted(handled_dues))
        submitted = sorted((due, task_id) for due, kind, task_id in handled if kind == "submitted")
        assert submitted == sorted((t.scheduled_on, t.id) for t in tasks), name
        assert len(handled) - len(submitted) == current.skipped_count, name
        assert current.submitted_count + current.skipped_count == len(handled), name
        assert all(on_grid(d, current.created, 1.0) for d in handled_dues), name
        assert current.last_due == max(handled_dues), name
        # Fewer handled due times than grid points is catch-up (several collapse into one),
        # never more; and the schedulers kept up at least now and then.
        grid_points = (window_end - current.created).total_seconds()
        assert len(handled) <= grid_points + 1, (name, len(handled), grid_points)
        assert len(handled) >= 3, (name, handled)
        # Only the last task can be unfinished: the others ended before the next came.
        assert all(t.finished_on is not None for t in tasks[:-1]), name
    # Skip, not stack: the slow task's runs never overlap. The span file's line order is
    # the true order (O_APPEND); the database's timestamps are taken before lock waits.
    with open(spans) as fh:
        lines = [line.split()[:2] for line in fh if line.strip()]
    assert len(lines) >= 4, lines
    for i in range(0, len(lines) - 1, 2):
        assert lines[i][0] == "start" and lines[i + 1] == ["end", lines[i][1]], lines
    assert [int(task) for kind, task in lines if kind == "start"] == sorted(
        int(task) for kind, task in lines if kind == "start")
    assert row("slow").skipped_count >= 1
    assert Task.select().where(Task.last_status == SUCCESS).count() >= 20
    assert PeriodicTask.select().where(PeriodicTask.worker.is_null(False)).count() == 0

    # With no runner executing tasks: each periodic task gets at most one unfinished task,
    # and later due times are skipped, not stacked.
    config_plain = database_sp.write_config(tmp_path / "plain.toml")
    wait_for(lambda: utcnow() > max(row(n).nextrun for n in names), timeout=30,
             message="every periodic task to be due")
    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config_plain, timeout=120))
    after_first = {n: (len(tasks_of(n)), row(n).skipped_count) for n in names}
    for name in names:
        assert len(unfinished(name)) == 1, name
    wait_for(lambda: utcnow() > max(row(n).nextrun for n in names), timeout=30,
             message="the next due times")
    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config_plain, timeout=120))
    for name in names:
        assert len(tasks_of(name)) == after_first[name][0], name
        assert row(name).skipped_count == after_first[name][1] + 1, name
        assert len(unfinished(name)) == 1, name
    queue.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_after_downtime_catch_up_once_submits_one_task_and_skip_none(sqlite_db, procs,
                                                                     tmp_path):
    queue = sqlite_db.queue()
    add_periodic(queue.store, "once", ECHO, "every 1s")
    add_periodic(queue.store, "skip", ECHO, "every 1s", catch_up="skip")
    config = process_config(sqlite_db, tmp_path, "[log]\nlevel = \"info\"\n")
    overseer = procs.spawn("overseer", config=config, name="overseer")
    wait_for(lambda: all(row(n).submitted_count >= 2 for n in ("once", "skip")),
             timeout=START_TIMEOUT, message="both periodic tasks to submit tasks")
    overseer.send_signal(signal.SIGTERM)
    assert procs.wait(overseer) == 0, procs.logs()
    ok(taskrunner("runner", "--burst", config=config, timeout=120))  # drain; not a scheduler
    assert Task.select().where(Task.finished_on.is_null()).count() == 0
    before = {n: (row(n), [t.id for t in tasks_of(n)]) for n in ("once", "skip")}

    # All schedulers stopped; six due times pass, the first more than MISFIRE_GRACE ago.
    downtime_end = max(r.nextrun for r, _ in before.values()) + \
        PeriodicScheduler.MISFIRE_GRACE + timedelta(seconds=1.5)
    wait_for(lambda: utcnow() >= downtime_end, timeout=30, interval=0.2, message="downtime")
    pass_start = utcnow()
    ok(taskrunner("run-event", "periodic-task:OnProcess", config=config, timeout=120))
    pass_end = utcnow()

    old, old_ids = before["once"]
    new = [t for t in tasks_of("once") if t.id not in old_ids]
    assert len(new) == 1, [t.scheduled_on for t in new]
    assert new[0].scheduled_on == old.nextrun  # the first missed due time
    once = row("once")
    assert once.submitted_count == old.submitted_count + 1
    assert on_grid(once.nextrun, old.created, 1.0)
    assert pass_start < once.nextrun <= pass_end + timedelta(seconds=1)

    old, old_ids = before["skip"]
    assert [t.id for t in tasks_of("skip")] == old_ids, "catch_up = skip submitted a task"
    skip = row("skip")
    assert skip.skipped_count == old.skipped_count + 1
    assert skip.submitted_count == old.submitted_count
    assert on_grid(skip.nextrun, old.created, 1.0)
    assert pass_start < skip.nextrun <= pass_end + timedelta(seconds=1)
    queue.close()


@pytest.mark.timeout(180)
def test_the_mark_of_a_killed_scheduler_is_cleared_by_the_next_scheduler(sqlite_db, tmp_path):
    queue = sqlite_db.queue()
    due = due_now(queue, "orphaned").nextrun
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        worker = "%s:%d:%.3f" % (hostname(), sleeper.pid,
                                 psutil.Process(sleeper.pid).create_time())
        PeriodicTask.update(worker=worker, marked=utcnow()).where(
            PeriodicTask.name == "orphaned").execute()
        # While that process lives, its fresh mark is respected.
        scheduler = PeriodicScheduler(queue.store)
        assert scheduler.clear_stale_marks() == 0
        assert scheduler.run_pending()["submitted"] == []
        assert row("orphaned").worker == worker
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)

    ok(taskrunner("run-event", "periodic-task:OnProcess",
                  config=sqlite_db.write_config(tmp_path / "c.toml"), timeout=120))
    orphaned = row("orphaned")
    assert orphaned.worker is None and orphaned.marked is None
    [task] = tasks_of("orphaned")
    assert task.scheduled_on == due and orphaned.submitted_count == 1
    assert orphaned.nextrun == due + timedelta(hours=1)
    queue.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_overseer_syncs_the_config_at_start_and_on_hup(sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    add_periodic(queue.store, "api-row", ECHO, "every 1h")
    api_before = [r for r in snapshot() if dict(r)["name"] == "api-row"]
    entry = '[[periodic]]\nname = "%s"\nhandler = "%s"\ntimer = "%s"\n'
    path = tmp_path / "c.toml"
    base = ("[runner]\nlimit = 1\npoll_interval = 0.1\n[overseer]\ncheck_interval = 0.5\n"
            "graceful_timeout = 15\n")
    config = sqlite_db.write_config(path, base + entry % ("cfg-a", ECHO, "every 1h")
                                    + entry % ("cfg-tick", ECHO, "every 1s"))
    overseer = procs.spawn("overseer", config=config, name="overseer")
    wait_overseer(overseer, procs)
    # Synced by its maintainer as it starts.
    wait_for(lambda: PeriodicTask.get_or_none(PeriodicTask.name == "cfg-a") is not None,
             timeout=START_TIMEOUT, message="the sync at start")
    assert row("cfg-a").source == "config" and row("cfg-a").enabled
    # The overseer runs the scheduler and its runner executes the tasks.
    wait_for(lambda: len([t for t in tasks_of("cfg-tick") if t.last_status == SUCCESS]) >= 3,
             timeout=START_TIMEOUT, message="cfg-tick tasks to run")
    ok(taskrunner("periodic", "disable", BUILTIN_ROTATION, config=config))

    sqlite_db.write_config(path, base + '[rotation]\ntimer = "daily"\n'
                           + entry % ("cfg-tick", ECHO, "every 1s")
                           + entry % ("cfg-c", ECHO, "every 1h"))
    overseer.send_signal(signal.SIGHUP)
    wait_for(lambda: PeriodicTask.get_or_none(PeriodicTask.name == "cfg-c") is not None
             and not row("cfg-a").enabled and row(BUILTIN_ROTATION).timer == "daily",
             timeout=START_TIMEOUT, message="the reload")
    assert not row(BUILTIN_ROTATION).enabled
    assert row("cfg-tick").enabled
    assert [r for r in snapshot() if dict(r)["name"] == "api-row"] == api_before

    # A bad config on HUP: refused, nothing changed, the overseer keeps going.
    sqlite_db.write_config(path, base + entry % ("cfg-x", ECHO, "every 1h") * 2)
    before = [r for r in snapshot() if dict(r)["name"] != "cfg-tick"]
    overseer.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload failed" in procs.log(overseer), timeout=START_TIMEOUT,
             message="the refused reload")
    assert [r for r in snapshot() if dict(r)["name"] != "cfg-tick"] == before
    assert overseer.poll() is None
    count = len(tasks_of("cfg-tick"))
    wait_for(lambda: len(tasks_of("cfg-tick")) > count + 1, timeout=START_TIMEOUT,
             message="the scheduler to go on after the refused reload")

    overseer.send_signal(signal.SIGTERM)
    assert procs.wait(overseer) == 0, procs.logs()
    tick = row("cfg-tick")
    dues = [t.scheduled_on for t in tasks_of("cfg-tick")]
    assert len(set(dues)) == len(dues) == tick.submitted_count
    assert all(on_grid(d, tick.created, 1.0) for d in dues)
    queue.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_running_overseer_clears_a_stale_mark_without_spinning(sqlite_db, procs, tmp_path):
    queue = sqlite_db.queue()
    add_periodic(queue.store, "stuck", ECHO, "every 1h")
    config = process_config(sqlite_db, tmp_path)
    overseer = procs.spawn("overseer", config=config, name="overseer")
    wait_overseer(overseer, procs)
    # A scheduler on another host died holding this mark five minutes ago.
    PeriodicTask.update(worker="elsewhere:4242:1.0", marked=utcnow() - timedelta(minutes=5),
                        nextrun=utcnow() - timedelta(seconds=1)).where(
        PeriodicTask.name == "stuck").execute()
    process = psutil.Process(overseer.pid)
    cpu = sum(process.cpu_times()[:2])
    time.sleep(3)  # a measurement window, not a wait for a condition
    cpu = sum(process.cpu_times()[:2]) - cpu
    deadline = time.monotonic() + 10
    while row("stuck").submitted_count == 0 and time.monotonic() < deadline:
        assert overseer.poll() is None, procs.logs()
        time.sleep(0.2)
    stuck = row("stuck")
    assert (stuck.submitted_count, stuck.marked, cpu < 1.0) == (1, None, True), (
        "submitted %d, mark %s, the overseer used %.2fs of CPU in 3s"
        % (stuck.submitted_count, stuck.marked, cpu))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["taskrunner.rotate", "taskrunner.mine"])
def test_reserved_names_are_refused_from_the_api_and_the_cli(sqlite_db, name):
    queue = sqlite_db.queue()
    before = snapshot()
    with pytest.raises(InputError, match="reserved"):
        add_periodic(queue.store, name, ECHO, "every 1min", now=T0)
    result = taskrunner("periodic", "add", name, ECHO, "every 1min", url=sqlite_db.url)
    usage_error(result, "reserved")
    assert snapshot() == before


def test_a_refused_periodic_add_creates_no_database(tmp_path):
    path = tmp_path / "never.db"
    usage_error(taskrunner("periodic", "add", "taskrunner.x", ECHO, "daily",
                           url="sqlite:///%s" % path), "reserved")
    usage_error(taskrunner("periodic", "add", "n", ECHO, "every 5 fortnights",
                           url="sqlite:///%s" % path), "invalid timer")
    assert not path.exists()


def test_the_mark_of_a_holder_killed_on_another_host_is_cleared_once_its_row_has_ended(
        sqlite_db):
    """A lease holder killed between its mark and its submission: the next holder, on
    another host, clears the mark as soon as the dead holder's row is marked dead (by its
    heartbeat's age), not STALE_MARK later, so the periodic task goes on."""
    from taskrunner.fleet import liveness
    queue = sqlite_db.queue()
    due_now(queue, "orphaned")
    dead = Runner.create(host="host-b", boot_id="b", pid=4242, pid_create_time=1234.5,
                         kind="overseer", started_on=utcnow(), heartbeat_on=utcnow(),
                         status="running")
    worker = "host-b:4242:1234.500"
    PeriodicTask.update(worker=worker, marked=utcnow()).where(
        PeriodicTask.name == "orphaned").execute()
    scheduler = PeriodicScheduler(queue.store)
    assert scheduler.clear_stale_marks() == 0, "the mark of a live holder was cleared"
    assert row("orphaned").worker == worker

    assert liveness.mark_runner_dead(queue.store, dead.id, "no heartbeat from host-b")
    assert scheduler.clear_stale_marks() == 1
    assert row("orphaned").worker is None
    assert scheduler.next_due() is not None
    assert len(scheduler.run_pending()["submitted"]) == 1
    queue.close()
