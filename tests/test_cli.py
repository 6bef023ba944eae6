"""The `taskrunner` command, run for real as a subprocess: exit codes (0 ok, 1 runtime
failure, 2 usage/config/input error with one line on stderr and nothing changed), the
happy paths, the JSON outputs and the environment variables."""
import json
import os
import stat
from datetime import datetime, timedelta, timezone

import pytest

from taskrunner.fleet import liveness
from taskrunner.runs import lifecycle
from taskrunner import TaskQueue
from taskrunner.store.models import RUNNING, SCHEDULED, SUCCESS

from conftest import REPO_DIR, TESTS_DIR, ok, runs_of, spawn, stop_process, taskrunner, usage_error, wait_for

ECHO = "taskrunner.handlers.Echo"
TASK_FIELDS = {"id", "handler", "data", "status", "given_up", "priority", "queued_on",
               "queued_by", "scheduled_on", "next_run_on", "finished_on", "runs", "runs_failed",
               "max_retries", "run_timeout", "max_runtime", "unique_key", "last_error_code",
               "last_error_message"}
RUN_FIELDS = {"id", "task_id", "attempt", "status", "runner_id", "percent_completed",
              "created_on", "started_on", "updated_on", "finished_on", "duration", "results",
              "error_code", "error_message"}
RUNNER_FIELDS = {"id", "kind", "host", "pid", "state", "run_id", "task_id", "progress",
                 "rss_mb", "runs_done", "started_on", "heartbeat_on"}




def added_id(result):
    out = ok(result).strip()
    assert out.isdigit(), out
    return int(out)


def as_json(result):
    return json.loads(ok(result))


def snapshot(db):
    """Every task and run, read through the queue API: what "nothing changed" compares."""
    q = db.queue()
    try:
        tasks = q.tasks(limit=10000)
        return ([(t.id, t.handler, t.status, t.runs_failed, t.next_run_on, t.finished_on)
                 for t in tasks],
                [(r.id, r.task_id, r.status) for t in tasks for r in q.runs_of(t.id)])
    finally:
        q.close()


def seeded(db):
    """One existing task with a scheduled run, so "nothing changed" is not about an empty
    database; returns (task_id, snapshot)."""
    q = db.queue()
    try:
        task_id = q.add_task(ECHO, data={"seed": True})
    finally:
        q.close()
    before = snapshot(db)
    assert len(before[0]) == 1 and len(before[1]) == 1
    return task_id, before


def aware(text):
    value = datetime.fromisoformat(text)
    assert value.tzinfo is not None, text
    return value


# -- exit 2: refused input, nothing stored ---------------------------------------------------

REFUSED_ADDS = [
    ("module-missing", ["no_such_module_tr.Handler"], "", "cannot be imported"),
    ("class-missing", ["sample_handlers.NoSuchHandler"], "", "has no 'NoSuchHandler'"),
    ("not-a-taskhandler", ["sample_handlers.NotAHandler"], "", "not a TaskHandler"),
    ("invalid-dotted-path", ["Echo"], "", "dotted path"),
    ("invalid-json", [ECHO, "--data", "{'single': 'quotes'}"], "", "invalid JSON"),
    ("data-over-max-size", [ECHO, "--data", json.dumps({"text": "x" * 100})],
     "[task]\nmax_data_size = 64\n", "max_data_size"),
]


@pytest.mark.parametrize("args,config_text,fragment", [c[1:] for c in REFUSED_ADDS],
                         ids=[c[0] for c in REFUSED_ADDS])
def test_refused_add_exits_2_with_one_line_and_stores_nothing(database, tmp_path, args,
                                                              config_text, fragment):
    config = database.write_config(tmp_path / "taskrunner.toml", config_text)
    _, before = seeded(database)
    usage_error(taskrunner("add", *args, config=config), fragment)
    assert snapshot(database) == before


