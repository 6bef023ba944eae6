"""Temporal's schedule jitter and backfill on periodic tasks: each instance is due at its
calendar time plus a stable offset in [0, jitter) that every host and every restart computes
alike, and an operator creates the instances a period missed, once each, however many
backfills run at once.

In-process tests inject `now` (the scheduler's and the backfill's time seam); the stability
test computes offsets in other processes; the concurrency test forks two processes that
backfill one range at the same moment, on SQLite, PostgreSQL and MariaDB."""
import json
import multiprocessing
import re
import subprocess
import sys
from collections import Counter
from datetime import datetime, timedelta, timezone
from urllib.parse import urlencode

import pytest

from conftest import ok, process_env, taskrunner, usage_error, utc
from taskrunner import Config, InputError, TaskQueue
from taskrunner.periodic.definitions import jitter_offset
from taskrunner.periodic.scheduler import (PeriodicScheduler, add_periodic, alter_periodic,
                                           backfill, run_now, set_enabled, sync_definitions)
from taskrunner.store.models import PeriodicTask, Task

ECHO = "taskrunner.handlers.Echo"
T0 = datetime(2024, 1, 1, 12, 0, 0)
NIGHTLY = "*-*-* 03:00 UTC"
NAMES = ["report-%d" % i for i in range(200)]


def row(name):
    return PeriodicTask.get(PeriodicTask.name == name)


def tasks_of(name):
    return list(Task.select().where(Task.periodic_task_id == row(name).id).order_by(Task.id))


def day(n, hour=3):
    """Calendar time `hour`:00 of January n, 2024 (naive UTC)."""
    return datetime(2024, 1, n, hour)


# == jitter ==================================================================================

def test_the_offset_is_the_same_in_every_process_within_the_span_and_differs_between_tasks():
    script = ("import json, sys; from datetime import datetime\n"
              "from taskrunner.periodic.definitions import jitter_offset\n"
              "print(json.dumps([jitter_offset(n, datetime(2024, 1, 2, 3), 1800).total_seconds()"
              " for n in json.loads(sys.argv[1])]))")
    here = [jitter_offset(name, day(2), 1800).total_seconds() for name in NAMES]
    for seed in ("0", "1"):     # Python's own hash() of a str differs with the seed
        there = subprocess.run([sys.executable, "-c", script, json.dumps(NAMES)],
                               capture_output=True, text=True, check=True,
                               env=process_env({"PYTHONHASHSEED": seed})).stdout
        assert json.loads(there) == here
    assert all(0 <= offset < 1800 and offset == int(offset) for offset in here)
    assert len(set(here)) > 150     # spread: 200 tasks at one calendar time
    # The same task at its next calendar time gets an offset of its own.
    assert len({jitter_offset("report-1", day(n), 1800) for n in range(2, 12)}) > 5


def test_a_jitter_never_reaches_the_next_calendar_time(queue):
    for name in NAMES[:40]:
        add_periodic(queue.store, name, ECHO, "every 10s", now=T0, jitter="1h")
    for name in NAMES[:40]:
        r = row(name)
        assert r.nominal == T0 + timedelta(seconds=10)
        assert timedelta(0) <= r.nextrun - r.nominal < timedelta(seconds=10)


@pytest.mark.timeout(120)
def test_the_scheduler_creates_a_jittered_instance_once_at_its_jittered_time(database):
    queue = database.queue()
    add_periodic(queue.store, "nightly", ECHO, NIGHTLY, now=T0, jitter="30min")
    nominal = day(2)
    offset = jitter_offset("nightly", nominal, 1800)
    assert offset > timedelta(0)
    r = row("nightly")
    assert (r.jitter, r.nominal, r.nextrun) == (1800, nominal, nominal + offset)
    due = nominal + offset
    # Two schedulers, as on two hosts: neither submits at the calendar time, one at the
    # jittered time, the other then finds nothing.
    first, second = PeriodicScheduler(queue.store), PeriodicScheduler(queue.store)
    assert first.run_pending(now=nominal)["submitted"] == []
    assert second.run_pending(now=due - timedelta(seconds=1))["submitted"] == []
    [task_id] = first.run_pending(now=due)["submitted"]
    assert second.run_pending(now=due)["submitted"] == []
    assert [t.id for t in tasks_of("nightly")] == [task_id]
    assert Task.get_by_id(task_id).scheduled_on == due
    following = day(3)
    r = row("nightly")
    assert (r.nominal, r.nextrun, r.last_due) == (
        following, following + jitter_offset("nightly", following, 1800), due)
    queue.close()


