"""The verbs operators of Mission Control and Oban Web expect (issue #29): run a periodic
task now, delete finished tasks."""
import json
import re
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")

from taskrunner.errors import InputError, StateError  # noqa: E402
from taskrunner.periodic import scheduler as periodic  # noqa: E402
from taskrunner.store.models import utcnow  # noqa: E402

from conftest import ok, taskrunner, usage_error, utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402
from test_dashboard import notice_of, token_of  # noqa: E402


def test_a_periodic_task_runs_now_without_moving_its_schedule(database):
    queue = database.queue()
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "*-*-* 03:00",
                          data={"k": 1})
    before = periodic.PeriodicScheduler(queue.store).next_due()
    out = json.loads(ok(taskrunner("periodic", "run", "nightly", "--json", url=database.url)))
    task = queue.get_task(out["task_id"])
    assert (task.handler, task.data, task.status) == ("taskrunner.handlers.Echo", {"k": 1},
                                                      "scheduled")
    assert task.periodic_task_id is not None
    assert periodic.PeriodicScheduler(queue.store).next_due() == before
    # Like its due times, never two of its tasks at once.
    with pytest.raises(StateError, match="has not finished"):
        periodic.run_now(queue.store, "nightly")
    usage_error(taskrunner("periodic", "run", "nightly", url=database.url), "has not finished")
    assert queue.run_pending() == 1
    assert queue.get_task(out["task_id"]).status == "success"
    assert periodic.run_now(queue.store, "nightly") > out["task_id"]
    with pytest.raises(InputError, match="no periodic task named 'nope'"):
        periodic.run_now(queue.store, "nope")
    queue.close()


def test_run_now_from_the_dashboard(sqlite_db):
    queue = sqlite_db.queue()
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "*-*-* 03:00")
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/periodic")[1]
        assert "Run now" in body
        status, _, headers = fetch(served.url + "/periodic/run",
                                   data="csrf=%s&name=nightly" % token_of(served, "/periodic"))
        assert status == 303 and re.search(r"periodic task 'nightly': task \d+ submitted",
                                           notice_of(headers)), notice_of(headers)
        assert len(queue.tasks()) == 1
    finally:
        served.stop()
        queue.close()


def test_delete_removes_ended_tasks_and_their_runs_by_id_or_filter(database):
    queue = database.queue()
    done = [queue.add_task("taskrunner.handlers.Echo") for _ in range(3)]
    given_up = queue.add_task("taskrunner.handlers.Fail", max_retries=1)
    queue.run_pending()
    live = queue.add_task("taskrunner.handlers.Echo",
                          scheduled_on=utc(utcnow()) + timedelta(days=1))
    queue.close()
    url = database.url
    result = taskrunner("delete", str(done[0]), str(live), "99999", "--json", url=url)
    assert result.returncode == 1, result                  # 99999: no such task
    out = json.loads(result.stdout)
    assert out["changed"] == [done[0]] and out["missing"] == [99999]
    assert "task %d has not ended" % live in out["refused"][0]
    assert "deleted 2 of 2" in ok(taskrunner("delete", "--status", "success", url=url))
    queue = database.queue()
    assert [t.id for t in queue.tasks()] == [live, given_up]
    assert queue.store.Run.select().where(queue.store.Run.task_id.in_(done)).count() == 0
    queue.close()
    usage_error(taskrunner("delete", url=url), "give task ids, or filters")
    usage_error(taskrunner("delete", str(live), url=url), "task %d has not ended" % live)
    usage_error(taskrunner("delete", "99999", url=url), "no task with id 99999")


def test_delete_from_the_dashboard_asks_first(sqlite_db):
    queue = sqlite_db.queue()
    ended = queue.add_task("taskrunner.handlers.Echo")
    queue.run_pending()
    other = queue.add_task("taskrunner.handlers.Echo")
    queue.run_pending()
    served = Served(queue.store)
    try:
        token = token_of(served, "/tasks/%d" % ended)
        assert "Delete…" in fetch(served.url + "/tasks/%d" % ended)[1]
        status, body, _ = fetch(served.url + "/tasks/%d/delete" % ended, data="csrf=%s" % token)
        assert status == 200 and "Yes, delete task %d" % ended in body
        assert len(queue.tasks()) == 2                       # nothing deleted yet
        status, _, headers = fetch(served.url + "/tasks/%d/delete" % ended,
                                   data="csrf=%s&confirm=yes" % token)
        assert status == 303 and "task %d deleted" % ended in notice_of(headers)
        assert [t.id for t in queue.tasks()] == [other]
        status, body, _ = fetch(served.url + "/tasks/bulk",
                                data="csrf=%s&action=delete&status=success" % token)
        assert status == 200 and "Yes, delete 1 task(s)" in body
        fetch(served.url + "/tasks/bulk", data="csrf=%s&action=delete&status=success&confirm=yes"
              % token)
        assert queue.tasks() == []
    finally:
        served.stop()
        queue.close()


def test_a_task_page_shows_the_latest_traceback_and_collapses_repeats(sqlite_db):
    queue = sqlite_db.queue()
    task_id = queue.add_task("sample_handlers.FailTimes", {"fail": 4}, max_retries=6)
    start = utc(utcnow())
    for hour in range(5):
        queue.run_pending(now=start + timedelta(hours=hour))
    runs = queue.runs_of(task_id)
    assert [r.status for r in runs] == ["error"] * 4 + ["success"]
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks/%d" % task_id)[1]
        # Each attempt's message differs ("attempt N fails"): four tracebacks, none repeated.
        assert len(re.findall(r'<pre class="traceback">', body)) == 4
    finally:
        served.stop()
    same = queue.add_task("taskrunner.handlers.Fail", {"code": "Down"}, max_retries=5)
    for hour in range(6):
        queue.run_pending(now=start + timedelta(hours=hour))
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks/%d" % same)[1]
        shown = re.findall(r'<section class="card" id="traceback-(\d+)">', body)
        latest = queue.runs_of(same)[-1]
        assert shown == [str(latest.id)], body
        assert "The same traceback in 4 earlier runs: attempts 1, 2, 3, 4." in body
        assert body.count('href="#traceback-%d"' % latest.id) == 5
    finally:
        served.stop()
        queue.close()
