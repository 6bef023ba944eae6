"""The public Python API: what `TaskQueue` offers, what it hands back, which database it
works on, and when it touches the schema."""
import dataclasses
import importlib.util
import os
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from taskrunner import InputError, RunInfo, SchemaBehind, TaskInfo, TaskQueue
from taskrunner.reads.records import PeriodicTaskInfo, RunnerInfo

from conftest import REPO_DIR, TESTS_DIR, Database, ok, process_env, taskrunner

ECHO = "taskrunner.handlers.Echo"
PUBLIC_METHODS = {"add_task", "add_tasks", "get_task", "runs_of", "tasks", "retry", "cancel",
                  "wait", "process_queue", "rotate", "run_pending", "migrate", "close",
                  "pause_queue", "resume_queue", "set_queue_limit", "remove_queue", "queues",
                  "wake",
                  "add_task_async", "add_tasks_async", "get_task_async", "runs_of_async",
                  "wait_async", "send_event", "send_event_async", "steps_of",
                  "set_rate_limit", "clear_rate_limit", "rate_limits",
                  "set_rate_limit_async", "clear_rate_limit_async", "rate_limits_async",
                  "add_workflow", "chain", "group", "workflow", "wait_workflow",
                  "cancel_workflow", "parent_results", "add_workflow_async",
                  "wait_workflow_async", "enqueue", "outcomes", "rerun_from", "reruns_of",
                  "status_of", "code_versions"}


def test_the_facade_offers_the_user_api_and_nothing_of_the_engine():
    public = {name for name in vars(TaskQueue) if not name.startswith("_")}
    assert public == PUBLIC_METHODS


def test_reads_are_plain_records_with_json_decoded_and_aware_utc_times(queue):
    task_id = queue.add_task(ECHO, data={"to": "ann", "n": [1, 2]}, queued_by="web")
    assert queue.run_pending() == 1
    task = queue.get_task(task_id)
    assert isinstance(task, TaskInfo)
    assert (task.handler, task.data, task.status, task.queued_by, task.runs) == \
        (ECHO, {"to": "ann", "n": [1, 2]}, "success", "web", 1)
    (run,) = queue.runs_of(task_id)
    assert isinstance(run, RunInfo)
    assert run.results == {"to": "ann", "n": [1, 2]}        # decoded, not JSON text
    for record in (task, run):
        for field in dataclasses.fields(record):
            value = getattr(record, field.name)
            if isinstance(value, datetime):
                assert value.utcoffset() == timedelta(0), (field.name, value)
    assert task.queued_on <= run.started_on <= run.finished_on <= datetime.now(timezone.utc)
    assert run.duration is not None and run.duration >= 0
    assert [t.id for t in queue.tasks(status="success")] == [task_id]
    with pytest.raises(InputError, match="unknown task status"):
        queue.tasks(status="finished")


def test_records_are_frozen_and_turn_into_json():
    for record in (TaskInfo, RunInfo, RunnerInfo, PeriodicTaskInfo):
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen


