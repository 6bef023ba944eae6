"""The dashboard's read queries on every database, its HTTP rules (authentication off
loopback, CSRF, read-only, escaping), `/metrics` and `taskrunner metrics`. The pages in a
real browser: test_dashboard_browser.py."""
import json
import re
import subprocess
import sys
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from taskrunner.reads import summaries
from taskrunner.store.models import utcnow
from taskrunner.passwords import hash_password  # noqa: E402

from conftest import REPO_DIR, ok, process_env, taskrunner, usage_error, utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402
from local_users import other_user, run_as  # noqa: E402,F401 - other_user: a fixture


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
    from taskrunner.periodic import scheduler as periodic
    periodic.add_periodic(queue.store, "every-minute", "taskrunner.handlers.Echo", "every 1min")
    result = periodic.PeriodicScheduler(queue.store).run_pending(
        now=utcnow() + timedelta(minutes=2))
    return result["submitted"]


def test_summaries_on_every_database(queue):
    ids = history(queue)
    store = queue.store
    counts = summaries.status_counts(store)
    assert counts == {"scheduled": 2, "running": 0, "waiting": 0, "retrying": 1, "given-up": 1,
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
    code = ("import sys, taskrunner.cli, taskrunner.runner.loop,"
            " taskrunner.overseer.overseer, taskrunner.api;"
            "from taskrunner.cli.commands import build_parser; build_parser();"
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
        assert queue.get_task(ids["failed"]).status == "given-up"
        page = fetch(served.url + "/tasks/%d" % ids["failed"])[1]
        token = re.search(r'name="csrf" value="([^"]+)"', page).group(1)
        status, _, headers = fetch(served.url + "/tasks/%d/retry" % ids["failed"],
                                   data="csrf=" + token, headers={"Origin": "http://evil.test"})
        assert status == 403
        status, _, headers = fetch(served.url + "/tasks/%d/retry" % ids["failed"],
                                   data="csrf=" + token)
        assert status == 303 and "re-armed" in notice_of(headers)
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
        assert status == 403 and queue.get_task(ids["failed"]).status == "given-up"
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


# -- the tracebacks, periodic statistics, queues, stopping runners (issue 13, 2nd part) -----

def token_of(served, path="/"):
    return re.search(r'name="csrf" value="([^"]+)"', fetch(served.url + path)[1]).group(1)


def notice_of(headers):
    """The notice an action's answer leaves for the next page (its cookie)."""
    from urllib.parse import unquote
    cookie = headers["Set-Cookie"]
    assert cookie.startswith("taskrunner_notice="), cookie
    return unquote(cookie.split(";")[0].split("=", 1)[1])


def test_task_page_shows_the_full_traceback_of_each_failed_run(sqlite_db):
    queue = sqlite_db.queue()
    task_id = queue.add_task("taskrunner.handlers.Fail", {"code": "Planned",
                                                          "message": "<b>no</b>"}, max_retries=2)
    start = utc(utcnow())
    queue.run_pending(now=start)
    queue.run_pending(now=start + timedelta(hours=2))
    runs = queue.runs_of(task_id)
    assert [r.status for r in runs] == ["error", "error"] and all(r.traceback for r in runs)
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks/%d" % task_id)[1]
        # Two runs, one cause: the latest traceback shown, the earlier one said to be the same.
        shown = re.findall(r'<pre class="traceback">(.*?)</pre>', body, re.S)
        assert len(shown) == 1, body
        assert "The same traceback in 1 earlier run: attempt 1." in body
        for text in shown:
            assert "Traceback (most recent call last)" in text and "&lt;b&gt;no&lt;/b&gt;" in text
            assert "raise TaskError" in text
        assert "<b>no</b>" not in body
    finally:
        served.stop()
        queue.close()


def running_run(queue, serving=None):
    """A task whose run a runner row of this process claimed: (task id, run id, runner id)."""
    from taskrunner.runs import lifecycle
    from taskrunner.fleet import liveness
    task_id = queue.add_task("taskrunner.handlers.Echo", {"x": 1})
    runner_id = liveness.register(queue.store, serving=serving).id
    claimed = lifecycle.claim(queue.store, runner_id)
    assert claimed.task_id == task_id
    return task_id, claimed.run_id, runner_id


def test_a_running_tasks_live_results_and_a_cancel_that_asks_it_to_stop(sqlite_db):
    import json
    from taskrunner.runs import lifecycle
    queue = sqlite_db.queue()
    task_id, run_id, runner_id = running_run(queue)
    assert lifecycle.report_progress(queue.store, run_id, runner_id, percent=40,
                                     results=json.dumps({"step": "<i>3</i>"}))
    served = Served(queue.store)
    try:
        def live():
            return json.loads(fetch(served.url + "/api/parts?page=task&id=%d" % task_id)[1]
                              )["task-live"]
        part = live()
        assert 'value="40"' in part and "&lt;i&gt;3&lt;/i&gt;" in part and "<i>" not in part
        status, _, headers = fetch(served.url + "/tasks/%d/cancel" % task_id,
                                   data="csrf=" + token_of(served, "/tasks/%d" % task_id))
        assert status == 303
        assert "run %d is asked to stop" % run_id in notice_of(headers)
        assert queue.runs_of(task_id)[-1].cancel_requested_on is not None
        assert queue.get_task(task_id).status == "running"      # its runner ends it
        assert "status-stopping" in live()
    finally:
        served.stop()
        queue.close()


def test_failure_groups_carry_the_latest_traceback(queue):
    ids = history(queue)
    groups = {g.error_code: g for g in summaries.failure_groups(queue.store)}
    planned = queue.runs_of(ids["failed"])[-1].traceback
    assert planned and groups["Planned"].latest_traceback == planned
    # The retrying task's latest run waits to run: the traceback is its failed run's.
    again = [r.traceback for r in queue.runs_of(ids["retrying"]) if r.traceback]
    assert again and groups["Again"].latest_traceback == again[-1]


def test_failures_page_shows_the_latest_traceback(sqlite_db):
    queue = sqlite_db.queue()
    queue.add_task("taskrunner.handlers.Fail", {"code": "Planned", "message": "<b>x</b>"},
                   max_retries=1)
    queue.run_pending()
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/failures")[1]
        shown = re.findall(r'<pre class="traceback">(.*?)</pre>', body, re.S)
        assert len(shown) == 1 and "Traceback (most recent call last)" in shown[0]
        assert "&lt;b&gt;x&lt;/b&gt;" in shown[0] and "<b>x</b>" not in body
    finally:
        served.stop()
        queue.close()


def test_periodic_page_shows_statistics_subject_group_and_zone(sqlite_db):
    from taskrunner.periodic import scheduler as periodic
    from taskrunner.reads import records as reads
    queue = sqlite_db.queue()
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "*-*-* 02:00",
                          group="reports", subject="The <nightly> report")
    periodic.add_periodic(queue.store, "often", "taskrunner.handlers.Echo", "every 1min",
                          group="chores")
    periodic.PeriodicScheduler(queue.store).run_pending(now=utcnow() + timedelta(days=1))
    queue.run_pending(now=utc(utcnow()) + timedelta(days=1))
    nightly = next(p for p in reads.list_periodic(queue.store) if p.name == "nightly")
    assert nightly.stats.runs == nightly.stats.successes == 1 and nightly.timezone
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/periodic")[1]
        assert "The &lt;nightly&gt; report" in body and "<nightly>" not in body
        assert "1 run: " in body and "1 ok" in body and "last success" in body
        assert "avg " in body and "p95 " in body
        assert ">%s<" % nightly.timezone in body
        assert "nightly" in body and "often" in body
        body = fetch(served.url + "/periodic?group=reports")[1]
        rows = re.findall(r"<tr><td[ >].*?</tr>", body, re.S)
        assert len(rows) == 1 and "nightly" in rows[0] and ">reports<" in rows[0]
        assert "often" not in body.split("<table")[1]
        assert "no periodic task in group nope" in fetch(served.url + "/periodic?group=nope")[1]
    finally:
        served.stop()
        queue.close()


def test_runners_page_marks_a_runner_winding_down_and_shows_its_queues(sqlite_db):
    from taskrunner.fleet import liveness
    queue = sqlite_db.queue()
    task_id, run_id, runner_id = running_run(queue, serving=["default", "mail"])
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/runners")[1]
        row = next(r for r in re.findall(r"<tr>.*?</tr>", body, re.S) if "run %d" % run_id in r)
        assert "status-running" in row and ">mail<" in row and ">default<" in row
        assert liveness.heartbeat(queue.store, runner_id, stopping="told to stop")
        body = fetch(served.url + "/runners")[1]
        row = next(r for r in re.findall(r"<tr>.*?</tr>", body, re.S) if "run %d" % run_id in r)
        assert "status-stopping" in row and ">stopping<" in row
        assert "told to stop, since " in row       # why, and since when (issue 30)
    finally:
        served.stop()
        queue.close()


def test_overview_shows_each_queue_and_pause_resume_change_the_database(sqlite_db):
    from taskrunner.reads import records as reads
    queue = sqlite_db.queue()
    queue.add_task("taskrunner.handlers.Echo", queue="mail")
    queue.add_task("taskrunner.handlers.Echo")

    def paused():
        return {q.name: q.paused for q in reads.queue_stats(queue.store)}
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/")[1]
        section = body.split('id="queues"')[1]
        assert ">mail<" in section and ">default<" in section and "Pause" in section
        status, body, _ = fetch(served.url + "/queues/pause", data="name=mail")
        assert status == 403 and paused()["mail"] is False          # no CSRF token
        token = token_of(served)
        status, _, headers = fetch(served.url + "/queues/pause", data="csrf=%s&name=mail" % token)
        assert status == 303 and "queue 'mail' paused" in notice_of(headers)
        assert paused() == {"default": False, "mail": True}
        assert "status-paused" in fetch(served.url + "/")[1].split('id="queues"')[1]
        status, _, headers = fetch(served.url + "/queues/resume",
                                   data="csrf=%s&name=mail" % token)
        assert status == 303 and "resumed" in notice_of(headers) and paused()["mail"] is False
        status, _, _ = fetch(served.url + "/queues/pause", data="csrf=%s&name=bad name" % token)
        assert status == 400 and "bad name" not in paused()
    finally:
        served.stop()
    served = Served(queue.store, read_only=True)
    try:
        section = fetch(served.url + "/")[1].split('id="queues"')[1]
        assert ">mail<" in section and "Pause" not in section
        assert fetch(served.url + "/queues/pause", data="csrf=x&name=mail")[0] == 403
        assert paused()["mail"] is False
    finally:
        served.stop()
        queue.close()


def test_tasks_page_filters_by_queue_and_shows_it(sqlite_db):
    queue = sqlite_db.queue()
    mail = queue.add_task("taskrunner.handlers.Echo", queue="mail")
    other = queue.add_task("taskrunner.handlers.Echo")
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks?queue=mail")[1]
        rows = re.findall(r"<tr><td[ >].*?</tr>", body, re.S)
        assert len(rows) == 1 and ">%d<" % mail in rows[0] and ">mail<" in rows[0]
        rows = re.findall(r"<tr><td[ >].*?</tr>", fetch(served.url + "/tasks")[1], re.S)
        assert len(rows) == 2 and ">default<" in rows[0] and ">%d<" % other in rows[0]
        page = summaries.find_tasks(queue.store, summaries.TaskFilter(queue="mail"))
        assert [t.id for t in page.tasks] == [mail]
    finally:
        served.stop()
        queue.close()


def test_metrics_per_queue(database):
    queue = database.queue()
    queue.add_task("taskrunner.handlers.Echo", queue="mail",
                   scheduled_on=utc(utcnow()) - timedelta(seconds=30))
    queue.add_task("taskrunner.handlers.Echo")
    queue.pause_queue("mail")
    queue.close()
    text = ok(taskrunner("metrics", url=database.url))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("taskrunner_queue_scheduled", (("queue", "mail"),))] == 1
    assert samples[("taskrunner_queue_scheduled", (("queue", "default"),))] == 1
    assert samples[("taskrunner_queue_running", (("queue", "mail"),))] == 0
    assert samples[("taskrunner_queue_paused", (("queue", "mail"),))] == 1
    assert samples[("taskrunner_queue_paused", (("queue", "default"),))] == 0
    # Paused on purpose: not late (a lag alert must not fire), and how long it is paused.
    assert samples[("taskrunner_queue_lag_by_queue_seconds", (("queue", "mail"),))] == 0
    assert samples[("taskrunner_queue_paused_seconds", (("queue", "mail"),))] >= 0