def test_handler_outside_the_allow_list_is_refused_without_importing_it(database, tmp_path):
    marker = tmp_path / "imported.marker"
    (tmp_path / "tr_untrusted_mod.py").write_text(
        "open(%r, 'w').close()\n"
        "from taskrunner import TaskHandler\n"
        "class Job(TaskHandler):\n"
        "    def handle(self, run):\n"
        "        pass\n" % str(marker))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), TESTS_DIR, REPO_DIR])}
    restricted = database.write_config(
        tmp_path / "restricted.toml",
        '[handlers]\nallow = ["taskrunner.handlers.*", "sample_*.Rec*"]\n')
    _, before = seeded(database)

    usage_error(taskrunner("add", "tr_untrusted_mod.Job", config=restricted, env=env),
                "not allowed", "tr_untrusted_mod.Job")
    assert not marker.exists(), "a disallowed handler's module was imported"
    assert snapshot(database) == before

    # The glob patterns do allow what they match...
    added_id(taskrunner("add", "sample_handlers.Record", "--data", '{"log": "x"}',
                        config=restricted, env=env))
    # ...and the marker does catch an import (so its absence above means something).
    permissive = database.write_config(tmp_path / "permissive.toml",
                                       '[handlers]\nallow = ["tr_untrusted_*"]\n')
    added_id(taskrunner("add", "tr_untrusted_mod.Job", config=permissive, env=env))
    assert marker.exists()


def test_refused_add_on_a_new_sqlite_database_creates_no_file(tmp_path):
    path = tmp_path / "new.db"
    usage_error(taskrunner("add", "sample_handlers.NotAHandler", url="sqlite:///%s" % path),
                "not a TaskHandler")
    assert not path.exists()


@pytest.mark.parametrize("command", ["show", "runs", "retry", "cancel"])
def test_unknown_task_id_exits_2_and_changes_nothing(sqlite_db, command):
    _, before = seeded(sqlite_db)
    usage_error(taskrunner(command, "424242", url=sqlite_db.url), "no task with id 424242")
    assert snapshot(sqlite_db) == before


@pytest.mark.parametrize("command", ["show", "cancel"])
def test_a_task_id_no_database_can_hold_exits_2(sqlite_db, command):
    _, before = seeded(sqlite_db)
    usage_error(taskrunner(command, "9" * 20, url=sqlite_db.url), command, "no task can have id")
    assert snapshot(sqlite_db) == before


@pytest.mark.parametrize("command", ["show", "retry"])
def test_non_integer_task_id_exits_2(sqlite_db, command):
    _, before = seeded(sqlite_db)
    usage_error(taskrunner(command, "1x", url=sqlite_db.url), command, "invalid int value")
    assert snapshot(sqlite_db) == before


BAD_WHEN = [
    ("at-not-a-time", ["--at", "next tuesday"], "invalid ISO 8601 time"),
    ("at-out-of-range", ["--at", "9999-12-31T23:59:59-05:00"], "invalid ISO 8601 time"),
    ("in-not-a-number", ["--in", "soon"], "positive number of seconds"),
    ("in-negative", ["--in", "-5"], "positive number of seconds"),
    ("in-nan", ["--in", "nan"], "positive number of seconds"),
    ("in-too-far", ["--in", "1e12"], "too far"),
    ("timeout-too-long", ["--timeout", "1e300"], "at most 100 years"),
    ("max-runtime-inf", ["--max-runtime", "inf"], "positive number of seconds"),
    ("at-and-in", ["--at", "2030-01-01T00:00:00+00:00", "--in", "5"], "not allowed with"),
]


@pytest.mark.parametrize("args,fragment", [c[1:] for c in BAD_WHEN], ids=[c[0] for c in BAD_WHEN])
def test_add_with_a_bad_time_exits_2_and_stores_nothing(sqlite_db, args, fragment):
    _, before = seeded(sqlite_db)
    usage_error(taskrunner("add", ECHO, *args, url=sqlite_db.url), fragment)
    assert snapshot(sqlite_db) == before


BAD_CONFIGS = [
    # (id, file text or None for no file, fragments besides the path)
    ("missing-file", None, ["not found"]),
    ("invalid-toml", "[runner\nlimit = 2\n", ["invalid TOML"]),
    ("unknown-section", "[runners]\nlimit = 2\n", ["unknown section", "[runners]"]),
    ("unknown-key", "[runner]\nlimitt = 2\n", ["unknown key", "limitt"]),
    ("wrong-type", '[runner]\nlimit = "eight"\n', ["[runner]", "limit"]),
    ("nan-duration", "[overseer]\ncheck_interval = nan\n", ["check_interval", "not a time span"]),
]


@pytest.mark.parametrize("text,fragments", [c[1:] for c in BAD_CONFIGS],
                         ids=[c[0] for c in BAD_CONFIGS])
