"""Periodic tasks with every seed's semantics (the periodic-seeds issue): TimescaleDB's
schedule_interval (``after SPAN``: the next start SPAN after the previous task finished),
Nuntium's timebox and tolerance (its worked tables, row by row), Nuntium's "remove the tasks
of a deleted channel" (``--owner X --all``), Docspell's subject and group.

In-process tests inject `now` into the scheduler and into the run lifecycle (claim, start
check, end); one test runs a real overseer.
"""
import json
import logging
from datetime import timedelta

import pytest

from conftest import ALL_BACKENDS, Database, ok, taskrunner, usage_error, wait_for
from test_periodic import ECHO, T0, at, row, tasks_of
from taskrunner import InputError
from taskrunner.fleet import liveness
from taskrunner.runs.lifecycle import claim, end_run, timeout_overdue_runs
from taskrunner.store.models import CANCELLED, SUCCESS, TIMEOUT, PeriodicTask, Run, Task, utcnow
from taskrunner.periodic.scheduler import (PeriodicScheduler, add_periodic, allow_start,
                                           remove_owned, set_enabled_owned, sync_definitions)


def runner_of(store):
    """The runner row the runs claimed in-process belong to (one per store, kept on it): a
    claim takes runs only for a runner whose row is ``running``."""
    if getattr(store, "seed_runner_id", None) is None:
        store.seed_runner_id = liveness.register(store).id
    return store.seed_runner_id


def start(store, now):
    """What a runner does when it takes the next run: claim it, then Nuntium's start check.
    Returns (claimed run, allowed)."""
    claimed = claim(store, runner_of(store), now=now)
    assert claimed is not None
    return claimed, allow_start(store, claimed.periodic_task_id, now=now)


def end(store, claimed, now, status=SUCCESS, code=None):
    assert end_run(store, claimed.run_id, claimed.task_id, status, runner_id=runner_of(store),
                   error_code=code, now=now, periodic_task_id=claimed.periodic_task_id)


# == TimescaleDB: schedule_interval, "after SPAN" ==========================================

@pytest.mark.timeout(120)
def test_after_timer_starts_the_next_task_a_span_after_the_previous_one_finished(queue):
    store = queue.store
    add_periodic(store, "after", ECHO, "after 10s", now=T0)
    add_periodic(store, "grid", ECHO, "every 10s", now=T0)
    assert row("after").nextrun == at(10) == row("grid").nextrun
    scheduler = PeriodicScheduler(store)
    assert len(scheduler.run_pending(now=at(10))["submitted"]) == 2

    # Its task has not run by the next grid point: nothing submitted, nothing counted as
    # skipped; the scheduler looks again a span later.
    assert scheduler.run_pending(now=at(20)) == {"submitted": [], "skipped": ["grid"]}
    assert row("after").nextrun == at(30) and row("after").skipped_count == 0

    first, _ = start(store, at(24))
    assert first.task_id == tasks_of("after")[0].id
    end(store, first, at(25))
    assert row("after").nextrun == at(35)      # finish + span, not the grid's 30
    assert scheduler.run_pending(now=at(34))["submitted"] == []
    [second] = scheduler.run_pending(now=at(35))["submitted"]
    assert Task.get_by_id(second).scheduled_on == at(35)
    assert row("grid").nextrun == at(40)

    # The scheduler checks the finish itself: a nextrun set too early (a scheduler that
    # marked the row while the task ended) submits nothing and is put right.
    grid_task = [t for t in tasks_of("grid") if t.finished_on is None][0]
    claimed, _ = start(store, at(36))
    if claimed.task_id == grid_task.id:
        end(store, claimed, at(36))
        claimed, _ = start(store, at(36))
    end(store, claimed, at(45))
    assert row("after").nextrun == at(55)
    PeriodicTask.update(nextrun=at(46)).where(PeriodicTask.name == "after").execute()
    scheduler.run_pending(now=at(46))   # (the grid's due time 40 submits a task)
    assert row("after").nextrun == at(55)
    assert [t.scheduled_on for t in tasks_of("after")] == [at(10), at(35)]