def test_a_restarted_scheduler_and_an_enable_compute_the_same_instants(queue):
    add_periodic(queue.store, "nightly", ECHO, NIGHTLY, now=T0, jitter="30min")
    before = row("nightly").nextrun
    set_enabled(queue.store, "nightly", False, now=T0)
    set_enabled(queue.store, "nightly", True, now=T0 + timedelta(minutes=5))
    assert row("nightly").nextrun == before
    # Altering the jitter spreads the next instance again; none puts it on its calendar time.
    alter_periodic(queue.store, "nightly", jitter="10min", now=T0)
    assert row("nightly").nextrun == day(2) + jitter_offset("nightly", day(2), 600)
    alter_periodic(queue.store, "nightly", jitter="0", now=T0)
    assert (row("nightly").jitter, row("nightly").nominal, row("nightly").nextrun) == (
        None, None, day(2))


def test_a_config_entry_s_jitter_is_synced_and_a_change_spreads_the_next_instance(queue):
    def config(jitter):
        entry = {"name": "nightly", "handler": ECHO, "timer": NIGHTLY, "jitter": jitter}
        return Config.from_dict({"database": {"url": queue.store.config.database.url},
                                 "periodic": [entry]})
    sync_definitions(queue.store, config("30min"), now=T0, import_handlers=False)
    assert (row("nightly").jitter, row("nightly").nextrun) == (
        1800, day(2) + jitter_offset("nightly", day(2), 1800))
    sync_definitions(queue.store, config("5min"), now=T0, import_handlers=False)
    assert (row("nightly").jitter, row("nightly").nextrun) == (
        300, day(2) + jitter_offset("nightly", day(2), 300))


@pytest.mark.parametrize("options, fragment", [
    ({"jitter": "soon"}, "jitter: invalid time span"),
    ({"jitter": "-5min"}, "jitter"),
    ({"jitter": "5min", "timer": "after 1h"}, "jitter needs a calendar or 'every SPAN' timer"),
])
def test_a_bad_jitter_is_refused_and_nothing_stored(queue, options, fragment):
    options = dict({"timer": NIGHTLY}, **options)
    with pytest.raises(InputError, match=re.escape(fragment)):
        add_periodic(queue.store, "bad", ECHO, options.pop("timer"), now=T0, **options)
    assert PeriodicTask.select().count() == 0


def test_cli_jitter_on_add_alter_and_list_and_a_config_entry(sqlite_db, tmp_path):
    url = sqlite_db.url
    shown = json.loads(ok(taskrunner("periodic", "add", "nightly", ECHO, NIGHTLY, "--jitter",
                                     "30min", "--json", url=url)))
    assert shown["jitter"] == 1800
    nominal = datetime.fromisoformat(shown["nextrun"]).replace(second=0, minute=0)
    assert datetime.fromisoformat(shown["nextrun"]) == nominal + jitter_offset(
        "nightly", nominal.replace(tzinfo=None), 1800)
    [listed] = json.loads(ok(taskrunner("periodic", "list", "--json", url=url)))
    assert (listed["jitter"], listed["nextrun"]) == (1800, shown["nextrun"])
    altered = json.loads(ok(taskrunner("periodic", "alter", "nightly", "--jitter", "5min",
                                       "--json", url=url)))
    assert altered["jitter"] == 300 and altered["nextrun"] == (nominal + jitter_offset(
        "nightly", nominal.replace(tzinfo=None), 300)).isoformat()
    usage_error(taskrunner("periodic", "alter", "nightly", "--jitter", "later", url=url),
                "jitter: invalid time span")
    usage_error(taskrunner("periodic", "add", "after", ECHO, "after 5min", "--jitter", "1min",
                           url=url), "jitter needs a calendar")
    entry = '[[periodic]]\nname = "c"\nhandler = "%s"\ntimer = "every 1h"\njitter = "%s"\n'
    ok(taskrunner("check", config=sqlite_db.write_config(tmp_path / "good.toml",
                                                         entry % (ECHO, "10min"))))
    usage_error(taskrunner("check", config=sqlite_db.write_config(tmp_path / "bad.toml",
                                                                  entry % (ECHO, "soon"))),
                '"c": jitter: invalid time span')


# == backfill ================================================================================

def instants(outcome, kind):
    return [i.instance.replace(tzinfo=None) for i in outcome[kind]]