def test_config_error_exits_2_naming_the_file_and_stores_nothing(sqlite_db, tmp_path, text,
                                                                fragments):
    path = tmp_path / "taskrunner.toml"
    if text is not None:
        path.write_text(text)
    _, before = seeded(sqlite_db)
    usage_error(taskrunner("add", ECHO, config=str(path), url=sqlite_db.url),
                str(path), *fragments)
    assert snapshot(sqlite_db) == before


def test_config_path_that_is_a_directory_exits_2(sqlite_db, tmp_path):
    usage_error(taskrunner("check", config=str(tmp_path), url=sqlite_db.url),
                str(tmp_path), "cannot read")


def test_unreadable_config_file_exits_2(sqlite_db, tmp_path):
    path = tmp_path / "taskrunner.toml"
    path.write_text("[runner]\nlimit = 2\n")
    os.chmod(path, 0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("this user (root?) can read a mode-000 file")
        usage_error(taskrunner("check", config=str(path), url=sqlite_db.url),
                    str(path), "cannot read")
    finally:
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


@pytest.mark.parametrize("url,shown", [
    ("postgresql://postgres:s3cret@127.0.0.1:1/db", "postgresql://postgres:***@127.0.0.1:1/db"),
    ("mysql://root:s3cret@127.0.0.1:1/db", "mysql://root:***@127.0.0.1:1/db"),
], ids=["postgresql", "mysql"])
def test_unreachable_database_exits_2_with_the_password_masked(url, shown):
    result = taskrunner("add", ECHO, url=url)
    usage_error(result, "cannot connect", shown)
    assert "s3cret" not in result.stdout + result.stderr


def test_database_url_from_the_environment_is_masked_too():
    result = taskrunner("check", env={
        "TASKRUNNER_DATABASE_URL": "postgresql://postgres:s3cret@127.0.0.1:1/db"})
    usage_error(result, "postgresql://postgres:***@127.0.0.1:1/db")
    assert "s3cret" not in result.stdout + result.stderr


def test_unsupported_url_scheme_exits_2():
    result = taskrunner("check", url="redis://:s3cret@127.0.0.1/0")
    usage_error(result, "unsupported database URL", "redis://")
    assert "s3cret" not in result.stdout + result.stderr


def test_cancel_of_a_running_task_asks_its_run_to_stop(database):
    q = database.queue()
    try:
        task_id = q.add_task(ECHO)
        claimed = lifecycle.claim(q.store, runner_id=liveness.register(q.store).id)
        assert claimed.task_id == task_id
    finally:
        q.close()
    out = ok(taskrunner("cancel", str(task_id), url=database.url))
    assert out == "task %d: its run %d is asked to stop; the task ends cancelled when it " \
        "does\n" % (task_id, claimed.run_id)
    assert snapshot(database)[0][0][2] == RUNNING    # until its runner has stopped it
    runs = ok(taskrunner("runs", str(task_id), url=database.url)).splitlines()
    assert runs[1].split()[:3] == [str(claimed.run_id), "1", "stopping"]
    [run] = json.loads(ok(taskrunner("runs", str(task_id), "--json", url=database.url)))
    assert run["status"] == RUNNING and run["cancel_requested_on"].endswith("+00:00")
    assert (run["stopping_reason"], run["stopping_since"]) == ("cancelled by an operator",
                                                               run["cancel_requested_on"])
    assert "run %d stopping since " % claimed.run_id in runs[3]   # after the table and its zone line


def test_retry_of_a_successful_task_is_refused(database):
    q = database.queue()
    try:
        task_id = q.add_task(ECHO)
        assert q.run_pending() == 1
    finally:
        q.close()
    before = snapshot(database)
    assert before[0][0][2] == SUCCESS
    usage_error(taskrunner("retry", str(task_id), url=database.url), "success")
    assert snapshot(database) == before


def test_unknown_run_event_exits_2(sqlite_db):
    """Not quoted: with the event left out, the password stands where the event goes."""
    result = taskrunner("run-event", "bogus:Thing", url=sqlite_db.url)
    usage_error(result, "expected UNIT:EVENT", "task-queue:OnProcess")
    assert "bogus:Thing" not in result.stderr


def test_no_command_exits_2():
    usage_error(taskrunner(), "required")


# -- happy paths -----------------------------------------------------------------------------

def test_add_runner_and_json_outputs_give_a_dashboard_what_it_needs(database):
    url = database.url
    data = {"n": 1, "text": "héllo"}
    echo_id = added_id(taskrunner("add", ECHO, "--data", json.dumps(data), url=url))
    fail_id = added_id(taskrunner("add", "taskrunner.handlers.Fail", "--max-retries", "1",
                                  "--data", '{"code": "Nope", "message": "no luck"}', url=url))
    q = database.queue()  # the CLI wrote to this very database
    try:
        assert [t.id for t in q.tasks()] == [fail_id, echo_id]
    finally:
        q.close()

    # A failing handler's traceback is logged (WARNING): no ok(), which forbids one.
    burst = taskrunner("runner", "--burst", url=url)
    assert burst.returncode == 0, burst.stderr

    task = as_json(taskrunner("show", str(echo_id), "--json", url=url))
    assert TASK_FIELDS <= set(task)
    assert (task["id"], task["handler"], task["data"]) == (echo_id, ECHO, data)
    assert (task["status"], task["given_up"], task["runs"]) == (SUCCESS, False, 1)
    assert aware(task["finished_on"]) >= aware(task["queued_on"])

    runs = as_json(taskrunner("runs", str(echo_id), "--json", url=url))
    assert len(runs) == 1 and RUN_FIELDS <= set(runs[0])
    run = runs[0]
    assert (run["task_id"], run["attempt"], run["status"]) == (echo_id, 1, SUCCESS)
    assert run["results"] == data and run["percent_completed"] == 100
    assert run["error_code"] is None and run["runner_id"] is not None
    assert run["duration"] >= 0
    assert aware(run["finished_on"]) >= aware(run["started_on"])

    tasks = as_json(taskrunner("tasks", "--json", url=url))
    assert [t["id"] for t in tasks] == [fail_id, echo_id]
    failed = tasks[0]
    assert (failed["status"], failed["given_up"], failed["runs_failed"]) == ("given-up", True, 1)
    assert (failed["last_error_code"], failed["last_error_message"]) == ("Nope", "no luck")

    given_up = as_json(taskrunner("tasks", "--status", "given-up", "--json", url=url))
    assert [t["id"] for t in given_up] == [fail_id]

    status = as_json(taskrunner("status", "--json", url=url))
    assert status["database"] == url
    assert status["runners"] == []  # the burst runner has exited
    # The words of the dashboard and the metrics: a task that failed for good is given-up.
    assert {k: n for k, n in status["tasks"].items() if n} == {"success": 1, "given-up": 1}


def test_status_json_shows_a_running_runner_and_its_run(sqlite_db, tmp_path):
    log = str(tmp_path / "started")
    q = sqlite_db.queue()
    try:
        task_id = q.add_task("sample_handlers.Started", data={"log": log, "sleep": 60})
    finally:
        q.close()
    proc = spawn("runner", url=sqlite_db.url)
    try:
        wait_for(lambda: os.path.exists(log + ".started"), message="the run to start")
        status = as_json(taskrunner("status", "--json", url=sqlite_db.url))
        assert len(status["runners"]) == 1
        runner = status["runners"][0]
        assert RUNNER_FIELDS <= set(runner)
        assert (runner["kind"], runner["pid"], runner["state"]) == ("runner", proc.pid, RUNNING)
        assert runner["task_id"] == task_id and runner["run_id"] is not None
        aware(runner["heartbeat_on"])
        assert {k: n for k, n in status["tasks"].items() if n} == {RUNNING: 1}
    finally:
        stop_process(proc)


def test_add_in_makes_a_delayed_task_with_no_run_yet(sqlite_db):
    before = datetime.now(timezone.utc)
    task_id = added_id(taskrunner("add", ECHO, "--in", "3600", url=sqlite_db.url))
    assert as_json(taskrunner("runs", str(task_id), "--json", url=sqlite_db.url)) == []
    task = sqlite_db.queue().get_task(task_id)
    assert task.status == SCHEDULED
    assert before + timedelta(seconds=3600) <= task.next_run_on \
        <= datetime.now(timezone.utc) + timedelta(seconds=3600)
    assert task.scheduled_on == task.next_run_on


def test_add_at_takes_an_iso_time_with_offset(sqlite_db):
    future = added_id(taskrunner("add", ECHO, "--at", "2030-06-01T12:00:00+02:00",
                                 url=sqlite_db.url))
    past = added_id(taskrunner("add", ECHO, "--at", "2020-01-01T00:00:00+05:30",
                               url=sqlite_db.url))
    q = sqlite_db.queue()
    assert q.get_task(future).scheduled_on == datetime(2030, 6, 1, 10, 0, tzinfo=timezone.utc)
    assert q.runs_of(future) == []
    assert q.get_task(past).scheduled_on == datetime(2019, 12, 31, 18, 30, tzinfo=timezone.utc)
    assert [r.status for r in q.runs_of(past)] == [SCHEDULED]  # already due: a run at once


def test_add_options_are_stored_on_the_task(sqlite_db):
    task_id = added_id(taskrunner(
        "add", ECHO, "--priority", "7", "--max-retries", "2", "--timeout", "30",
        "--max-runtime", "90", "--queued-by", "alice", url=sqlite_db.url))
    q = sqlite_db.queue()
    task = q.get_task(task_id)
    assert (task.priority, task.max_retries, task.run_timeout, task.max_runtime, task.queued_by) \
        == (7, 2, 30.0, 90.0, "alice")
    assert [r.priority for r in runs_of(task_id)] == [7]   # copied onto the run for the claim


def test_second_add_with_the_same_unique_key_prints_the_same_id(sqlite_db):
    first = added_id(taskrunner("add", ECHO, "--unique-key", "digest:1", url=sqlite_db.url))
    again = added_id(taskrunner("add", ECHO, "--unique-key", "digest:1", url=sqlite_db.url))
    other = added_id(taskrunner("add", ECHO, "--unique-key", "digest:2", url=sqlite_db.url))
    assert again == first and other != first
    assert sorted(t.id for t in sqlite_db.queue().tasks()) == sorted([first, other])


def test_cancel_of_a_scheduled_task_cancels_it_and_its_run(sqlite_db):
    q = sqlite_db.queue()
    try:
        task_id = q.add_task(ECHO)
    finally:
        q.close()
    assert "cancelled" in ok(taskrunner("cancel", str(task_id), url=sqlite_db.url))
    q = sqlite_db.queue()
    assert q.get_task(task_id).status == "cancelled"
    assert [r.status for r in q.runs_of(task_id)] == ["cancelled"]
    q.close()


def test_retry_re_arms_a_given_up_task(sqlite_db):
    q = sqlite_db.queue()
    try:
        task_id = q.add_task("taskrunner.handlers.Fail", max_retries=1)
        assert q.run_pending() == 1
        assert q.get_task(task_id).given_up
    finally:
        q.close()
    assert "re-armed" in ok(taskrunner("retry", str(task_id), url=sqlite_db.url))
    q = sqlite_db.queue()
    task = q.get_task(task_id)
    assert not task.given_up and task.runs_failed == 0 and task.status == SCHEDULED
    assert [r.status for r in q.runs_of(task_id)] == ["error", SCHEDULED]


def test_init_db_twice_is_harmless(tmp_path):
    url = "sqlite:///%s" % (tmp_path / "fresh.db")
    assert "up to date" in ok(taskrunner("init-db", url=url))
    q = TaskQueue(url, migrate=False)  # the schema exists without migrating here
    task_id = q.add_task(ECHO)
    q.close()
    assert "up to date" in ok(taskrunner("init-db", url=url))
    q = TaskQueue(url, migrate=False)
    assert [t.id for t in q.tasks()] == [task_id]
    q.close()


def test_check_exits_0_naming_the_database_and_the_config(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "taskrunner.toml")
    out = ok(taskrunner("check", config=config))
    assert out.startswith("ok: ") and sqlite_db.url in out and config in out


def test_rotate_exits_0_and_deletes_old_ended_tasks(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "taskrunner.toml",
                                    "[rotation]\nkeep_success = 0\n")
    q = sqlite_db.queue()
    try:
        done = q.add_task(ECHO)
        assert q.run_pending() == 1
        waiting = q.add_task(ECHO, scheduled_on=datetime(2030, 1, 1, tzinfo=timezone.utc))
    finally:
        q.close()
    assert "deleted 1 successful tasks" in ok(taskrunner("rotate", config=config))
    assert [t.id for t in sqlite_db.queue().tasks()] == [waiting]
    assert done != waiting


def test_run_event_on_process_creates_the_run_of_a_due_delayed_task(sqlite_db):
    task_id = added_id(taskrunner("add", ECHO, "--in", "1", url=sqlite_db.url))
    q = sqlite_db.queue()
    task = q.get_task(task_id)
    assert q.runs_of(task_id) == []
    q.close()
    wait_for(lambda: datetime.now(timezone.utc) > task.scheduled_on, timeout=5, message="the task to be due")
    ok(taskrunner("run-event", "task-queue:OnProcess", url=sqlite_db.url))
    q = sqlite_db.queue()
    assert [(r.status, r.attempt) for r in q.runs_of(task_id)] == [(SCHEDULED, 1)]
    assert q.get_task(task_id).next_run_on is None
    q.close()


def test_log_level_debug_logs_debug_lines(sqlite_db):
    result = taskrunner("--log-level", "debug", "check", url=sqlite_db.url)
    ok(result)
    assert " DEBUG " in result.stderr
    usage_error(taskrunner("--log-level", "loud", "check", url=sqlite_db.url), "--log-level")


# -- environment -----------------------------------------------------------------------------

def test_taskrunner_config_is_honoured(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "from-env.toml", "[task]\nmax_data_size = 64\n")
    env = {"TASKRUNNER_CONFIG": config}
    out = ok(taskrunner("check", env=env))
    assert sqlite_db.url in out and config in out
    # Its other sections apply too: the small max_data_size refuses big data.
    usage_error(taskrunner("add", ECHO, "--data", json.dumps("x" * 100), env=env),
                "max_data_size")


def test_database_option_beats_environment_beats_config_file(tmp_path):
    urls = {name: "sqlite:///%s" % (tmp_path / ("%s.db" % name))
            for name in ("file", "env", "option")}
    config = tmp_path / "taskrunner.toml"
    config.write_text('[database]\nurl = "%s"\n' % urls["file"])
    env = {"TASKRUNNER_DATABASE_URL": urls["env"]}

    assert urls["option"] in ok(taskrunner("check", config=str(config), url=urls["option"],
                                           env=env))
    assert urls["env"] in ok(taskrunner("check", config=str(config), env=env))
    assert urls["file"] in ok(taskrunner("check", config=str(config)))
    for name in urls:
        assert (tmp_path / ("%s.db" % name)).exists()


# -- exit 1: runtime failure -----------------------------------------------------------------

def test_database_failure_during_a_command_exits_1_with_one_line(sqlite_db):
    q = sqlite_db.queue()
    q.store.db.execute_sql("DROP TABLE task_queue")  # the schema says up to date; the table is gone
    q.close()
    result = taskrunner("tasks", url=sqlite_db.url)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("taskrunner: "), result.stderr
    assert "task_queue" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("entries,fragment", [
    ('[[periodic]]\nname = "ok"\nhandler = "%s"\ntimer = "daily"\n'
     '[[periodic]]\nname = "nightly"\nhandler = "%s"\ntimer = "every 5 fortnights"\n' % (ECHO, ECHO),
     '[[periodic]] #2 "nightly": invalid timer \'every 5 fortnights\''),
    ('[[periodic]]\nname = "x"\nhandler = "taskrunner.handlers.Nope"\ntimer = "daily"\n',
     '[[periodic]] #1 "x": handler \'taskrunner.handlers.Nope\' not found'),
    ('[[periodic]]\nname = "taskrunner.rotate"\nhandler = "%s"\ntimer = "daily"\n' % ECHO,
     '[[periodic]] #1 "taskrunner.rotate": names starting \'taskrunner.\' are reserved'),
    ('[[periodic]]\nname = "x"\nhandler = "%s"\ntimer = "daily"\ncatch_up = "never"\n' % ECHO,
     '[[periodic]] #1 "x": catch_up must be'),
    ('[rotation]\ntimer = "Mon..Fry"\n', "[rotation] timer: invalid timer 'Mon..Fry'"),
], ids=["timer", "handler", "reserved", "catch_up", "rotation-timer"])
def test_check_refuses_what_the_overseer_would_refuse_naming_file_and_entry(
        sqlite_db, tmp_path, entries, fragment):
    config = sqlite_db.write_config(tmp_path / "config.toml", entries)
    usage_error(taskrunner("check", config=config), config + ": " + fragment)