@pytest.mark.timeout(120)
def test_after_timer_waits_for_a_task_that_is_retrying(database):
    queue = database.queue(task={"retry_backoff": 0})
    store = queue.store
    add_periodic(store, "flaky", "sample_handlers.FailTimes", "after 10s", data={"fail": 1},
                 max_retries=3, now=T0)
    scheduler = PeriodicScheduler(store)
    scheduler.run_pending(now=at(10))
    claimed, _ = start(store, at(11))
    end(store, claimed, at(12), status="error", code="Planned")
    # A failed run with a retry pending has not finished its task.
    assert row("flaky").nextrun == at(20)
    assert scheduler.run_pending(now=at(20))["submitted"] == []
    queue.process_queue()
    retry, _ = start(store, at(21))
    assert retry.task_id == claimed.task_id and retry.attempt == 2
    end(store, retry, at(23))
    assert row("flaky").nextrun == at(33)
    queue.close()


# == Nuntium: interval, timebox and tolerance, its worked tables ===========================

# The seed's tables for task A, interval 1 min, cron every 30 s: (MM:SS, event, nextRun,
# lastRun). tolerance = 5 s: 57 s (table 1) must pass and 28 s (table 3) must not.
# Where a task begins, lastRun is that start: the seed shows it so for A1 at 00:35 and A3 at
# 02:56; its rows "01:32 A2 begins" (table 1, 4) and "02:37 A2 begins" (table 2) still print
# the previous value, which the rule ("last run time is set when the task starts") updates.
NUNTIUM_TABLES = {
    "standard": [
        ("00:00", "initial", "00:30", None),
        ("00:30", "enqueue A1", "01:30", None),
        ("00:35", "begin A1", "01:30", "00:35"),
        ("00:45", "end A1", "01:30", "00:35"),
        ("01:00", "cron", "01:30", "00:35"),
        ("01:30", "enqueue A2", "02:30", "00:35"),
        ("01:32", "begin A2", "02:30", "01:32"),
    ],
    "queue-full": [
        ("00:00", "initial", "00:30", None),
        ("00:30", "enqueue A1", "01:30", None),
        ("01:00", "cron", "01:30", None),
        ("01:30", "enqueue A2", "02:30", None),
        ("01:35", "begin A1", "02:30", "01:35"),
        ("01:38", "end A1", "02:30", "01:35"),
        ("02:00", "cron", "02:30", "01:35"),
        ("02:30", "enqueue A3", "03:30", "01:35"),
        ("02:37", "begin A2", "03:30", "02:37"),
    ],
    "dropped": [
        ("00:00", "initial", "00:30", None),
        ("00:30", "enqueue A1", "01:30", None),
        ("01:00", "cron", "01:30", None),
        ("01:30", "enqueue A2", "02:30", None),
        ("01:35", "begin A1", "02:30", "01:35"),
        ("01:38", "end A1", "02:30", "01:35"),
        ("02:00", "cron", "02:30", "01:35"),
        ("02:03", "drop A2", "02:30", "01:35"),
        ("02:30", "enqueue A3", "03:30", "01:35"),
        ("02:56", "begin A3", "03:30", "02:56"),
    ],
    "timeboxed": [
        ("00:00", "initial", "00:30", None),
        ("00:30", "enqueue A1", "01:30", None),
        ("00:35", "begin A1", "01:30", "00:35"),
        ("01:00", "cron", "01:30", "00:35"),
        ("01:05", "force-end A1", "01:30", "00:35"),
        ("01:30", "enqueue A2", "02:30", "00:35"),
        ("01:32", "begin A2", "02:30", "01:32"),
    ],
}


def mmss(text):
    minutes, seconds = text.split(":")
    return at(60 * int(minutes) + int(seconds))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anchor", ["due", "now"])