# -- who reaches the dashboard; bad input (issue 31) -----------------------------------------

def test_a_request_naming_another_host_is_refused(sqlite_db):
    """DNS rebinding: a page of rebind.evil.example whose name now resolves to 127.0.0.1
    sends requests with that Host; they get nothing (no task data, no CSRF token) and can
    change nothing, while IP addresses, localhost names and [dashboard] allowed_hosts work."""
    from taskrunner.reads import records as reads
    queue = sqlite_db.queue()
    queue.add_task("taskrunner.handlers.Echo", {"note": "s3"}, queue="mail")
    served = Served(queue.store, allowed_hosts=["queues.example.com"])
    port = served.server.server_port
    evil = {"Host": "rebind.evil.example:%d" % port}
    try:
        token = token_of(served)
        for path in ("/", "/tasks", "/tasks/1", "/api/parts?page=task&id=1", "/metrics"):
            status, body, _ = fetch(served.url + path, headers=evil)
            assert status == 403 and "s3" not in body and token not in body, (path, status)
            assert "rebind.evil.example" in body and "allowed_hosts" in body
        status, _, _ = fetch(served.url + "/queues/pause", data="csrf=%s&name=mail" % token,
                             headers=dict(evil, Origin="http://rebind.evil.example:%d" % port))
        assert status == 403
        assert not any(q.paused for q in reads.queue_stats(queue.store))
        for host in ("localhost:%d" % port, "127.0.0.1:%d" % port, "[::1]:%d" % port,
                     "LOCALHOST.:%d" % port, "queues.example.com", "app.localhost:%d" % port):
            status, body, _ = fetch(served.url + "/tasks/1", headers={"Host": host})
            assert status == 200 and "s3" in body, host
        assert fetch(served.url + "/", headers={"Host": ""})[0] == 403
    finally:
        served.stop()
        queue.close()


