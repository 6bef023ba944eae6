"""The Django Tasks backend in a real Django project (tests/django_project), on SQLite and
PostgreSQL, with real overseer processes started by ``manage.py taskrunner overseer``; once
with Django 5.2 and the django-tasks backport (this interpreter), once with Django 6's own
`django.tasks` (the Python of $TASKRUNNER_DJANGO6_PYTHON: .ci/run makes a Python 3.12 venv
for it). Each project process is a subprocess: Django is configured once per process."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO_DIR, TESTS_DIR, extra_missing, process_env, stop_process, wait_for

PROJECT = os.path.join(TESTS_DIR, "django_project")


def _django6_python():
    return os.environ.get("TASKRUNNER_DJANGO6_PYTHON")


def _has(python, code):
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


@pytest.fixture(params=("backport", "django6"))
def python(request):
    """The interpreter of the project: its Django decides which Tasks API it uses."""
    if request.param == "backport":
        python, check = sys.executable, "import django_tasks, django; " \
                                        "assert django.VERSION < (6,)"
        needs = "Django < 6 and django-tasks: the test extra on Python < 3.12"
    else:
        python, check = _django6_python(), "import django; assert django.VERSION >= (6,)"
        needs = "a Python >= 3.12 with pip install '.[django,postgres,mysql,web]' 'Django>=6'"
    if not python or not _has(python, check):
        extra_missing("no %s Django in %s (%s)" % (
            request.param, python or "$TASKRUNNER_DJANGO6_PYTHON", needs))
    return python


class Project:
    def __init__(self, python, database, tmp_path, config=""):
        self.python, self.database = python, database
        self.env = process_env({"DEMO_DATABASE_URL": database.url})
        if config:
            path = tmp_path / "taskrunner.toml"
            path.write_text(config)
            self.env["DEMO_TASKRUNNER_CONFIG"] = str(path)

    def manage(self, *args, check=True, timeout=120):
        result = subprocess.run([self.python, "manage.py"] + list(args), cwd=PROJECT,
                                env=self.env, capture_output=True, text=True, timeout=timeout)
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    def scenario(self, name, *args):
        return json.loads(self.manage("scenario", name, *args).stdout)

    def spawn(self, log_path, *args):
        log = open(log_path, "wb")
        return subprocess.Popen([self.python, "manage.py"] + list(args), cwd=PROJECT,
                                env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.fixture
def project(python, database_sp, tmp_path):
    project = Project(python, database_sp, tmp_path,
                      # Runners that only poll every 30 s: a task done sooner was woken.
                      config="[runner]\nlimit = 2\npoll_interval = 30\n")
    project.manage("migrate", "-v0")
    return project


def test_backend_enqueues_and_reads_results_as_django_expects(project):
    seen = project.scenario("contract")
    assert seen["supports"] == [True, True, True, True]
    assert seen["unknown_queue"] == "Queue 'nowhere' is not valid for backend."
    first = seen["enqueued"]
    assert first["status"] == "READY" and first["enqueued_at"] and not first["started_at"]
    # Args and kwargs as Django normalises them (a tuple is a list), stored and read back.
    assert first["args"] == [2] and first["kwargs"] == {"b": [3, 4]}
    assert seen["read"] == first
    # What enqueue() returned is what was stored, to the microsecond (Django's own tests and
    # django-tasks-db's: get_result(result.id) == result, refresh() changes nothing).
    assert seen["stored_is_returned"] and seen["refresh_changes_nothing"]
    assert seen["committed_is_returned"] and seen["async"]["is_returned"]
    send = seen["send"]
    assert (send["queue_name"], send["priority"], send["status"]) == ("emails", 50, "READY")
    assert send["run_after"] is not None
    assert seen["missing"] == [True, True]
    assert seen["rolled_back_missing"] is True
    assert seen["committed"]["args"] == [5, 5]
    assert seen["async"]["args"] == [1, 2] and seen["async"]["status"] == "READY"
    # The tables are the application's: the task is in Django's own database.
    queue = project.database.queue()
    try:
        deferred = queue.get_task(int(send["id"]))
        assert (deferred.queue, deferred.priority, deferred.next_run_on is not None) == \
            ("emails", 50, True)
    finally:
        queue.close()


def test_without_use_tz_times_are_naive_local_time(project):
    project.env["DEMO_USE_TZ"] = "0"
    seen = project.scenario("contract")
    assert seen["enqueued"]["status"] == "READY" and seen["read"] == seen["enqueued"]
    assert seen["stored_is_returned"] and seen["refresh_changes_nothing"]
    # run_after was naive Paris time: read back naive, as Django gives datetimes then.
    assert seen["send"]["run_after"] is not None and "+" not in seen["send"]["run_after"]


def test_overseer_runs_django_tasks_and_results_tell_their_runs(project, tmp_path):
    log = tmp_path / "overseer.log"
    signals = tmp_path / "signals.jsonl"
    project.env["DEMO_SIGNAL_LOG"] = str(signals)
    overseer = project.spawn(log, "taskrunner", "overseer")
    try:
        # Both runners idle before the first task: one that is just starting claims it
        # without being woken.
        wait_for(lambda: len(re.findall(r"runner \d+ started", log.read_text())) == 2,
                 timeout=60, message="two runners started")
        seen = project.scenario("run", "--timeout", "60")
    finally:
        stop_process(overseer, signal.SIGTERM)
    output = log.read_text(errors="replace")
    results = seen["results"]
    assert sorted(results) == ["add", "async_add", "fails", "fails_once", "send"], output
    add = results["add"]
    assert (add["status"], add["return_value"]) == ("SUCCESSFUL", 5)
    assert add["started_at"] and add["last_attempted_at"] and add["finished_at"]
    assert len(add["worker_ids"]) == 1 and not add["errors"]
    # Committed, then woken at once: runners that poll every 30 s took it within seconds.
    assert add["after"] < 10, output
    assert results["async_add"]["return_value"] == 42
    sent = results["send"]["return_value"]
    assert sent["to"] == "b@example.com"
    # Django was set up once, in the overseer, before it forked the runner that ran the task.
    assert sent["setup_pids"] == [overseer.pid] != [sent["pid"]]
    fails = results["fails"]
    assert fails["status"] == "FAILED" and fails["finished_at"]
    assert [e["exception_class_path"] for e in fails["errors"]] == ["demo.tasks.Boom"] * 2
    assert "raise Boom(message)" in fails["errors"][0]["traceback"]
    assert len(fails["worker_ids"]) == 2
    # takes_context: the second attempt knows it is the second.
    once = results["fails_once"]
    assert once["status"] == "SUCCESSFUL" and once["return_value"] == {"value": 7, "attempt": 2}
    assert [e["exception_class_path"] for e in once["errors"]] == ["demo.tasks.Boom"]
    assert seen["ready_while_retrying"], "a task waiting to retry was never READY"
    # Django's task_started / task_finished, sent in the runner around each attempt, as
    # Django's own backends send them, with the backend's class as sender.
    sent = [json.loads(line) for line in signals.read_text().splitlines()]
    by_task = {}
    for line in sent:
        assert line["sender"] == "TaskrunnerBackend" and line["pid"] != overseer.pid, line
        by_task.setdefault(line["task"], []).append((line["signal"], line["status"]))
    assert by_task["add"] == [("task_started", "RUNNING"), ("task_finished", "SUCCESSFUL")]
    assert by_task["async_add"] == by_task["add"]
    assert by_task["always_fails"] == [("task_started", "RUNNING"),
                                       ("task_finished", "FAILED")] * 2
    assert by_task["fails_once"] == [("task_started", "RUNNING"), ("task_finished", "FAILED"),
                                     ("task_started", "RUNNING"),
                                     ("task_finished", "SUCCESSFUL")]


def _tasks(project, *args):
    return {str(t["id"]): t for t in json.loads(project.manage("taskrunner", "tasks", "--json",
                                                               *args).stdout)}


def test_a_django_task_is_named_by_its_import_path_everywhere(project):
    ids = project.scenario("enqueue")
    add, send, before, elsewhere = (ids[name] for name in ("add", "send", "stored_before",
                                                           "elsewhere"))
    listed = _tasks(project)
    assert (listed[add]["handler"], listed[send]["handler"]) == ("demo.tasks.add",
                                                                 "demo.tasks.send")
    assert listed[add]["queue"] == "default" and listed[send]["queue"] == "emails"
    # The handler names the task: the data is the call.
    assert listed[add]["data"] == {"args": [2, 3], "kwargs": {}, "backend": "default",
                                   "run_after": None}
    # Stored before tasks were named by their path: kept as it was stored. A task of another
    # backend's @task names no handler: stored as every Django task was before.
    for task_id in (before, elsewhere):
        assert listed[task_id]["handler"] == "taskrunner.contrib.django.handler.RunDjangoTask"
    assert sorted(_tasks(project, "--handler", "demo.tasks.add")) == [add]
    assert sorted(_tasks(project, "--handler", "demo.tasks.send")) == [send]
    project.manage("taskrunner", "runner", "--burst", "--queue", "default,emails")
    results = project.scenario("results", add, send, before, elsewhere)
    assert (results[add]["status"], results[add]["return_value"]) == ("SUCCESSFUL", 5)
    assert results[send]["return_value"]["to"] == "c@example.com"
    assert results[send]["return_value"]["subject"] == "receipt"
    for task_id in (before, elsewhere):
        assert (results[task_id]["status"], results[task_id]["return_value"]) == \
            ("SUCCESSFUL", 42)
    assert {t["status"] for t in _tasks(project).values()} == {"success"}
    metrics = project.manage("taskrunner", "metrics").stdout
    ended = dict(re.findall(r'^taskrunner_runs_ended_total\{handler="([^"]+)",status="success"\} '
                            r'(\S+)$', metrics, re.M))
    assert ended == {"demo.tasks.add": "1.0", "demo.tasks.send": "1.0",
                     "taskrunner.contrib.django.handler.RunDjangoTask": "2.0"}, metrics


def test_a_runner_serving_default_leaves_the_other_django_queues_alone(project):
    """A Django queue is a lane of its own, as Django users expect (django-tasks-db's worker
    runs the queues it is told): `QUEUES = ["default", "emails"]` without a
    ``[queues.emails]`` table in the config, a runner serving ``default`` does not run a
    task of ``emails``; one told ``--queue emails`` does."""
    ids = project.scenario("enqueue")
    add, send = ids["add"], ids["send"]
    project.manage("taskrunner", "runner", "--burst")
    results = project.scenario("results", add, send)
    assert results[add]["status"] == "SUCCESSFUL"
    assert results[send]["status"] == "READY" and not results[send]["worker_ids"], results
    project.manage("taskrunner", "runner", "--burst", "--queue", "emails")
    assert project.scenario("results", send)[send]["status"] == "SUCCESSFUL"


def test_a_plain_runner_runs_django_tasks_with_nothing_registered(project):
    """`taskrunner runner` itself, not manage.py: Django is not set up before a task's module
    is imported, and nothing registers a hook; the object found at the task's path names the
    handler that runs it."""
    ids = project.scenario("enqueue")
    env = dict(project.env, DJANGO_SETTINGS_MODULE="project.settings",
               TASKRUNNER_DATABASE_URL=project.database.url,
               TASKRUNNER_CONFIG=project.env["DEMO_TASKRUNNER_CONFIG"])
    subprocess.run([project.python, "-m", "taskrunner", "runner", "--burst", "--queue",
                    "default,emails"], cwd=PROJECT, env=env, check=True, timeout=120)
    results = project.scenario("results", *ids.values())
    assert [r["status"] for r in results.values()] == ["SUCCESSFUL"] * 4, results
    assert [results[ids[name]]["return_value"] for name in ("add", "stored_before",
                                                            "elsewhere")] == [5, 42, 42]


def test_a_task_raising_system_exit_is_reported_as_itself(project, tmp_path):
    """Django's immediate backend: a task that raises SystemExit (a BaseException) fails with
    exception_class_path ``builtins.SystemExit`` and task_finished is sent; sync and async."""
    signals = tmp_path / "signals.jsonl"
    project.env["DEMO_SIGNAL_LOG"] = str(signals)
    ids = project.scenario("exits")
    project.manage("taskrunner", "runner", "--burst")
    results = project.scenario("results", *ids.values())
    for name, result_id in ids.items():
        errors = results[result_id]["errors"]
        assert errors, (name, results[result_id])
        assert errors[0]["exception_class_path"] == "builtins.SystemExit", (name, errors)
        assert "SystemExit" in errors[0]["traceback"], (name, errors)
    sent = [json.loads(line) for line in signals.read_text().splitlines()]
    for name in ids:
        seen = [(line["signal"], line["status"]) for line in sent if line["task"] == name]
        assert seen[:2] == [("task_started", "RUNNING"), ("task_finished", "FAILED")], (name,
                                                                                      sent)


def test_a_task_whose_module_does_not_import_in_the_runner_is_an_import_error(project):
    """Django (import_string) and django-tasks-db report a task path that does not import
    with its ImportError; the runner reports it as its HandlerError, whose stored traceback
    is the import's: Django's error names the import's exception."""
    ids = project.scenario("fragile")
    env = dict(project.env)
    project.env["DEMO_FRAGILE"] = "1"
    project.manage("taskrunner", "runner", "--burst")
    project.env = env
    [error] = project.scenario("results", ids["job"])[ids["job"]]["errors"][:1]
    assert error["exception_class_path"] == "builtins.ImportError", error
    assert "ImportError: a dependency of demo.fragile is missing here" in error["traceback"]


