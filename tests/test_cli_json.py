"""``--json`` on the commands that printed text only: ``add``, ``check``, ``queue
pause|resume`` and every ``run-event``. Each output is parsed and its fields compared with
what the database holds."""
import json
from datetime import timedelta, timezone

import pytest

from conftest import Database, ok, taskrunner, wait_for
from taskrunner.runs import lifecycle
from taskrunner.fleet import liveness
from taskrunner.store.models import (RUNNING, SCHEDULED, SUCCESS, TIMEOUT, PeriodicTask, Queue,
                                     Run, Runner, Task, utcnow)
from taskrunner.periodic.scheduler import add_periodic

ECHO = "taskrunner.handlers.Echo"


def as_json(result):
    return json.loads(ok(result))


def test_add_json_prints_the_id_and_says_when_a_unique_key_found_a_live_task(sqlite_db):
    url = sqlite_db.url
    first = as_json(taskrunner("add", ECHO, "--unique-key", "k1", "--json", url=url))
    assert first == {"id": first["id"], "existed": False}
    again = as_json(taskrunner("add", ECHO, "--unique-key", "k1", "--data", '{"n": 2}',
                               "--json", url=url))
    assert again == {"id": first["id"], "existed": True}
    plain = as_json(taskrunner("add", ECHO, "--data", '{"n": 3}', "--json", url=url))
    assert plain["existed"] is False and plain["id"] != first["id"]
    # Without --json the id alone, as before, for a hit too.
    assert ok(taskrunner("add", ECHO, "--unique-key", "k1", url=url)) == "%d\n" % first["id"]
    queue = sqlite_db.queue()
    try:
        assert [(t.id, t.unique_key, json.loads(t.data)) for t in
                Task.select().order_by(Task.id)] == [(first["id"], "k1", None),
                                                     (plain["id"], None, {"n": 3})]
        assert queue.run_pending() == 2           # both end: the key is free again
        later = as_json(taskrunner("add", ECHO, "--unique-key", "k1", "--json", url=url))
        assert later["existed"] is False and later["id"] not in (first["id"], plain["id"])
        assert Task.get_by_id(later["id"]).unique_key == "k1"
    finally:
        queue.close()


def test_check_json_gives_the_summary_as_an_object(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "taskrunner.toml")
    queue = sqlite_db.queue()
    try:
        failing = queue.add_task("sample_handlers.Boom", max_retries=3)
        assert queue.run_pending() == 1           # fails once: retrying
        queue.add_tasks([{"handler": ECHO}, {"handler": ECHO}])
        runner = liveness.register(queue.store)
        out = as_json(taskrunner("check", "--json", config=config))
        assert out == {"ok": True, "database": sqlite_db.url, "backend": "sqlite",
                       "config": config, "runners_running": 1, "runs_waiting": 2,
                       "tasks_retrying": 1, "warnings": []}
        assert out["runners_running"] == Runner.select().where(
            Runner.status == RUNNING).count()
        assert out["runs_waiting"] == Run.select().where(Run.status == SCHEDULED).count()
        assert Task.get_by_id(failing).finished_on is None
        liveness.retire(queue.store, runner.id, "done")
    finally:
        queue.close()


@pytest.fixture
def pg_db(tmp_path):
    database = Database("postgresql", tmp_path)
    yield database
    database.drop()


def test_check_json_masks_the_password_of_a_postgresql_url(pg_db, tmp_path):
    password = "Pa55-w0rd-x9"
    url = pg_db.url.replace("://postgres@", "://postgres:%s@" % password, 1)
    assert password in url                     # the server trusts: any password connects
    result = taskrunner("check", "--json", url=url)
    out = as_json(result)
    assert out["database"] == url.replace(password, "***")
    assert out["backend"] == "postgresql" and out["ok"] is True
    assert (out["runners_running"], out["runs_waiting"], out["tasks_retrying"]) == (0, 0, 0)
    assert password not in result.stdout + result.stderr


def test_queue_pause_and_resume_json_say_the_state_and_whether_it_changed(sqlite_db):
    url = sqlite_db.url
    queue = sqlite_db.queue()
    queue.add_task("taskrunner.handlers.Echo", queue="reports")
    try:
        def paused():
            return Queue.get(Queue.name == "reports").paused
        for action, state in (("pause", True), ("resume", False)):
            out = as_json(taskrunner("queue", action, "reports", "--json", url=url))
            assert out == {"queue": "reports", "paused": state, "changed": True}
            assert paused() is state
            out = as_json(taskrunner("queue", action, "reports", "--json", url=url))
            assert out == {"queue": "reports", "paused": state, "changed": False}
            assert paused() is state
    finally:
        queue.close()