@pytest.mark.parametrize("path", [
    "/tasks?before=99999999999999999999999",
    "/api/parts?page=task&id=99999999999999999999999", "/tasks?since=9999-12-31T23:59-23:00",
    "/tasks?until=0001-01-01T00:00%2B23:59", "/api/parts?page=task&id=-1",
    "/api/parts?page=workflow&id=99999999999999999999999", "/api/parts?page=workflow&id=x"])
def test_parameters_out_of_range_are_400_never_500(sqlite_db, path):
    queue = sqlite_db.queue()
    queue.add_task("taskrunner.handlers.Echo")
    served = Served(queue.store)
    try:
        status, body, _ = fetch(served.url + path)
        assert status == 400, (status, body[-300:])
        assert "Traceback" not in body
    finally:
        served.stop()
        queue.close()


def test_a_busy_port_is_one_line_and_exit_2(sqlite_db):
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        result = taskrunner("dashboard", "--bind", "127.0.0.1:%d" % port, url=sqlite_db.url,
                            process=True)
    finally:
        busy.close()
    usage_error(result, "cannot listen on 127.0.0.1:%d" % port, "in use")


OTHER_USER_FETCH = """
import base64
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
seen = {}
for path, data, password in json.loads(sys.argv[2]):
    request = urllib.request.Request(sys.argv[1] + path, data=data.encode() if data else None)
    if password:
        request.add_header("Authorization", "Basic " + base64.b64encode(
            b"prometheus:" + password.encode()).decode())
    try:
        with opener.open(request, timeout=30) as response:
            seen[path] = [response.status, response.read().decode()]
    except urllib.error.HTTPError as exc:
        seen[path] = [exc.code, exc.read().decode()]
print(json.dumps(seen))
"""