@pytest.mark.parametrize("table", list(NUNTIUM_TABLES))
def test_nuntium_worked_tables(queue, table, anchor, caplog):
    """Each table replayed row by row, with the grid's rule (``anchor = "due"``, the default)
    and with the seed's own (``anchor = "now"``: nextRun = currentTime + interval): its cron
    runs on time, so both give its nextRun column. Nuntium's mode (a tolerance) timeboxes
    every task to interval / 2 without being asked."""
    caplog.set_level(logging.INFO, "taskrunner.periodic")
    store = queue.store
    # Created 30 s before 00:00, so the first due time is the tables' initial nextRun 00:30.
    add_periodic(store, "A", ECHO, "every 1min", now=at(-30), tolerance="5s", anchor=anchor)
    assert (row("A").timebox, row("A").max_runtime, row("A").anchor) == ("half", 30.0, anchor)
    scheduler = PeriodicScheduler(store)
    tasks, running = {}, {}
    for clock, event, next_run, last_run in NUNTIUM_TABLES[table]:
        now = mmss(clock)
        action, _, label = event.partition(" ")
        if action in ("cron", "enqueue"):
            submitted = scheduler.run_pending(now=now)["submitted"]
            assert len(submitted) == (1 if action == "enqueue" else 0), (clock, event)
            if submitted:
                tasks[label] = submitted[0]
                assert Task.get_by_id(submitted[0]).max_runtime == 30.0  # interval / 2
        elif action in ("begin", "drop"):
            claimed, allowed = start(store, now)
            assert claimed.task_id == tasks[label], (clock, event)
            assert allowed == (action == "begin"), (clock, event)
            if allowed:
                running[label] = claimed
            else:  # what the runner records for a dropped task
                end(store, claimed, now, status=CANCELLED, code="MinSpacing")
        elif action == "end":
            end(store, running.pop(label), now)
        elif action == "force-end":
            # The timebox: interval / 2 after the start, the run is timed out.
            assert timeout_overdue_runs(store, now=now - timedelta(milliseconds=1)) == []
            ended = timeout_overdue_runs(store, now=now + timedelta(milliseconds=1))
            assert ended == [(running.pop(label).run_id, runner_of(store))]
            assert Run.get_by_id(ended[0][0]).error_code == "MaxRuntime"
        current = row("A")
        assert current.nextrun == mmss(next_run), (clock, event)
        assert current.last_run == (mmss(last_run) if last_run else None), (clock, event)
    dropped = sum(1 for _, event, _, _ in NUNTIUM_TABLES[table] if event.startswith("drop"))
    assert row("A").dropped_count == dropped
    assert len([r for r in caplog.records if "dropped at start" in r.getMessage()]) == dropped
    statuses = {label: Task.get_by_id(task_id).last_status for label, task_id in tasks.items()}
    if table == "dropped":
        assert statuses["A2"] == CANCELLED
    if table == "timeboxed":
        assert statuses["A1"] == TIMEOUT