def test_run_event_on_process_json_names_dead_runners_timed_out_runs_and_runs_created(sqlite_db):
    queue = sqlite_db.queue()
    try:
        alive = liveness.register(queue.store).id
        dead = liveness.register(queue.store).id
        Runner.update(boot_id="an-earlier-boot").where(Runner.id == dead).execute()
        overdue = queue.add_task(ECHO, run_timeout=1)
        claimed = lifecycle.claim(queue.store, alive)
        assert claimed.task_id == overdue
        Run.update(updated_on=utcnow() - timedelta(minutes=5)).where(
            Run.id == claimed.run_id).execute()
        due_at = utcnow() + timedelta(seconds=0.3)
        delayed = queue.add_task(ECHO, scheduled_on=due_at.replace(tzinfo=timezone.utc))
        assert Run.select().where(Run.task_id == delayed).count() == 0
        wait_for(lambda: utcnow() > due_at, timeout=5, message="the task to be due")
        out = as_json(taskrunner("run-event", "task-queue:OnProcess", "--json",
                                 url=sqlite_db.url))
        assert out == {"event": "task-queue:OnProcess", "dead_runners": [dead],
                       "timed_out_runs": [{"run_id": claimed.run_id, "runner_id": alive}],
                       "created_runs": 1}
        assert Runner.get_by_id(dead).status != RUNNING
        assert Runner.get_by_id(alive).status == RUNNING
        assert Run.get_by_id(claimed.run_id).status == TIMEOUT
        assert [r.status for r in Run.select().where(Run.task_id == delayed)] == [SCHEDULED]
        liveness.retire(queue.store, alive, "done")
    finally:
        queue.close()


def test_run_event_on_rotate_json_counts_the_rows_deleted(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "c.toml", "[rotation]\nkeep_success = 0\n")
    queue = sqlite_db.queue()
    try:
        queue.add_tasks([{"handler": ECHO}, {"handler": ECHO}])
        assert queue.run_pending() == 2
        kept = queue.add_task("sample_handlers.Boom", max_retries=5)
        out = as_json(taskrunner("run-event", "task-queue:OnRotate", "--json", config=config))
        assert out == {"event": "task-queue:OnRotate",
                       "deleted": {"success": 2, "failed": 0, "runners": 0}}
        assert [t.id for t in Task.select()] == [kept]
    finally:
        queue.close()


def test_run_event_periodic_json_lists_the_tasks_submitted(sqlite_db):
    queue = sqlite_db.queue()
    try:
        add_periodic(queue.store, "hourly", ECHO, "every 1h",
                     now=utcnow() - timedelta(hours=1, seconds=1))
        out = as_json(taskrunner("run-event", "periodic-task:OnProcess", "--json",
                                 url=sqlite_db.url))
        assert set(out) == {"event", "submitted", "skipped"}
        assert out["event"] == "periodic-task:OnProcess" and out["skipped"] == []
        names = {p.id: p.name for p in PeriodicTask.select()}
        submitted = {t.id: names[t.periodic_task_id] for t in Task.select().where(
            Task.periodic_task_id.is_null(False))}
        assert sorted(out["submitted"]) == sorted(submitted)
        assert "hourly" in submitted.values()
    finally:
        queue.close()


@pytest.mark.timeout(120)
def test_run_event_runner_json_counts_its_runs_or_says_why_it_did_not_start(sqlite_db,
                                                                            tmp_path):
    config = sqlite_db.write_config(tmp_path / "c.toml", "[runner]\nmax_runs = 1\n"
                                    "[queues.reports]\nlimit = 1\n")
    queue = sqlite_db.queue(queues={"reports": {"limit": 1}})
    try:
        task_id = queue.add_task(ECHO, {"n": 1})
        out = as_json(taskrunner("run-event", "task-runner:OnProcess", "--json",
                                 config=config))
        assert out == {"event": "task-runner:OnProcess", "runs": 1, "refused": None}
        assert Task.get_by_id(task_id).last_status == SUCCESS
        assert Runner.select().where(Runner.status == RUNNING).count() == 0
        holder = liveness.register(queue.store, serving=("reports",))
        result = taskrunner("run-event", "task-runner:OnProcess", "--queue", "reports",
                            "--json", config=config)
        out = as_json(result)
        assert out["runs"] == 0 and "reports" in out["refused"], out
        assert [r.id for r in Runner.select().where(Runner.status == RUNNING)] == [holder.id]
        liveness.retire(queue.store, holder.id, "done")
    finally:
        queue.close()


# Commands whose output is not a summary: foreground processes that log on stderr, the web
# server, and the Prometheus text format (`status --json` has the same figures).
NO_JSON = {"overseer", "runner", "dashboard", "metrics"}


def _commands(parser, prefix=()):
    """(command words, its parser) for every leaf command of the CLI."""
    import argparse
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield prefix, parser
        return
    for name, sub in subparsers[0].choices.items():
        yield from _commands(sub, prefix + (name,))


def test_every_command_that_prints_a_summary_takes_json():
    from taskrunner.cli.commands import build_parser
    commands = dict(_commands(build_parser()))
    assert ("queue", "pause") in commands and ("periodic", "list") in commands
    lacking = [" ".join(words) for words, parser in commands.items()
               if words[0] not in NO_JSON and not any(
                   "--json" in action.option_strings for action in parser._actions)]
    assert lacking == []
