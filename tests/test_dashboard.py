"""The dashboard's read queries on every database, its HTTP rules (authentication off
loopback, CSRF, read-only, escaping), `/metrics` and `taskrunner metrics`. The pages in a
real browser: test_dashboard_browser.py."""
import re
import subprocess
import sys
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from taskrunner import summaries  # noqa: E402
from taskrunner.models import utcnow  # noqa: E402
from taskrunner.web.auth import hash_password  # noqa: E402

from conftest import REPO_DIR, ok, process_env, taskrunner, usage_error, utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402


def history(queue):
    """Tasks in every state: 2 succeeded, 1 given up (Fail), 1 retrying, 1 due, 1 later."""
    done = [queue.add_task("taskrunner.handlers.Echo", {"n": n}) for n in range(2)]
    failed = queue.add_task("taskrunner.handlers.Fail", {"code": "Planned"}, max_retries=1)
    queue.run_pending()
    retrying = queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                              retry_backoff=3600)
    queue.run_pending()
    due = queue.add_task("taskrunner.handlers.Echo", {"due": True},
                         scheduled_on=utc(utcnow()) - timedelta(seconds=30))
    queue.process_queue()
    later = queue.add_task("taskrunner.handlers.Echo",
                           scheduled_on=utc(utcnow()) + timedelta(days=1))
    return dict(done=done, failed=failed, retrying=retrying, due=due, later=later)


def periodic_submission(queue):
    """A periodic task 'every-minute' that has submitted one task; its id in a list."""
    from taskrunner import periodic
    periodic.add_periodic(queue.store, "every-minute", "taskrunner.handlers.Echo", "every 1min")
    result = periodic.PeriodicScheduler(queue.store).run_pending(
        now=utcnow() + timedelta(minutes=2))
    return result["submitted"]


def test_summaries_on_every_database(queue):
    ids = history(queue)
    store = queue.store
    counts = summaries.status_counts(store)
    assert counts == {"scheduled": 2, "running": 0, "retrying": 1, "given-up": 1,
                      "success": 2, "cancelled": 0}
    minutes = summaries.runs_per_minute(store)
    assert len(minutes) == 60
    assert sum(m.succeeded for m in minutes) == 2 and sum(m.failed for m in minutes) == 2
    assert 25 <= summaries.queue_lag(store) < 600
    groups = {(g.handler, g.error_code): g for g in summaries.failure_groups(store)}
    assert groups[("taskrunner.handlers.Fail", "Planned")].given_up == 1
    assert groups[("taskrunner.handlers.Fail", "Again")].retrying == 1
    assert groups[("taskrunner.handlers.Fail", "Again")].latest_task_id == ids["retrying"]

    page = summaries.find_tasks(store, limit=4)
    assert [t.id for t in page.tasks] == sorted(sum(([v] if isinstance(v, int) else v
                                                     for v in ids.values()), []))[::-1][:4]
    rest = summaries.find_tasks(store, before=page.next_before, limit=4)
    assert rest.next_before is None and len(rest.tasks) == 2
    given_up = summaries.find_tasks(store, summaries.TaskFilter(status="given-up"))
    assert [t.id for t in given_up.tasks] == [ids["failed"]]
    again = summaries.find_tasks(store, summaries.TaskFilter(status="failed", error_code="Again"))
    assert [t.id for t in again.tasks] == [ids["retrying"]]
    echo = summaries.find_tasks(store, summaries.TaskFilter(handler="taskrunner.handlers.Echo"))
    assert len(echo.tasks) == 4
    future = summaries.TaskFilter(since=utc(utcnow()) + timedelta(hours=1))
    assert summaries.find_tasks(store, future).tasks == []
    submitted = periodic_submission(queue)
    by_periodic = summaries.TaskFilter(periodic_task_id=summaries.periodic_task_id(
        store, "every-minute"))
    assert [t.id for t in summaries.find_tasks(store, by_periodic).tasks] == submitted

    ended = {(h, s): n for h, s, n in summaries.runs_ended_by_handler(store)}
    assert ended == {("taskrunner.handlers.Echo", "success"): 2,
                     ("taskrunner.handlers.Fail", "error"): 2}
    histograms = {h.handler: h for h in summaries.duration_histograms(store)}
    assert histograms["taskrunner.handlers.Echo"].count == 2
    assert histograms["taskrunner.handlers.Echo"].buckets[-1] == 2
    assert 0 <= histograms["taskrunner.handlers.Echo"].total_seconds < 60


def test_metrics_command_prints_the_exposition_format(database):
    queue = database.queue()
    history(queue)
    queue.close()
    text = ok(taskrunner("metrics", url=database.url))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("taskrunner_tasks", (("status", "given-up"),))] == 1
    assert samples[("taskrunner_runs_ended_total", (("handler", "taskrunner.handlers.Fail"),
                                                    ("status", "error")))] == 2
    assert samples[("taskrunner_run_duration_seconds_count",
                    (("handler", "taskrunner.handlers.Echo"),))] == 2
    assert samples[("taskrunner_queue_lag_seconds", ())] >= 25
    assert families["taskrunner_runs_ended"].type == "counter"
    assert families["taskrunner_run_duration_seconds"].type == "histogram"