@pytest.mark.timeout(120)
def test_backfill_creates_the_missed_instances_once_and_leaves_the_rest(database):
    queue = database.queue()
    add_periodic(queue.store, "nightly", ECHO, NIGHTLY, now=T0, jitter="30min")
    # Down from day 2 to day 6 at noon: catch-up once submits one task, for day 2.
    scheduler = PeriodicScheduler(queue.store)
    [caught_up] = scheduler.run_pending(now=day(6, 12))["submitted"]
    queue.run_pending()     # finished: a run now is not refused
    run_now(queue.store, "nightly", now=day(6, 12))
    assert row("nightly").nominal == day(7)
    first = backfill(queue.store, "nightly", utc(day(1)), utc(day(8)), now=day(6, 12))
    assert instants(first, "created") == [day(1), day(3), day(4), day(5), day(6)]
    assert [(i.instance.replace(tzinfo=None), i.task_id) for i in first["existing"]] == [
        (day(2), caught_up)]      # the run-now task is no instance
    assert instants(first, "upcoming") == [day(7), day(8)]     # the scheduler's to create
    for instance in first["created"]:
        task, nominal = Task.get_by_id(instance.task_id), instance.instance.replace(tzinfo=None)
        assert task.scheduled_on == instance.scheduled_on.replace(tzinfo=None) == \
            nominal + jitter_offset("nightly", nominal, 1800)
        assert task.queued_by == "periodic:nightly (backfill)"
    again = backfill(queue.store, "nightly", utc(day(1)), utc(day(8)), now=day(6, 12))
    assert again["created"] == [] and len(again["existing"]) == 6
    # Each calendar time has one task (the run-now one aside), and the scheduler's next
    # instance is still its own (once the run-now task, its previous one, has finished).
    assert len(tasks_of("nightly")) == 7
    queue.run_pending()
    [next_one] = scheduler.run_pending(now=row("nightly").nextrun)["submitted"]
    assert Task.get_by_id(next_one).scheduled_on == row("nightly").last_due
    queue.close()


def test_backfill_of_an_every_timer_follows_its_grid_and_of_a_disabled_one_stops_at_now(queue):
    add_periodic(queue.store, "grid", ECHO, "every 15min", now=T0)     # due 12:15, 12:30, ...
    set_enabled(queue.store, "grid", False, now=T0)
    outcome = backfill(queue.store, "grid", utc(T0), utc(T0 + timedelta(hours=1)),
                       now=T0 + timedelta(minutes=40))
    assert instants(outcome, "created") == [T0, T0 + timedelta(minutes=15),
                                            T0 + timedelta(minutes=30)]
    assert instants(outcome, "upcoming") == [T0 + timedelta(minutes=45), T0 + timedelta(hours=1)]


@pytest.mark.parametrize("arguments, fragment", [
    (("nope", day(1), day(2)), "no periodic task named 'nope'"),
    (("nightly", day(3), day(2)), "is after to"),
    (("nightly", datetime(2020, 1, 1), day(2)), "more than 1000 calendar times"),
    (("after", day(1), day(2)), "'after SPAN' timer has no calendar times"),
])
def test_a_bad_backfill_is_refused_and_creates_nothing(queue, arguments, fragment):
    add_periodic(queue.store, "nightly", ECHO, NIGHTLY, now=T0)
    add_periodic(queue.store, "after", ECHO, "after 1h", now=T0)
    name, start, end = arguments
    with pytest.raises(InputError, match=re.escape(fragment)):
        backfill(queue.store, name, utc(start), utc(end), now=day(10))
    assert Task.select().count() == 0


def test_cli_periodic_backfill_prints_what_it_created_and_refuses_bad_input(sqlite_db):
    url = sqlite_db.url
    queue = sqlite_db.queue()
    ok(taskrunner("periodic", "add", "nightly", ECHO, NIGHTLY, url=url))
    for args, fragment in (
            (["nope", "--from", "2024-01-01T00:00Z", "--to", "2024-01-05T00:00Z"],
             "no periodic task named 'nope'"),
            (["nightly", "--from", "2024-01-05T00:00Z", "--to", "2024-01-01T00:00Z"],
             "is after to"),
            (["nightly", "--from", "2020-01-01T00:00Z", "--to", "2024-01-01T00:00Z"],
             "more than 1000 calendar times"),
            (["nightly", "--from", "2024-01-01T00:00Z", "--to", "2024-01-05T00:00Z",
              "--max", "3"], "more than 3 calendar times"),
            (["nightly", "--from", "monday", "--to", "2024-01-05T00:00Z"],
             "invalid ISO 8601 time"),
            (["nightly", "--to", "2024-01-05T00:00Z"], "--from")):
        usage_error(taskrunner("periodic", "backfill", *args, url=url), fragment)
    assert Task.select().count() == 0
    out = ok(taskrunner("periodic", "backfill", "nightly", "--from", "2024-01-01T00:00Z",
                        "--to", "2024-01-04T00:00Z", url=url))
    assert out.splitlines()[0] == "periodic task 'nightly': 3 created, 0 existing, 0 upcoming"
    assert len(re.findall(r"\bcreated\b", out)) == 4
    shown = json.loads(ok(taskrunner("periodic", "backfill", "nightly", "--from",
                                     "2024-01-01T00:00Z", "--to", "2024-01-04T03:00Z", "--json",
                                     url=url)))
    assert [i["instance"] for i in shown["created"]] == ["2024-01-04T03:00:00+00:00"]
    assert [i["instance"] for i in shown["existing"]] == [
        "2024-01-0%dT03:00:00+00:00" % n for n in (1, 2, 3)]
    assert shown["upcoming"] == [] and shown["name"] == "nightly"
    assert set(shown["created"][0]) == {"instance", "scheduled_on", "task_id"}
    wide = json.loads(ok(taskrunner("periodic", "backfill", "nightly", "--from",
                                    "2020-01-01T00:00Z", "--to", "2021-01-01T00:00Z", "--max",
                                    "400", "--json", url=url)))
    assert len(wide["created"]) == 366
    queue.close()


