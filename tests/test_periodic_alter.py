"""Periodic tasks changed in place (TimescaleDB's alter_job) from the API, the CLI and the
dashboard, their lifetime counts, and resuming a periodic task's next task from the
checkpoint of the previous one (Nuntium: "the next instantiation will proceed from that
point").

In-process tests inject `now`; the resume test runs a real runner that stops the first task
at its max_runtime."""
import json
import re
from datetime import datetime, timedelta, timezone
from urllib.parse import urlencode

import pytest

from conftest import ok, taskrunner, usage_error
from durable_handlers import lines
from taskrunner import Config, InputError
from taskrunner.periodic.scheduler import (PeriodicScheduler, add_periodic, alter_periodic,
                                           run_now, sync_definitions)
from taskrunner.reads import records as reads
from taskrunner.runs import rotation
from taskrunner.store.models import ERROR, SUCCESS, PeriodicTask, Task

ECHO = "taskrunner.handlers.Echo"
T0 = datetime(2024, 1, 1, 12, 0, 0)
COUNTERS = ("submitted_count", "skipped_count", "run_count", "success_count", "error_count",
            "crash_count", "consecutive_failures", "last_status", "last_task_id", "created")


def at(seconds):
    return T0 + timedelta(seconds=seconds)


def row(name):
    return PeriodicTask.get(PeriodicTask.name == name)


def tasks_of(name):
    return list(Task.select().where(Task.periodic_task_id == row(name).id).order_by(Task.id))


def snapshot():
    return [sorted(r.__data__.items()) for r in PeriodicTask.select().order_by(PeriodicTask.id)]


def counters(name):
    r = row(name)
    return {key: getattr(r, key) for key in COUNTERS}


def with_history(queue):
    """A periodic task whose one task failed once, then succeeded: two runs behind it."""
    add_periodic(queue.store, "job", "sample_handlers.FailTimes", "every 10s", data={"fail": 1},
                 now=T0, max_retries=2)
    scheduler = PeriodicScheduler(queue.store)
    scheduler.run_pending(now=at(10))
    queue.run_pending()
    queue.run_pending()
    assert [t.last_status for t in tasks_of("job")] == [SUCCESS]
    return scheduler


# == the API, on SQLite, PostgreSQL and MariaDB ==============================================

@pytest.mark.timeout(120)
def test_alter_changes_timer_and_options_in_place_and_keeps_the_counters(database):
    queue = database.queue(task={"retry_backoff": 0})
    scheduler = with_history(queue)
    before = counters("job")
    assert (before["run_count"], before["success_count"], before["error_count"]) == (2, 1, 1)

    alter_periodic(queue.store, "job", timer="every 1min", data={"fail": 0}, priority=7,
                   queue="reports", max_retries=3, max_runtime="30s", resume=True, now=at(25))
    altered = row("job")
    assert counters("job") == before
    # A new timer starts afresh from now (the database's clock: the injected now here).
    assert altered.timer == "every 1min" and altered.nextrun == at(85)
    assert (altered.priority, altered.queue, altered.max_retries, altered.max_runtime,
            altered.resume, json.loads(altered.data)) == (7, "reports", 3, 30.0, True,
                                                          {"fail": 0})
    scheduler.run_pending(now=at(85))
    task = tasks_of("job")[-1]
    assert (task.priority, task.queue, task.max_retries, task.max_runtime) == (
        7, "reports", 3, 30.0)
    assert json.loads(task.data) == {"fail": 0}

    start = datetime(2030, 1, 1, tzinfo=timezone.utc)
    alter_periodic(queue.store, "job", next_start=start, enabled=False, now=at(90))
    assert row("job").nextrun == datetime(2030, 1, 1) and not row("job").enabled
    # Enabled again without a start: from now, as `periodic enable` does.
    alter_periodic(queue.store, "job", enabled=True, now=at(100))
    assert row("job").enabled and row("job").nextrun == at(160)
    assert counters("job")["submitted_count"] == before["submitted_count"] + 1
    queue.close()