def test_another_local_user_cannot_read_or_act_through_the_default_dashboard(sqlite_db,
                                                                            other_user):
    """The default dashboard (loopback, no password) serves its owner only: another local
    user gets neither task data (which the 0600 database keeps from them) nor the CSRF
    token, and cannot pause a queue even with the token; with the credential of /metrics
    alone (a Prometheus running as another user) it scrapes /metrics and nothing else."""
    import json
    from taskrunner.reads import records as reads
    queue = sqlite_db.queue()
    task_id = queue.add_task("taskrunner.handlers.Echo", {"note": "s3"}, queue="mail")
    served = Served(queue.store, metrics_password_hash=hash_password("scrape-pw"))
    try:
        token = token_of(served)
        assert "s3" in fetch(served.url + "/tasks/%d" % task_id)[1]    # its owner's view
        asked = [["/", "", ""], ["/tasks/%d" % task_id, "", ""], ["/metrics", "", ""],
                 ["/api/parts?page=task&id=%d" % task_id, "", ""],
                 ["/queues/pause", "csrf=%s&name=mail" % token, ""],
                 ["/tasks", "", "scrape-pw"], ["/metrics?", "", "scrape-pw"]]
        seen = json.loads(run_as(other_user, OTHER_USER_FETCH, served.url,
                                 json.dumps(asked),
                                 imports="import json, urllib.error, urllib.request, encodings.idna"
                                 ).stdout)
    finally:
        served.stop()
    try:
        status, body = seen.pop("/metrics?")
        assert status == 200 and 'queue="mail"' in body and "s3" not in body
        for path, (status, body) in seen.items():
            assert status == 403, (path, status)
            assert "s3" not in body and token not in body and "mail" not in body, path
            assert "owner" in body, body
        assert not any(q.paused for q in reads.queue_stats(queue.store))
    finally:
        queue.close()