def test_a_naive_datetime_is_refused_and_an_aware_one_is_stored_as_that_instant(queue):
    with pytest.raises(InputError, match="timezone-aware"):
        queue.add_task(ECHO, scheduled_on=datetime(2030, 6, 1, 12, 0))
    with pytest.raises(InputError, match="timezone-aware"):
        queue.add_tasks([{"handler": ECHO, "scheduled_on": datetime(2030, 6, 1, 12, 0)}])
    assert queue.tasks() == []
    berlin = datetime(2030, 6, 1, 12, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    task_id = queue.add_task(ECHO, scheduled_on=berlin)
    assert queue.get_task(task_id).scheduled_on == datetime(2030, 6, 1, 10, 0, tzinfo=timezone.utc)


def test_the_cli_reads_a_naive_time_as_local_time_the_same_instant_the_api_stores(sqlite_db):
    """The one rule: the API takes aware datetimes only; the CLI turns a naive --at into an
    aware one in the local zone (TZ) before it reaches the API — the same instant."""
    queue = sqlite_db.queue()
    local = datetime(2030, 6, 1, 12, 0, tzinfo=ZoneInfo("America/New_York"))
    from_api = queue.add_task(ECHO, scheduled_on=local)
    result = taskrunner("add", ECHO, "--at", "2030-06-01T12:00", url=sqlite_db.url,
                        env={"TZ": "America/New_York"})
    from_cli = int(ok(result).strip())
    assert queue.get_task(from_cli).scheduled_on == queue.get_task(from_api).scheduled_on \
        == datetime(2030, 6, 1, 16, 0, tzinfo=timezone.utc)
    queue.close()


def test_two_sqlite_queues_in_one_process_each_use_their_own_file(tmp_path):
    qa = TaskQueue("sqlite:///%s" % (tmp_path / "a.db"), migrate=True)
    qb = TaskQueue("sqlite:///%s" % (tmp_path / "b.db"), migrate=True)
    a_ids = [qa.add_task(ECHO, data="a") for _ in range(3)]
    b_id = qb.add_task(ECHO, data="b")
    assert [t.data for t in qa.tasks()] == ["a", "a", "a"]
    assert [t.data for t in qb.tasks()] == ["b"]
    assert qa.run_pending() == 3 and qb.run_pending() == 1
    for path, expected in (("a.db", 3), ("b.db", 1)):
        with sqlite3.connect(str(tmp_path / path)) as raw:
            assert raw.execute("SELECT count(*) FROM task_queue").fetchone()[0] == expected
    assert {qa.get_task(i).status for i in a_ids} == {qb.get_task(b_id).status} == {"success"}
    qa.close()
    qb.close()


def test_a_sqlite_and_a_postgresql_queue_in_one_process_stay_apart(tmp_path):
    pg = Database("postgresql", tmp_path)
    try:
        qs = TaskQueue("sqlite:///%s" % (tmp_path / "s.db"), migrate=True)
        qp = TaskQueue(pg.url, migrate=True)
        s_id = qs.add_task(ECHO, data="sqlite")
        p_id = qp.add_task(ECHO, data="postgresql")
        assert [t.data for t in qs.tasks()] == ["sqlite"]
        assert [t.data for t in qp.tasks()] == ["postgresql"]
        assert qp.run_pending() == 1 and qs.run_pending() == 1
        assert qs.runs_of(s_id)[0].results == "sqlite"
        assert qp.runs_of(p_id)[0].results == "postgresql"
        qs.close()
        qp.close()
    finally:
        pg.drop()


def test_opening_a_queue_changes_no_schema_unless_asked(tmp_path):
    path = tmp_path / "app.db"
    url = "sqlite:///%s" % path
    with pytest.raises(SchemaBehind, match="no taskrunner schema yet: run `taskrunner init-db`"):
        TaskQueue(url)
    with sqlite3.connect(str(path)) as raw:
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "task_queue" not in tables
    TaskQueue(url, migrate=True).close()
    with TaskQueue(url) as queue:          # up to date: opens without DDL
        queue.add_task(ECHO)


def test_a_schema_one_migration_behind_is_reported_by_the_api_and_migrated_by_commands(tmp_path):
    url = "sqlite:///%s" % (tmp_path / "app.db")
    TaskQueue(url, migrate=True).close()
    with sqlite3.connect(str(tmp_path / "app.db")) as raw:
        # 0004 changes MySQL only: forgetting it leaves SQLite's schema as it was.
        raw.execute("DELETE FROM taskrunner_migrations WHERE name = '0004_mysql_long_text'")
    with pytest.raises(SchemaBehind, match="1 migration"):
        TaskQueue(url)
    # Every command brings the schema up to date itself.
    ok(taskrunner("check", url=url))
    TaskQueue(url).close()


def test_cli_without_a_database_imports_no_database_code():
    """`--help` and `calendar` start without peewee and the drivers it loads."""
    code = ("import sys\n"
            "from taskrunner.cli import main\n"
            "main(['calendar', 'daily', '-n', '1'])\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "loaded = [m for m in ('peewee', 'psycopg', 'pymysql', 'playhouse') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=process_env(), timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(240)
def test_mypy_strict_passes_on_an_app_using_the_public_api(tmp_path):
    if importlib.util.find_spec("mypy") is None:      # importing it would bloat this process
        pytest.skip("mypy is not installed (pip install '.[test]')")
    app = os.path.join(TESTS_DIR, "typed_app.py")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
         "--cache-dir", str(tmp_path / "mypy-cache"), app],
        capture_output=True, text=True, cwd=str(tmp_path), timeout=230,
        env=process_env({"MYPYPATH": REPO_DIR}))
    assert result.returncode == 0, result.stdout + result.stderr


def test_run_pending_runs_everything_whatever_the_size_of_the_calling_process(sqlite_db):
    """memory_limit retires a runner process; run_pending runs inside the application (or
    the test suite), whose RSS is not a runner's: it must not stop after one run."""
    queue = sqlite_db.queue(runner={"memory_limit": 1})
    queue.add_tasks([{"handler": ECHO, "data": n} for n in range(5)])
    assert queue.run_pending() == 5
    queue.close()
