"""A task waiting for its parents (DESIGN "Graph"; issue 26) reads ``waiting`` in every view
— the API, ``show``, ``tasks`` and its ``--status`` filter, ``--json``, the dashboard's task
page and list, ``/metrics`` — as its workflow counts it, with what it waits for (its parents
not done yet); released, it is ``scheduled`` like any task. On SQLite, PostgreSQL and
MariaDB."""
import json
import re
from datetime import datetime, timedelta, timezone

import pytest

from conftest import Database, ok, taskrunner
from dashboard_helpers import Served, fetch
from taskrunner import TaskQueue
from taskrunner.store.models import CANCELLED, SUCCESS
from taskrunner.web.metrics import exposition

STEP = "workflow_handlers.Step"


def _ids(listed):
    return sorted(t["id"] for t in listed)


@pytest.mark.timeout(180)
def test_a_task_waiting_for_its_parents_is_waiting_in_every_view(database):
    queue = database.queue()
    wf = queue.add_workflow([{"key": "a", "handler": STEP}, {"key": "b", "handler": STEP},
                             {"key": "c", "handler": STEP, "after": ["a", "b"]}])
    a, b, c = wf.task_ids
    # The API, and the workflow: one answer.
    task = queue.get_task(c)
    assert (task.status, task.waiting_parents, task.runs) == ("waiting", 2, 0)
    info = queue.workflow(wf.id)
    assert info.counts == {"scheduled": 2, "waiting": 1}
    assert {t.id: t.state for t in info.tasks} == {
        t: queue.get_task(t).status for t in (a, b, c)}
    assert [t.id for t in queue.tasks(status="waiting")] == [c]
    assert sorted(t.id for t in queue.tasks(status="scheduled")) == [a, b]
    # The CLI: --json, the table, its filter and `show`.
    url = database.url
    listed = json.loads(ok(taskrunner("tasks", "--status", "waiting", "--json", url=url)))
    assert [(t["id"], t["status"], t["waiting_parents"]) for t in listed] == [(c, "waiting", 2)]
    assert _ids(json.loads(ok(taskrunner("tasks", "--status", "scheduled", "--json",
                                         url=url)))) == [a, b]
    table = ok(taskrunner("tasks", "--status", "waiting", url=url))
    row = next(line for line in table.splitlines() if line.split()[:1] == [str(c)])
    assert " waiting " in row and "2 parents" in row, table
    assert "showing 1 of 1 tasks" in table
    shown = ok(taskrunner("show", str(c), url=url))
    assert re.search(r"^status:\s+waiting$", shown, re.M), shown
    assert json.loads(ok(taskrunner("show", str(c), "--json", url=url)))["status"] == "waiting"
    # /metrics.
    text = exposition(queue.store).decode()
    assert 'taskrunner_tasks{status="waiting"} 1.0' in text, text
    assert 'taskrunner_tasks{status="scheduled"} 2.0' in text, text
    # The dashboard: the task page, the list, and the list filtered.
    served = Served(queue.store)
    try:
        status, body, _ = fetch(served.url + "/tasks/%d" % c)
        assert status == 200 and 'status-waiting">waiting' in body, body[-500:]
        assert "Waiting for" in body and "2 parents" in body
        body = fetch(served.url + "/tasks?status=waiting")[1]
        assert 'href="/tasks/%d"' % c in body and 'href="/tasks/%d"' % a not in body
        body = fetch(served.url + "/tasks")[1]
        row = re.search(r'<tr><td[^>]*><a href="/tasks/%d">.*?</tr>' % c, body, re.S).group(0)
        assert 'status-waiting">waiting' in row and "2 parents" in row, row
        body = fetch(served.url + "/tasks?status=scheduled")[1]
        assert 'href="/tasks/%d"' % c not in body and 'href="/tasks/%d"' % a in body
    finally:
        served.stop()
    # One parent done: still waiting, for one; both: released, scheduled like any task.
    queue.run_pending(max_runs=1)
    task = queue.get_task(c)
    assert (task.status, task.waiting_parents) == ("waiting", 1)
    assert "1 parent" in ok(taskrunner("tasks", "--status", "waiting", url=url))
    queue.run_pending(max_runs=1)
    task = queue.get_task(c)
    assert (task.status, task.waiting_parents, task.runs) == ("scheduled", None, 1)
    assert queue.tasks(status="waiting") == []
    assert queue.workflow(wf.id).counts == {"success": 2, "scheduled": 1}
    queue.run_pending()
    assert queue.get_task(c).status == SUCCESS
    queue.close()