def _signals_sent(path, task_id=None):
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []
    return [line for line in lines if task_id is None or line["id"] == task_id]


def test_a_runner_killed_mid_task_is_reported_task_finished_by_the_overseer(project, tmp_path):
    """kill -9 of the runner running a Django task: the overseer that reaps it records the
    run's end (timeout, RunnerDied) and sends task_finished (FAILED, its error
    builtins.TimeoutError); the retry then sends its own pair."""
    log = tmp_path / "overseer.log"
    signals = tmp_path / "signals.jsonl"
    project.env["DEMO_SIGNAL_LOG"] = str(signals)
    overseer = project.spawn(log, "taskrunner", "overseer")
    try:
        task_id = project.scenario("hangs")["hangs_once"]
        [started] = wait_for(lambda: _signals_sent(signals, task_id), timeout=60,
                             message="task_started of the task")
        assert (started["signal"], started["pid"] != overseer.pid) == ("task_started", True)
        os.kill(started["pid"], signal.SIGKILL)
        wait_for(lambda: len(_signals_sent(signals, task_id)) >= 4, timeout=60,
                 message="task_finished of the killed attempt, then the retry's pair")
    finally:
        stop_process(overseer, signal.SIGTERM)
    sent = _signals_sent(signals, task_id)
    assert [(line["signal"], line["status"]) for line in sent] == [
        ("task_started", "RUNNING"), ("task_finished", "FAILED"),
        ("task_started", "RUNNING"), ("task_finished", "SUCCESSFUL")], sent
    died = sent[1]
    assert died["pid"] == overseer.pid, (sent, log.read_text(errors="replace"))
    assert died["errors"] == ["builtins.TimeoutError"]
    result = project.scenario("results", task_id)[task_id]
    assert (result["status"], result["return_value"]) == ("SUCCESSFUL", 2)