def _samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_name_the_configured_and_the_busiest_queues_and_sum_the_rest(database):
    """Whoever adds tasks picks the queue names: the per-queue series are the configured
    queues and the `metrics_series` busiest, the rest summed as "(other)"; the periodic
    tasks likewise (those failing most in a row, then the soonest due)."""
    from taskrunner.periodic import scheduler as periodic
    from taskrunner.web.metrics import exposition
    queue = database.queue(dashboard={"metrics_series": 20}, queues={"mail": {"limit": 1}})
    try:
        queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "queue": "q%03d" % n}
                         for n in range(300) for _ in range(3 if n % 7 == 0 else 1)])
        queue.pause_queue("q000")
        queue.pause_queue("q001")
        for n in range(60):
            periodic.add_periodic(queue.store, "p%02d" % n, "taskrunner.handlers.Echo",
                                  "every %dmin" % (n + 1))
        Periodic = queue.store.PeriodicTask
        Periodic.update(consecutive_failures=3).where(Periodic.name == "p44").execute()
        periodic.set_enabled(queue.store, "p59", False)
        samples = _samples(exposition(queue.store).decode())
    finally:
        queue.close()
    named = {dict(labels)["queue"] for name, labels in samples
             if name == "taskrunner_queue_scheduled"}
    busiest = {"q%03d" % n for n in range(0, 300, 7)}
    assert named == {"default", "mail", "(other)"} | set(sorted(busiest)[:20])

    def queue_value(family, name):
        return samples[("taskrunner_queue_" + family, (("queue", name),))]
    assert queue_value("scheduled", "q000") == 3 and queue_value("scheduled", "mail") == 0
    assert queue_value("scheduled", "(other)") == 300 + 2 * len(busiest) - 3 * 20
    assert queue_value("paused", "q000") == 1 and queue_value("paused", "(other)") == 1
    assert queue_value("running", "(other)") == 0
    names = {dict(labels)["name"] for name, labels in samples
             if name == "taskrunner_periodic_enabled"}
    # p44 fails; then the soonest due: the shortest intervals.
    assert names == {"p44", "(other)"} | {"p%02d" % n for n in range(19)}
    assert samples[("taskrunner_periodic_consecutive_failures", (("name", "p44"),))] == 3
    assert samples[("taskrunner_periodic_enabled", (("name", "(other)"),))] == 39
    assert samples[("taskrunner_periodic_consecutive_failures", (("name", "(other)"),))] == 0
    assert 0 < samples[("taskrunner_periodic_seconds_until_due", (("name", "(other)"),))] \
        <= 20 * 60