@pytest.mark.timeout(120)
def test_released_not_due_rearmed_and_cancelled_dependents_read_as_their_workflow(database):
    """A dependent released before its own time is ``scheduled``; one cancelled by a given-up
    parent is ``cancelled``; the parent's retry makes it ``waiting`` again."""
    queue = database.queue(task={"retry_backoff": 0})
    parent = queue.add_task(STEP)
    later = queue.add_task(STEP, after=[parent],
                           scheduled_on=datetime.now(timezone.utc) + timedelta(hours=1))
    assert queue.get_task(later).status == "waiting"
    queue.run_pending()
    task = queue.get_task(later)
    assert (task.status, task.waiting_parents, task.runs) == ("scheduled", None, 0)
    assert task.next_run_on is not None
    failing = queue.add_task(STEP, {"fail": True}, max_retries=1)
    child = queue.add_task(STEP, after=[failing])
    grandchild = queue.add_task(STEP, after=[child])
    assert [t.id for t in queue.tasks(status="waiting")] == [grandchild, child]
    queue.run_pending()
    assert queue.get_task(child).status == CANCELLED
    assert queue.tasks(status="waiting") == []
    queue.store.Task.update(data='{}').where(queue.store.Task.id == failing).execute()
    assert queue.retry(failing) == 2
    assert [(t.id, t.status, t.waiting_parents) for t in queue.tasks(
        status="waiting")] == [(grandchild, "waiting", 1), (child, "waiting", 1)]
    queue.run_pending()
    assert queue.get_task(grandchild).status == SUCCESS
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mysql"])
def test_a_database_migrated_with_tasks_waiting_for_parents_shows_them_waiting(backend,
                                                                              tmp_path):
    """A database at 0021's schema with a task waiting for its parents (stored ``scheduled``
    then): migrated, it reads ``waiting``, and is released as before."""
    db = Database(backend, tmp_path, empty=True)
    try:
        store = db.store_at("0021_flow_control")
        for waiting, dependents in (("NULL", 1), ("1", 0)):
            store.db.execute_sql(
                "INSERT INTO task_queue (queued_on, scheduled_on, handler, data, priority, "
                "last_status, max_retries, runs_failed, run_count, run_timeout, updated_on, "
                "waiting_parents, dependents) VALUES ('2026-01-01 00:00:00', "
                "'2026-01-01 00:00:00', '%s', '{}', 0, 'scheduled', 5, 0, %d, 60, "
                "'2026-01-01 00:00:00', %s, %d)" % (STEP, dependents, waiting, dependents))
        store.db.execute_sql(
            "INSERT INTO task_runs (task_id, created_on, updated_on, attempt, active_task_id, "
            "priority, scheduled_on, status, percent_completed, queue) VALUES (1, "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 1, 1, 0, '2026-01-01 00:00:00', "
            "'scheduled', 0, 'default')")
        store.db.execute_sql("INSERT INTO task_dependencies (task_id, parent_id, satisfied) "
                             "VALUES (2, 1, %s)" % ("0" if backend != "postgresql" else "false"))
        store.close()
        queue = TaskQueue(db.url, migrate=True)
        assert queue.get_task(1).status == "scheduled"
        assert (queue.get_task(2).status, queue.get_task(2).waiting_parents) == ("waiting", 1)
        queue.run_pending()
        assert queue.get_task(1).status == SUCCESS == queue.get_task(2).status
        queue.close()
    finally:
        db.drop()