# The seed's rule when the cron runs late (every 30 s, but at :15 and :45): Nuntium counts the
# next run from the moment it enqueued; the grid from the due time. (MM:SS, event, nextRun
# with anchor "due", nextRun with anchor "now").
LATE_CRON = [
    ("00:00", "initial", "00:30", "00:30"),
    ("00:45", "enqueue A1", "01:30", "01:45"),
    ("01:15", "cron", "01:30", "01:45"),
    ("01:45", "enqueue A2", "02:30", "02:45"),
    ("02:15", "cron", "02:30", "02:45"),
    ("02:45", "enqueue A3", "03:30", "03:45"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anchor", ["due", "now"])
def test_a_late_scheduler_counts_the_next_run_from_the_due_time_or_from_now(queue, anchor):
    """Interval 60 s, due 00:30, the scheduler runs at 00:45: the next run is 01:30 on the
    grid (anchor "due", the default), 01:45 by Nuntium's rule (anchor "now")."""
    store = queue.store
    add_periodic(store, "A", ECHO, "every 1min", now=at(-30), anchor=anchor)
    scheduler = PeriodicScheduler(store)
    for clock, event, on_grid, from_now in LATE_CRON:
        if event != "initial":
            submitted = scheduler.run_pending(now=mmss(clock))["submitted"]
            assert len(submitted) == (1 if event.startswith("enqueue") else 0), (clock, event)
            # Each task is finished at once: the next due time is never skipped as unfinished.
            Task.update(finished_on=mmss(clock), last_status=SUCCESS).where(
                Task.id.in_(submitted)).execute()
        assert row("A").nextrun == mmss(on_grid if anchor == "due" else from_now), (clock, event)


@pytest.mark.timeout(120)
def test_nuntiums_timebox_is_on_in_its_mode_unless_turned_off(queue):
    """With a tolerance every task is timeboxed to interval / 2 (the seed: "All tasks should
    be timeboxed"); ``timebox = "off"`` turns it off, an absolute max_runtime replaces it;
    without a tolerance nothing changes."""
    store = queue.store
    add_periodic(store, "nuntium", ECHO, "every 1min", now=T0, tolerance="5s")
    add_periodic(store, "untimed", ECHO, "every 1min", now=T0, tolerance="5s", timebox="off")
    add_periodic(store, "absolute", ECHO, "every 1min", now=T0, tolerance="5s",
                 max_runtime="10s")
    add_periodic(store, "grid", ECHO, "every 1min", now=T0)
    add_periodic(store, "grid-off", ECHO, "every 1min", now=T0, timebox="off")
    expected = {"nuntium": ("half", 30.0), "untimed": ("off", None), "absolute": (None, 10.0),
                "grid": (None, None), "grid-off": ("off", None)}
    assert {name: (row(name).timebox, row(name).max_runtime) for name in expected} == expected
    submitted = PeriodicScheduler(store).run_pending(now=at(60))["submitted"]
    assert len(submitted) == len(expected)
    assert {t.periodic_task_id: t.max_runtime for t in Task.select()} == {
        row(name).id: runtime for name, (_, runtime) in expected.items()}


@pytest.mark.timeout(120)
def test_config_entries_and_the_cli_take_anchor_and_timebox_off(database, tmp_path):
    queue = database.queue()
    config = database.config()
    config.periodic = [{"name": "poll", "handler": ECHO, "timer": "every 1min",
                        "tolerance": "5s", "anchor": "now"},
                       {"name": "poll-off", "handler": ECHO, "timer": "every 1min",
                        "tolerance": "5s", "timebox": "off"}]
    sync_definitions(queue.store, config, now=T0)
    assert (row("poll").anchor, row("poll").timebox, row("poll").max_runtime) == (
        "now", "half", 30.0)
    assert (row("poll-off").anchor, row("poll-off").timebox, row("poll-off").max_runtime) == (
        "due", "off", None)
    url = database.url
    ok(taskrunner("periodic", "add", "cli", ECHO, "every 2min", "--tolerance", "10s",
                  "--anchor", "now", url=url))
    ok(taskrunner("periodic", "add", "cli-off", ECHO, "every 2min", "--tolerance", "10s",
                  "--timebox", "off", url=url))
    listed = {r["name"]: r for r in json.loads(ok(taskrunner("periodic", "list", "--json",
                                                             url=url)))}
    assert (listed["cli"]["anchor"], listed["cli"]["timebox"], listed["cli"]["max_runtime"]) \
        == ("now", "half", 60.0)
    assert (listed["cli-off"]["anchor"], listed["cli-off"]["timebox"],
            listed["cli-off"]["max_runtime"]) == ("due", "off", None)
    usage_error(taskrunner("periodic", "add", "bad", ECHO, "hourly", "--anchor", "now",
                           url=url), 'anchor "now" needs')
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_migration_keeps_the_grid_and_timeboxes_existing_nuntium_tasks(backend, tmp_path):
    """Migration 0017: every existing periodic task keeps counting from its due times
    (anchor "due"); one in Nuntium's mode with neither a timebox nor a max_runtime gets the
    timebox a new one would (interval / 2, its interval being min_spacing + tolerance)."""
    db = Database(backend, tmp_path, empty=True)
    try:
        store = db.store_at("0016_postgresql_partial_null_indexes")
        param = store.db.param
        for name, tolerance, min_spacing, max_runtime, timebox in (
                ("nuntium", 5.0, 55.0, None, None), ("absolute", 5.0, 55.0, 10.0, None),
                ("half", 5.0, 55.0, 30.0, "half"), ("grid", None, None, None, None)):
            store.db.execute_sql(
                "INSERT INTO periodic_tasks (name, enabled, handler, data, priority, timer, "
                "created, catch_up, source, consecutive_failures, submitted_count, "
                "skipped_count, updated_on, tolerance, min_spacing, max_runtime, timebox) "
                "VALUES (%s)" % ", ".join([param] * 17),
                (name, True, ECHO, "null", 0, "every 1min", T0, "once", "api", 0, 0, 0, T0,
                 tolerance, min_spacing, max_runtime, timebox))
        store.migrate()
        rows = {r.name: (r.anchor, r.timebox, r.max_runtime)
                for r in store.PeriodicTask.select()}
        assert rows == {"nuntium": ("due", "half", 30.0), "absolute": ("due", None, 10.0),
                        "half": ("due", "half", 30.0), "grid": ("due", None, None)}
        store.close()
    finally:
        db.drop()


BAD_NUNTIUM = [
    ("anchor-calendar", dict(timer="hourly", anchor="now"), 'anchor "now" needs'),
    ("anchor-after", dict(timer="after 1min", anchor="now"), 'anchor "now" needs'),
    ("anchor-word", dict(timer="every 1min", anchor="later"), "anchor must be"),
    ("timebox-off-and-max-runtime", dict(timer="every 1min", timebox="off",
                                         max_runtime="5s"), "not both"),
    ("timebox-calendar", dict(timer="hourly", timebox="half"), "timebox needs"),
    ("timebox-word", dict(timer="every 1min", timebox="third"), "timebox must be"),
    ("timebox-and-max-runtime", dict(timer="every 1min", timebox="half", max_runtime="5s"),
     "not both"),
    ("tolerance-calendar", dict(timer="hourly", tolerance="5s"), "tolerance needs"),
    ("tolerance-after", dict(timer="after 1min", tolerance="5s"), "tolerance needs"),
    ("tolerance-too-long", dict(timer="every 1min", tolerance="1min"), "shorter than"),
    ("tolerance-bad-span", dict(timer="every 1min", tolerance="5 parsecs"), "tolerance: invalid"),
    ("tolerance-and-min-spacing", dict(timer="every 1min", tolerance="5s", min_spacing="5s"),
     "not both"),
    ("subject-not-text", dict(timer="every 1min", subject=5), "subject must be a string"),
    ("group-too-long", dict(timer="every 1min", group="g" * 256),
     "group is longer than 255 characters"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options,fragment", [c[1:] for c in BAD_NUNTIUM],
                         ids=[c[0] for c in BAD_NUNTIUM])
def test_bad_timebox_tolerance_subject_or_group_is_refused_and_stores_nothing(
        sqlite_db, options, fragment):
    queue = sqlite_db.queue()
    with pytest.raises(InputError, match=fragment):
        add_periodic(queue.store, "job", ECHO, **options)
    assert PeriodicTask.select().count() == 0
    queue.close()


# == Nuntium: all periodic tasks of one owner ==============================================

@pytest.mark.timeout(120)
def test_owner_all_disables_enables_and_removes_every_task_of_the_owner_at_once(queue):
    store = queue.store
    for name, owner in (("a1", "pop3:1"), ("a2", "pop3:1"), ("a3", "pop3:1"), ("b", "pop3:2"),
                        ("c", None)):
        add_periodic(store, name, ECHO, "every 1h", owner=owner, now=T0)
    PeriodicTask.update(enabled=False).where(PeriodicTask.name == "a3").execute()
    assert set_enabled_owned(store, "pop3:1", False, now=at(5)) == 2   # a3 was off already
    assert {r.name for r in PeriodicTask.select().where(PeriodicTask.enabled == False)  # noqa: E712
            } == {"a1", "a2", "a3"}
    assert set_enabled_owned(store, "pop3:1", True, now=at(60)) == 3
    assert all(row(n).enabled and row(n).nextrun == at(3660) for n in ("a1", "a2", "a3"))

    # One transaction: a row that cannot be enabled leaves every row as it was.
    set_enabled_owned(store, "pop3:1", False, now=at(70))
    PeriodicTask.update(timer="every 5 fortnights").where(PeriodicTask.name == "a2").execute()
    with pytest.raises(InputError, match="fortnights"):
        set_enabled_owned(store, "pop3:1", True, now=at(80))
    assert not any(row(n).enabled for n in ("a1", "a2", "a3"))

    assert remove_owned(store, "pop3:1") == 3
    assert sorted(r.name for r in PeriodicTask.select()) == ["b", "c"]
    assert remove_owned(store, "pop3:1") == 0
    for owner in (None, ""):
        with pytest.raises(InputError, match="owner"):
            remove_owned(store, owner)


@pytest.mark.timeout(180)
def test_cli_owner_all_prints_how_many_and_refuses_a_name_with_all_or_all_without_owner(
        sqlite_db):
    queue = sqlite_db.queue()
    url = sqlite_db.url
    for name, owner in (("a1", "alice"), ("a2", "alice"), ("b", "bob")):
        ok(taskrunner("periodic", "add", name, ECHO, "every 1h", "--owner", owner, url=url))
    before = [sorted(r.__data__.items()) for r in PeriodicTask.select().order_by(PeriodicTask.id)]
    for args in (["disable", "--all"], ["disable", "a1", "--owner", "alice", "--all"],
                 ["remove"], ["remove", "--all", "--owner", ""]):
        usage_error(taskrunner("periodic", *args, url=url), "--owner WHO --all")
    assert [sorted(r.__data__.items()) for r in
            PeriodicTask.select().order_by(PeriodicTask.id)] == before

    out = ok(taskrunner("periodic", "disable", "--owner", "alice", "--all", url=url))
    assert out.strip() == "2 periodic tasks of owner 'alice' disabled"
    assert [r.enabled for r in PeriodicTask.select().order_by(PeriodicTask.name)] == [
        False, False, True]
    out = ok(taskrunner("periodic", "remove", "--owner", "alice", "--all", url=url))
    assert out.strip() == "2 periodic tasks of owner 'alice' removed"
    assert [r.name for r in PeriodicTask.select()] == ["b"]
    out = ok(taskrunner("periodic", "remove", "--owner", "alice", "--all", url=url))
    assert out.strip() == "0 periodic tasks of owner 'alice' removed"
    queue.close()


# == Docspell: subject and group ===========================================================

@pytest.mark.timeout(180)
def test_subject_and_group_are_listed_filtered_and_carried_to_the_submitted_tasks(sqlite_db):
    queue = sqlite_db.queue()
    url = sqlite_db.url
    ok(taskrunner("periodic", "add", "scan-acme", ECHO, "every 1h", "--subject",
                  "Scan the acme inbox", "--group", "acme", "--timebox", "half", "--tolerance",
                  "5min", url=url))
    ok(taskrunner("periodic", "add", "scan-other", ECHO, "every 1h", "--group", "other",
                  url=url))
    rows = json.loads(ok(taskrunner("periodic", "list", "--group", "acme", "--json", url=url)))
    assert [r["name"] for r in rows] == ["scan-acme"]
    [acme] = rows
    assert (acme["subject"], acme["group"], acme["timebox"], acme["tolerance"],
            acme["max_runtime"], acme["min_spacing"], acme["dropped"]) == (
        "Scan the acme inbox", "acme", "half", 300.0, 1800.0, 3300.0, 0)
    table = ok(taskrunner("periodic", "list", "--wide", url=url)).splitlines()
    for header in ("GROUP", "SUBJECT", "DROPPED"):
        assert header in table[0]
    [line] = [text for text in table if text.startswith("scan-acme ")]
    assert " acme " in line and "Scan the acme inbox" in line

    PeriodicTask.update(nextrun=utcnow() - timedelta(seconds=1)).execute()
    ok(taskrunner("run-event", "periodic-task:OnProcess", url=url))
    tasks = {t["periodic_task_id"]: t for t in json.loads(ok(taskrunner("tasks", "--json",
                                                                        url=url)))}
    task = tasks[row("scan-acme").id]
    assert (task["subject"], task["group"]) == ("Scan the acme inbox", "acme")
    assert (tasks[row("scan-other").id]["subject"], tasks[row("scan-other").id]["group"]) == (
        None, "other")
    queue.close()


@pytest.mark.timeout(120)
def test_config_entries_take_subject_group_timebox_and_tolerance(database):
    queue = database.queue()
    config = database.config()
    config.periodic = [{"name": "digest", "handler": ECHO, "timer": "every 10min",
                        "subject": "Daily digest", "group": "newsletter",
                        "timebox": "half", "tolerance": "30s"}]
    sync_definitions(queue.store, config, now=T0)
    digest = row("digest")
    assert (digest.subject, digest.group_name, digest.max_runtime, digest.min_spacing) == (
        "Daily digest", "newsletter", 300.0, 570.0)
    config.periodic[0].update(group="letters", tolerance="1min")
    sync_definitions(queue.store, config, now=at(1))
    digest = row("digest")
    assert (digest.group_name, digest.tolerance, digest.min_spacing) == ("letters", 60.0, 540.0)
    queue.close()


# == a real overseer =======================================================================

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overseer_starts_an_after_task_a_span_after_the_previous_one_finished(
        database_sp, procs, tmp_path):
    """A task that runs 3 s under ``after 2s``: each next task is due exactly 2 s after the
    previous one finished (on a 2 s grid it would be due while the previous still ran, and
    be skipped), and its run starts then, not earlier."""
    queue = database_sp.queue()
    add_periodic(queue.store, "slow", "sample_handlers.Span", "after 2s",
                 data={"log": str(tmp_path / "spans"), "sleep": 3})
    config = database_sp.write_config(
        tmp_path / "c.toml", "[runner]\nlimit = 2\npoll_interval = 0.1\n"
        "[overseer]\ncheck_interval = 0.5\ngraceful_timeout = 15\n")
    overseer = procs.spawn("overseer", config=config, name="overseer")

    def three_tasks_two_finished():
        assert overseer.poll() is None, procs.logs()
        tasks = tasks_of("slow")
        # The third one's run started too: stopped between its task's submission and the
        # claim, it would never start (CI).
        return len(tasks) >= 3 and all(t.finished_on for t in tasks[:2]) and \
            Run.select().where((Run.task_id == tasks[2].id)
                               & Run.started_on.is_null(False)).exists()
    wait_for(three_tasks_two_finished, timeout=120, message="three tasks of 'slow'")
    overseer.send_signal(15)
    assert procs.wait(overseer) == 0, procs.logs()

    tasks = tasks_of("slow")
    span = timedelta(seconds=2)
    for previous, following in zip(tasks, tasks[1:3]):
        assert previous.last_status == SUCCESS
        assert following.scheduled_on == previous.finished_on + span, procs.logs()
        [run] = Run.select().where(Run.task_id == following.id)
        started = run.started_on - previous.finished_on
        assert span <= started < span + timedelta(seconds=5), started
    assert row("slow").skipped_count == 0
    queue.close()