def test_a_scrape_stays_small_whatever_the_number_of_queue_names(sqlite_db):
    """2,000 queue names and 1,000 periodic tasks (bench/metrics_cardinality.py scrapes 20,000
    and 10,000: 39 KB, 744 lines, 0.10 s): the default cap names 100 of each and the scrape
    does not grow with them."""
    from bench.metrics_cardinality import fill
    from taskrunner.web.metrics import exposition
    queue = sqlite_db.queue()
    try:
        fill(queue, 2000, 1000)
        text = exposition(queue.store)
    finally:
        queue.close()
    assert len(text) < 100_000 and text.count(b"\n") < 1000, (len(text), text.count(b"\n"))


# -- secrets in task data; a credential for /metrics (issue 31) -------------------------------

SECRET_DATA = {"user": "ann", "db_password": "hunter2",
               "nested": [{"X-Api-Token": "t0k3n"}], "count": 3}


def _secret_task(queue):
    """A task whose data and results hold secrets, run once."""
    task_id = queue.add_task("taskrunner.handlers.Echo", SECRET_DATA)
    queue.run_pending()
    return task_id


def _no_secret(text):
    return "hunter2" not in text and "t0k3n" not in text


def test_secret_keys_are_masked_on_the_dashboard(sqlite_db):
    queue = sqlite_db.queue()
    task_id = _secret_task(queue)
    served = Served(queue.store)
    try:
        for path in ("/tasks/%d" % task_id, "/api/parts?page=task&id=%d" % task_id):
            body = fetch(served.url + path)[1]
            assert _no_secret(body) and "ann" in body and "********" in body, path
    finally:
        served.stop()
    assert queue.get_task(task_id).data == SECRET_DATA       # the API gets it as given
    queue.close()


def test_secret_keys_are_masked_in_the_cli_and_in_log_lines(sqlite_db, tmp_path):
    import json
    queue = sqlite_db.queue()
    task_id = _secret_task(queue)
    from taskrunner.periodic import scheduler as periodic
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "daily",
                          data={"token": "t0k3n"})
    queue.close()
    for args in (["show", str(task_id)], ["show", str(task_id), "--json"], ["tasks"],
                 ["tasks", "--json"], ["runs", str(task_id), "--json"],
                 ["wait", str(task_id), "--json"], ["wait", str(task_id)],
                 ["periodic", "list", "--json"]):
        out = ok(taskrunner(*args, url=sqlite_db.url))
        assert _no_secret(out), args
    shown = json.loads(ok(taskrunner("show", str(task_id), "--json", url=sqlite_db.url)))
    assert shown["data"]["db_password"] == "********" and shown["data"]["user"] == "ann"
    result = taskrunner("--log-level", "debug", "add", "taskrunner.handlers.Echo", "--data",
                        json.dumps(SECRET_DATA), url=sqlite_db.url)
    assert result.returncode == 0 and "INSERT INTO task_queue" in result.stderr
    assert _no_secret(result.stderr), result.stderr
    config = sqlite_db.write_config(tmp_path / "c.toml", "[task]\nsecret_keys = []\n")
    assert "hunter2" in ok(taskrunner("show", str(task_id), config=config))