def test_cli_runner_and_overseer_do_not_import_the_dashboard_stack():
    code = ("import sys, taskrunner.cli, taskrunner.runner, taskrunner.overseer, taskrunner.queue;"
            "from taskrunner.cli import build_parser; build_parser();"
            "print(sorted(m for m in sys.modules if m.startswith(('taskrunner.web',"
            " 'prometheus_client', 'wsgiref', 'selenium'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO_DIR, env=process_env(), check=True).stdout
    assert out.strip() == "[]"


def test_non_local_bind_without_authentication_is_refused(sqlite_db, tmp_path):
    result = taskrunner("dashboard", "--bind", "0.0.0.0:8411", url=sqlite_db.url)
    usage_error(result, "0.0.0.0", "without authentication", "password_hash")
    result = taskrunner("dashboard", "--bind", "nonsense", url=sqlite_db.url)
    usage_error(result, "invalid dashboard bind 'nonsense'")
    config = sqlite_db.write_config(tmp_path / "c.toml", '[dashboard]\npassword_env = "NOPE_PW"\n')
    usage_error(taskrunner("dashboard", config=config), "NOPE_PW", "not set")


def test_password_is_required_off_loopback_and_checked(sqlite_db):
    queue = sqlite_db.queue()
    stored = hash_password("s3cret")
    served = Served(queue.store, password_hash=stored)
    try:
        assert fetch(served.url + "/")[0] == 401
        assert fetch(served.url + "/", password="wrong")[0] == 401
        status, body, _ = fetch(served.url + "/", password="s3cret")
        assert status == 200 and "Overview" in body
        assert fetch(served.url + "/metrics", password="s3cret")[0] == 200
    finally:
        served.stop()
    hashed = subprocess.run([sys.executable, "-m", "taskrunner", "dashboard", "--hash-password"],
                            input="pw\n", capture_output=True, text=True, env=process_env(),
                            check=True).stdout.strip()
    assert hashed.startswith("pbkdf2_sha256$")
    served = Served(queue.store, bind="0.0.0.0:0", password_hash=hashed)
    try:
        assert fetch(served.url.replace("0.0.0.0", "127.0.0.1") + "/", password="pw")[0] == 200
    finally:
        served.stop()
        queue.close()


def test_actions_need_the_csrf_token_and_change_the_database(sqlite_db):
    queue = sqlite_db.queue()
    ids = history(queue)
    served = Served(queue.store)
    try:
        status, body, _ = fetch(served.url + "/tasks/%d/retry" % ids["failed"], data="x=1")
        assert status == 403 and "CSRF" in body
        assert queue.get_task(ids["failed"]).status == "error"
        page = fetch(served.url + "/tasks/%d" % ids["failed"])[1]
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        status, _, headers = fetch(served.url + "/tasks/%d/retry" % ids["failed"],
                                   data="csrf=" + token, headers={"Origin": "http://evil.test"})
        assert status == 403
        status, _, headers = fetch(served.url + "/tasks/%d/retry" % ids["failed"],
                                   data="csrf=" + token)
        assert status == 303 and "re-armed" in headers["Location"].replace("+", " ")
        assert queue.get_task(ids["failed"]).status == "scheduled"
        status, _, _ = fetch(served.url + "/tasks/%d/cancel" % ids["later"], data="csrf=" + token)
        assert status == 303 and queue.get_task(ids["later"]).status == "cancelled"
    finally:
        served.stop()
        queue.close()


def test_read_only_serves_pages_without_actions(sqlite_db):
    queue = sqlite_db.queue()
    ids = history(queue)
    served = Served(queue.store, read_only=True)
    try:
        page = fetch(served.url + "/tasks/%d" % ids["failed"])[1]
        assert "read-only" in page and 'method="post"' not in page
        status, _, _ = fetch(served.url + "/tasks/%d/retry" % ids["failed"], data="csrf=x")
        assert status == 403 and queue.get_task(ids["failed"]).status == "error"
    finally:
        served.stop()
        queue.close()


def test_task_data_is_escaped_and_no_page_shows_the_database_password(sqlite_db):
    queue = sqlite_db.queue()
    task_id = queue.add_task("taskrunner.handlers.Echo", {"x": "<script>alert(1)</script>"})
    queue.run_pending()
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks/%d" % task_id)[1]
        assert "<script>alert" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
        for path in ("/", "/runners", "/tasks", "/failures", "/periodic", "/metrics"):
            status, body, headers = fetch(served.url + path)
            assert status == 200, path
            assert "script-src" not in headers["Content-Security-Policy"]  # default-src 'self'
        assert fetch(served.url + "/tasks?status=bogus")[0] == 400
        assert fetch(served.url + "/tasks/999999")[0] == 404
    finally:
        served.stop()
        queue.close()


def test_dashboard_command_serves_and_says_how_it_is_protected(sqlite_db, tmp_path):
    """`taskrunner dashboard` as a process: the line it prints at start, the pages, the
    password it requires off loopback."""
    import os
    import select
    import signal
    import time
    config = sqlite_db.write_config(tmp_path / "c.toml",
                                    '[dashboard]\npassword_env = "DASH_PW"\n')
    proc = subprocess.Popen([sys.executable, "-m", "taskrunner", "--config", config,
                             "dashboard", "--bind", "0.0.0.0:0", "--read-only"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=process_env({"DASH_PW": "pw"}), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while not line and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
        assert "password required" in line and "read-only" in line, (line, proc.poll())
        port = int(re.search(r":(\d+)/", line).group(1))
        assert fetch("http://127.0.0.1:%d/" % port)[0] == 401
        status, body, _ = fetch("http://127.0.0.1:%d/tasks" % port, password="pw")
        assert status == 200 and "Tasks" in body
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