def test_a_run_past_its_max_runtime_is_reported_task_finished(project, tmp_path):
    """A run that passes MAX_RUNTIME is stopped by its runner and ended ``timeout``: the
    runner, which recorded that end, sends task_finished (FAILED, builtins.TimeoutError);
    the function's own attempt reported nothing (it was interrupted)."""
    signals = tmp_path / "signals.jsonl"
    project.env.update(DEMO_SIGNAL_LOG=str(signals), DEMO_MAX_RUNTIME="2")
    task_id = project.scenario("hangs")["hangs_once"]
    project.manage("taskrunner", "runner", "--burst")
    sent = _signals_sent(signals, task_id)
    assert [(line["signal"], line["status"]) for line in sent[:2]] == [
        ("task_started", "RUNNING"), ("task_finished", "FAILED")], sent
    assert sent[1]["errors"] == ["builtins.TimeoutError"] and sent[1]["pid"] == sent[0]["pid"]


def test_a_keyboard_interrupt_and_a_cancel_are_reported_by_who_records_them(project,
                                                                           tmp_path):
    """A task raising KeyboardInterrupt is let through unreported by the task's attempt, as
    Django's immediate backend lets it through; it ends the runner, which records its run's
    end on the way out and sends task_finished (FAILED) then, once. A task cancelled before
    it ran: task_finished (FAILED) from the process that cancelled it."""
    signals = tmp_path / "signals.jsonl"
    project.env["DEMO_SIGNAL_LOG"] = str(signals)
    ids = project.scenario("interrupts")
    interrupts, deferred = ids["interrupts"], ids["deferred"]
    for attempt in (1, 2):
        ended = project.manage("taskrunner", "runner", "--burst", check=False)
        assert ended.returncode == 130, ended.stdout + ended.stderr
    sent = _signals_sent(signals, interrupts)
    assert [(line["signal"], line["status"]) for line in sent[:2]] == [
        ("task_started", "RUNNING"), ("task_finished", "FAILED")], sent
    assert sent[1]["pid"] == sent[0]["pid"] and sent[1]["errors"] == ["builtins.TimeoutError"]
    # The retry, in the next runner: its own pair (KeyboardInterrupt again).
    assert [line["signal"] for line in sent[2:]] == ["task_started", "task_finished"], sent
    project.manage("taskrunner", "cancel", deferred)
    [cancelled] = _signals_sent(signals, deferred)
    assert (cancelled["signal"], cancelled["status"]) == ("task_finished", "FAILED")
    assert cancelled["pid"] not in {line["pid"] for line in sent}
    assert project.scenario("results", deferred)[deferred]["status"] == "FAILED"