def _backfill_at_once(url, barrier, results, start, end):
    """A forked process: its own queue, then backfill when the other one does."""
    queue = TaskQueue(url)
    barrier.wait(timeout=60)
    outcome = backfill(queue.store, "hourly", start, end)
    results.put([i.instance.isoformat() for i in outcome["created"]])
    queue.close()


@pytest.mark.timeout(180)
def test_two_backfills_at_once_create_each_instance_once(database):
    queue = database.queue()
    add_periodic(queue.store, "hourly", ECHO, "hourly UTC", jitter="20min")
    context = multiprocessing.get_context("fork")
    for round_ in range(2):
        start = datetime(2024, 1, 1 + 10 * round_, tzinfo=timezone.utc)
        end = start + timedelta(hours=199)
        barrier, results = context.Barrier(2), context.Queue()
        workers = [context.Process(target=_backfill_at_once,
                                   args=(database.url, barrier, results, start, end))
                   for _ in range(2)]
        for worker in workers:
            worker.start()
        created = [results.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(60)
            assert worker.exitcode == 0
        assert sorted(created[0] + created[1]) == [
            (start + timedelta(hours=h)).isoformat() for h in range(200)]
    per_instance = Counter(t.scheduled_on.replace(minute=0, second=0)
                           for t in tasks_of("hourly"))
    assert len(per_instance) == 400 and set(per_instance.values()) == {1}
    queue.close()


# == the dashboard and the migration =========================================================

@pytest.mark.timeout(120)
def test_dashboard_shows_the_jitter_and_its_backfill_form_creates_instances(sqlite_db):
    from dashboard_helpers import Served, fetch
    from test_dashboard import notice_of
    queue = sqlite_db.queue()
    add_periodic(queue.store, "nightly", ECHO, NIGHTLY, jitter="30min")
    served = Served(queue.store)
    try:
        page = fetch(served.url + "/periodic")[1]
        assert "jitter 30 min 0 s" in page and 'action="/periodic/backfill"' in page
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        form = {"name": "nightly", "from": "2024-01-01T00:00Z", "to": "2024-01-03T00:00Z"}
        assert fetch(served.url + "/periodic/backfill",
                     data=urlencode(dict(form, csrf="x")))[0] == 403
        status, _, headers = fetch(served.url + "/periodic/backfill",
                                   data=urlencode(dict(form, csrf=token, to="then")))
        assert status == 303 and "nothing created" in notice_of(headers)
        assert Task.select().count() == 0
        status, _, headers = fetch(served.url + "/periodic/backfill",
                                   data=urlencode(dict(form, csrf=token)))
        assert status == 303 and "2 created, 0 existing" in notice_of(headers)
        status, _, headers = fetch(served.url + "/periodic/alter",
                                   data=urlencode({"name": "nightly", "jitter": "5min",
                                                   "csrf": token}))
        assert status == 303 and row("nightly").jitter == 300
    finally:
        served.stop()
        queue.close()


@pytest.mark.timeout(120)
def test_migration_0027_leaves_existing_periodic_tasks_without_jitter(database):
    queue = database.queue()
    add_periodic(queue.store, "nightly", ECHO, NIGHTLY, now=T0)
    db = queue.store.db
    for column in ("jitter", "nominal"):
        db.execute_sql("ALTER TABLE periodic_tasks DROP COLUMN %s" % column)
    db.execute_sql("DELETE FROM taskrunner_migrations WHERE name = '0027_periodic_jitter'")
    assert queue.store.migrate() == ["0027_periodic_jitter"]
    migrated = row("nightly")
    assert (migrated.jitter, migrated.nominal, migrated.nextrun) == (None, None, day(2))
    [task_id] = PeriodicScheduler(queue.store).run_pending(now=day(2))["submitted"]
    assert Task.get_by_id(task_id).scheduled_on == day(2)
    alter_periodic(queue.store, "nightly", jitter="1h", now=T0)
    assert row("nightly").nextrun == day(3) + jitter_offset("nightly", day(3), 3600)
    queue.close()