BAD_ALTERS = [
    ("timer", {"timer": "every 5 fortnights"}, "invalid timer"),
    ("zero-interval", {"timer": "every 0s"}, "at least 1s"),
    ("priority", {"priority": "high"}, "priority must be an integer"),
    ("retries", {"max_retries": 0}, "max_retries must be an integer of at least 1"),
    ("runtime", {"max_runtime": "5 parsecs"}, "max_runtime"),
    ("queue", {"queue": "a b"}, "queue"),
    ("enabled", {"enabled": "yes"}, "enabled must be true or false"),
    ("resume", {"resume": 1}, "resume must be true or false"),
    ("naive-start", {"next_start": datetime(2030, 1, 1)}, "timezone-aware"),
    ("unknown", {"handler": "x.Y"}, "handler cannot be altered"),
    ("nothing", {}, "nothing to change"),
    ("timer-with-bad-start", {"timer": "every 1min", "next_start": "soon"}, "next_start"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("changes,fragment", [c[1:] for c in BAD_ALTERS],
                         ids=[c[0] for c in BAD_ALTERS])
def test_a_bad_alter_raises_input_error_and_changes_nothing(queue, changes, fragment):
    add_periodic(queue.store, "job", ECHO, "every 10s", now=T0)
    before = snapshot()
    with pytest.raises(InputError, match=re.escape(fragment)):
        alter_periodic(queue.store, "job", now=at(5), **changes)
    assert snapshot() == before


@pytest.mark.timeout(120)
def test_alter_of_a_config_periodic_task_is_refused_naming_the_file_but_next_start(database,
                                                                                  tmp_path):
    path = tmp_path / "taskrunner.toml"
    path.write_text('[database]\nurl = "%s"\n[[periodic]]\nname = "cfg"\nhandler = "%s"\n'
                    'timer = "every 1h"\n' % (database.url, ECHO))
    queue = database.queue()
    config = Config.load(path=str(path))
    sync_definitions(queue.store, config, now=T0)
    from taskrunner.store.bound import Store
    store = Store(config)
    try:
        before = snapshot()
        with pytest.raises(InputError, match="defined in the config file %s: change it there"
                           % re.escape(str(path))):
            alter_periodic(store, "cfg", timer="every 1min", now=at(1))
        assert snapshot() == before
        alter_periodic(store, "cfg", next_start=datetime(2030, 1, 1, tzinfo=timezone.utc))
        assert row("cfg").nextrun == datetime(2030, 1, 1) and row("cfg").timer == "every 1h"
    finally:
        store.close()
        queue.close()


@pytest.mark.timeout(120)
def test_lifetime_counts_outlive_the_runs_rotation_deletes(database):
    queue = database.queue(task={"retry_backoff": 0})
    with_history(queue)
    deleted = rotation.delete_finished(queue.store, [t.id for t in tasks_of("job")])
    assert not any(deleted.values())
    [info] = [p for p in reads.list_periodic(queue.store) if p.name == "job"]
    assert info.stats.runs == 0     # task_runs holds none of them any more
    assert (info.run_count, info.success_count, info.error_count) == (2, 1, 1)
    queue.close()


@pytest.mark.timeout(120)
def test_resume_starts_the_next_task_from_the_checkpoint_of_one_that_failed(database,
                                                                           tmp_path):
    """In-process, through the scheduler and run-now: a next task of a `resume` periodic
    task starts from the checkpoint of the previous one when that one failed (given up), not
    when it succeeded, and never for a periodic task without `resume`."""
    queue = database.queue(task={"retry_backoff": 0})
    log = str(tmp_path / "log")
    for name, resume in (("resumes", True), ("fresh", False)):
        add_periodic(queue.store, name, "durable_handlers.CheckpointThenFail", "every 10s",
                     data={"log": log}, now=T0, max_retries=1, resume=resume)
    scheduler = PeriodicScheduler(queue.store)
    scheduler.run_pending(now=at(10))
    queue.run_pending()
    assert [t.last_status for t in tasks_of("resumes")] == [ERROR]
    scheduler.run_pending(now=at(20))
    assert json.loads(tasks_of("resumes")[-1].checkpoint) == {"done": 3}
    assert tasks_of("fresh")[-1].checkpoint is None
    queue.run_pending()
    assert sorted(" ".join(line) for line in lines(log)) == [
        "1 None", "1 None", "1 None", "1 {'done': 3}"]

    # A success passes nothing on: attempt 2 of a task succeeds after attempt 1's checkpoint.
    alter_periodic(queue.store, "resumes", max_retries=2, now=at(25))
    task_id = run_now(queue.store, "resumes", now=at(26))
    queue.run_pending()
    queue.run_pending()
    assert Task.get_by_id(task_id).last_status == SUCCESS
    assert Task.get_by_id(run_now(queue.store, "resumes", now=at(27))).checkpoint is None
    queue.close()


# == the CLI =================================================================================

@pytest.mark.timeout(180)
def test_cli_periodic_alter_changes_in_place_and_refuses_bad_input_with_exit_2(sqlite_db):
    queue = sqlite_db.queue(task={"retry_backoff": 0})
    url = sqlite_db.url
    with_history(queue)
    before = counters("job")
    for args, fragment in ((["--timer", "every 5 fortnights"], "invalid timer"),
                           (["--next-start", "tomorrow"], "invalid ISO 8601 time"),
                           (["--priority", "x"], "invalid int value"),
                           (["--max-retries", "0"], "max_retries"),
                           ([], "nothing to change")):
        snap = snapshot()
        usage_error(taskrunner("periodic", "alter", "job", *args, url=url), fragment)
        assert snapshot() == snap
    usage_error(taskrunner("periodic", "alter", "nope", "--priority", "1", url=url),
                "no periodic task named 'nope'")
    out = ok(taskrunner("periodic", "alter", "job", "--timer", "every 2h", "--priority", "4",
                        "--data", '{"fail": 0}', "--resume", "--disable", url=url))
    assert "altered" in out and "disabled" in out
    shown = json.loads(ok(taskrunner("periodic", "alter", "job", "--enable", "--next-start",
                                     "2030-01-01T00:00:00Z", "--json", url=url)))
    assert (shown["timer"], shown["priority"], shown["data"], shown["resume"],
            shown["enabled"], shown["nextrun"]) == ("every 2h", 4, {"fail": 0}, True, True,
                                                    "2030-01-01T00:00:00+00:00")
    assert (shown["run_count"], shown["success_count"], shown["error_count"]) == (2, 1, 1)
    assert counters("job") == before
    table = ok(taskrunner("periodic", "list", url=url)).splitlines()
    [line] = [l for l in table if l.startswith("job ")]
    assert re.search(r"\s2\s+1\s+1\s", line), line
    queue.close()


# == the dashboard ===========================================================================

@pytest.mark.timeout(120)
def test_dashboard_alter_form_needs_the_csrf_token_and_changes_in_place(sqlite_db):
    from dashboard_helpers import Served, fetch
    from test_dashboard import notice_of
    queue = sqlite_db.queue(task={"retry_backoff": 0})
    with_history(queue)
    before = counters("job")
    served = Served(queue.store)
    try:
        page = fetch(served.url + "/periodic")[1]
        assert 'action="/periodic/alter"' in page and "2 runs: " in page
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        form = {"name": "job", "timer": "every 3h", "priority": "9", "resume": "on"}
        assert fetch(served.url + "/periodic/alter", data=urlencode(dict(form, csrf="x")))[0] \
            == 403
        assert row("job").timer == "every 10s"
        snap = snapshot()
        status, _, headers = fetch(served.url + "/periodic/alter", data=urlencode(
            dict(form, csrf=token, timer="every 5 fortnights")))
        assert status == 303 and "nothing changed" in notice_of(headers)
        assert snapshot() == snap
        status, _, headers = fetch(served.url + "/periodic/alter",
                                   data=urlencode(dict(form, csrf=token)))
        assert status == 303 and "altered" in notice_of(headers)
        altered = row("job")
        assert (altered.timer, altered.priority, altered.resume) == ("every 3h", 9, True)
        assert counters("job") == before
    finally:
        served.stop()
        queue.close()


@pytest.mark.timeout(240)
def test_a_task_stopped_at_its_max_runtime_is_continued_by_the_next_one(sqlite_db, tmp_path):
    """A real runner stops the first task at its max_runtime after it checkpointed some of its
    steps; the next task of the periodic task (`resume`) starts at the step after the
    checkpoint, not at step 0."""
    queue = sqlite_db.queue()
    log = str(tmp_path / "steps")
    add_periodic(queue.store, "long", "durable_handlers.Steps", "every 1h", max_retries=1,
                 data={"log": log, "steps": 100000, "sleep": 0.02}, max_runtime="2s",
                 resume=True)
    first = run_now(queue.store, "long")
    burst = taskrunner("runner", "--burst", url=sqlite_db.url, timeout=120)
    assert burst.returncode == 0, burst.stderr
    first_task = Task.get_by_id(first)
    assert first_task.last_status in (ERROR, "timeout") and first_task.finished_on is not None
    done = json.loads(first_task.checkpoint)
    assert done > 0 and [int(line[1]) for line in lines(log)
                         if int(line[0]) == first][0] == 0

    second = run_now(queue.store, "long")
    assert json.loads(Task.get_by_id(second).checkpoint) == done
    burst = taskrunner("runner", "--burst", url=sqlite_db.url, timeout=120)
    assert burst.returncode == 0, burst.stderr
    steps = [int(line[1]) for line in lines(log) if int(line[0]) == second]
    assert steps and steps[0] == done
    assert row("long").run_count == 2 and row("long").error_count == 2
    queue.close()


@pytest.mark.timeout(120)
def test_the_migration_counts_the_runs_kept_so_far_and_leaves_resume_off(database):
    """An existing database: 0024 undone (its columns dropped, its record forgotten) on a
    periodic task with history, then applied again as an upgrade would."""
    queue = database.queue(task={"retry_backoff": 0})
    with_history(queue)
    db = queue.store.db
    for column in ("run_count", "success_count", "error_count", "resume"):
        db.execute_sql("ALTER TABLE periodic_tasks DROP COLUMN %s" % column)
    db.execute_sql("DELETE FROM taskrunner_migrations WHERE name = "
                   "'0024_periodic_lifetime_counts_and_resume'")
    assert queue.store.migrate() == ["0024_periodic_lifetime_counts_and_resume"]
    migrated = row("job")
    assert (migrated.run_count, migrated.success_count, migrated.error_count,
            migrated.resume) == (2, 1, 1, False)
    queue.close()