def test_metrics_take_a_credential_of_their_own(sqlite_db):
    queue = sqlite_db.queue()
    served = Served(queue.store, password_hash=hash_password("pages-pw"),
                    metrics_password_hash=hash_password("scrape-pw"))
    try:
        assert fetch(served.url + "/metrics", password="scrape-pw")[0] == 200
        assert fetch(served.url + "/metrics", password="pages-pw")[0] == 200
        assert fetch(served.url + "/metrics")[0] == 401
        assert fetch(served.url + "/", password="scrape-pw")[0] == 401
        assert fetch(served.url + "/tasks", password="pages-pw")[0] == 200
    finally:
        served.stop()
        queue.close()


def test_workflow_page_shows_counts_progress_outcome_and_the_graph(sqlite_db):
    """/workflows/ID: counts per state, progress, outcome and each task with its state and
    the tasks it runs after (links); the task page links to it; a bad or unknown id is a
    400 or 404, never a 500; the workflow's name is escaped."""
    queue = sqlite_db.queue()
    step = "taskrunner.handlers.Echo"
    wf = queue.add_workflow([{"key": "a", "handler": step},
                             {"key": "b", "handler": step, "after": ["a"]},
                             {"key": "c", "handler": step, "after": ["a"]},
                             {"key": "d", "handler": step, "after": ["b", "c"]}],
                            name="<b>nightly</b>")
    a, b, c, d = wf.task_ids
    queue.run_pending(max_runs=1)
    served = Served(queue.store)
    try:
        status, body, headers = fetch(served.url + "/workflows/%d" % wf.id)
        assert status == 200, body[-300:]
        assert "&lt;b&gt;nightly&lt;/b&gt;" in body and "<b>nightly" not in body
        assert "default-src 'self'" in headers["Content-Security-Policy"]
        counts = re.search(r'id="workflow-counts">(.*?)</section>', body, re.S).group(1)
        for word, n in (("success", 1), ("scheduled", 2), ("waiting", 1)):
            assert 'tile-%s"><span class="n">%d<' % (word, n) in counts, counts
        assert "25%" in body and "running" in body
        graph = re.search(r'<ol class="graph".*?</ol>\s*</section>', body, re.S).group(0)
        for task_id in (a, b, c, d):
            assert 'href="/tasks/%d"' % task_id in graph
        row_d = re.search(r'<li[^>]*id="wf-task-%d".*?</li>' % d, graph, re.S).group(0)
        assert "waiting" in row_d and 'href="/tasks/%d"' % b in row_d \
            and 'href="/tasks/%d"' % c in row_d
        task_page = fetch(served.url + "/tasks/%d" % d)[1]
        assert 'href="/workflows/%d"' % wf.id in task_page
        parts = json.loads(fetch(served.url + "/api/parts?page=workflow&id=%d" % wf.id)[1])
        assert 'href="/tasks/%d"' % d in parts["workflow-live"]
        queue.run_pending()
        body = fetch(served.url + "/workflows/%d" % wf.id)[1]
        assert "100%" in body and 'status-success">success' in body
        for path, code in (("/workflows/999", 404), ("/workflows/0", 404),
                           ("/workflows/abc", 404), ("/workflows/99999999999999999999999", 404),
                           ("/api/parts?page=workflow&id=999", 404),
                           ("/api/parts?page=workflow&id=0", 400)):
            status, body, _ = fetch(served.url + path)
            assert status == code and "Traceback" not in body, (path, status)
        # A fan-in over 25 parents links the first 20 of them.
        wide = queue.group([step] * 25, then=step)
        body = fetch(served.url + "/workflows/%d" % wide.id)[1]
        row = re.search(r'<li[^>]*id="wf-task-%d".*?</li>' % wide.task_ids[-1], body,
                        re.S).group(0)
        assert row.count('href="/tasks/') == 21 and "and 5 more" in row
    finally:
        served.stop()
        queue.close()