def test_manage_py_taskrunner_runs_taskrunner_commands(project):
    status = project.manage("taskrunner", "status", "--json")
    assert json.loads(status.stdout)["database"].startswith(project.database.url.split(":")[0])
    bad = project.manage("taskrunner", "no-such-command", check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    other = project.manage("taskrunner", "--backend", "nope", "status", check=False)
    assert other.returncode == 2 and other.stderr.startswith("taskrunner: error:")
    assert "Traceback" not in other.stderr
    project.env["DEMO_MEMORY_BACKEND"] = "1"
    check = project.manage("check", check=False)
    assert check.returncode == 1 and "taskrunner.E001" in check.stderr
    assert "in-memory SQLite database" in check.stderr
    memory = project.manage("taskrunner", "--backend", "memory", "status", check=False)
    assert memory.returncode == 2 and "in-memory" in memory.stderr
    assert "Traceback" not in memory.stderr


def test_database_url_comes_from_django_settings(tmp_path, monkeypatch):
    from taskrunner.contrib.django.database import url_of
    from taskrunner.errors import ConfigError
    monkeypatch.chdir(tmp_path)
    assert url_of({"ENGINE": "django.db.backends.sqlite3", "NAME": "app.db"}) == \
        "sqlite:///" + str(tmp_path / "app.db")
    assert url_of({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "web",
                   "PASSWORD": "p@ss/w:rd", "HOST": "db.internal", "PORT": 6432,
                   "OPTIONS": {"sslmode": "require", "pool": True}}) == \
        "postgresql://web:p%40ss%2Fw%3Ard@db.internal:6432/shop?sslmode=require"
    assert url_of({"ENGINE": "django.db.backends.postgresql", "NAME": "shop",
                   "HOST": "/run/postgresql"}) == \
        "postgresql:///shop?host=%2Frun%2Fpostgresql"
    assert url_of({"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "root",
                   "HOST": "127.0.0.1", "PORT": "3306"}) == "mysql://root@127.0.0.1:3306/shop"
    for memory in ("", ":memory:", "file:memorydb_default?mode=memory&cache=shared"):
        with pytest.raises(ConfigError, match="in-memory"):
            url_of({"ENGINE": "django.db.backends.sqlite3", "NAME": memory})
    with pytest.raises(ConfigError, match="engine"):
        url_of({"ENGINE": "django.db.backends.oracle", "NAME": "x"})


def test_import_taskrunner_and_the_runner_load_no_framework():
    code = ("import sys, taskrunner, taskrunner.api, taskrunner.cli, taskrunner.runner.loop,"
            " taskrunner.overseer.overseer\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'django', 'django_tasks', "
            "'fastapi', 'starlette', 'flask', 'asgiref'}))")
    out = subprocess.run([sys.executable, "-c", code], env=process_env(), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dashboard_mounted_in_django_for_staff_only_with_its_csrf_intact(project):
    seen = project.scenario("dashboard")
    assert (seen["anonymous"], seen["not_staff"], seen["not_staff_metrics"]) == (403, 403, 403)
    assert seen["overview"] == 200 and seen["css"] == 200
    # Every link, form, asset and the live-refresh URL under the mount point.
    assert seen["links"] and all(link.startswith("/ops/taskrunner/") for link in seen["links"])
    assert "/ops/taskrunner/api/parts" in seen["links"]
    assert seen["parts_links"] == ["/ops/taskrunner/tasks"]
    # Django's CSRF middleware does not block the dashboard's forms; the dashboard's own
    # token and same-origin check still refuse a forged action.
    assert (seen["without_token"], seen["wrong_origin"]) == (403, 403)
    status, location = seen["with_token"]
    assert status == 303 and location.startswith("/ops/taskrunner/tasks/")
    assert seen["status_after"] == "FAILED"        # cancelled
    assert seen["task_page_names"] == [True, False]   # its Django path, not RunDjangoTask
    assert seen["metrics"] == [200, True]


def test_mounted_metrics_without_prometheus_client_answer_501_naming_the_extra(tmp_path):
    """An application installed without prometheus-client: /metrics says what to install
    (501), not a 500 with ModuleNotFoundError; and the [django] extra brings it."""
    code = ("import sys, json\n"
            "sys.modules['prometheus_client'] = None   # as if not installed\n"
            "from taskrunner import TaskQueue\n"
            "from taskrunner.contrib.dashboard import MountedMetrics\n"
            "with TaskQueue('sqlite:///%s', migrate=True) as queue:\n"
            "    status, headers, body = MountedMetrics(queue, allow=lambda e: True)"
            ".respond({})\n"
            "print(json.dumps([status, body.decode()]))\n" % (tmp_path / "q.db"))
    result = subprocess.run([sys.executable, "-c", code], env=process_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    status, body = json.loads(result.stdout)
    assert status.startswith("501") and "pip install" in body and "prometheus" in body, body
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    with open(os.path.join(REPO_DIR, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(dep.startswith("prometheus-client") for dep in extras["django"])
