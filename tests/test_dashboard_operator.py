"""What an operator reaches for on the dashboard: the next run in the task list, the action
notice kept out of the URL, the status first on a phone, the workflows list with its Cancel
button, and searching tasks by their data."""
import re
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")

from taskrunner.store.models import utcnow  # noqa: E402

from conftest import utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402


def rows_of(body):
    return re.findall(r"<tr><td[ >].*?</tr>", body, re.S)


def test_task_list_shows_each_tasks_next_run(sqlite_db):
    queue = sqlite_db.queue()
    retrying = queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                              retry_backoff=3600)
    queue.run_pending()
    next_run = queue.get_task(retrying).next_run_on
    assert next_run is not None and next_run > utc(utcnow()) + timedelta(minutes=30)
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks")[1]
        assert "<th>Next run</th>" in body
        row = next(r for r in rows_of(body) if ">%d<" % retrying in r)
        assert 'datetime="%s"' % next_run.isoformat() in row, row
    finally:
        served.stop()
        queue.close()


def test_an_actions_notice_is_shown_once_and_never_carried_in_the_url(sqlite_db):
    """The notice rides in a short-lived cookie (HttpOnly, SameSite=Strict) that the next
    page reads and clears: a reload or a bookmark does not repeat it, a link cannot forge
    one, and its text stays escaped."""
    from test_dashboard import notice_of, token_of
    queue = sqlite_db.queue()
    task_id = queue.add_task("taskrunner.handlers.Echo",
                             scheduled_on=utc(utcnow()) + timedelta(days=1))
    served = Served(queue.store)
    try:
        status, _, headers = fetch(served.url + "/tasks/%d/cancel" % task_id,
                                   data="csrf=" + token_of(served, "/tasks/%d" % task_id))
        assert status == 303 and headers["Location"] == "/tasks/%d" % task_id
        cookie = headers["Set-Cookie"]
        for part in ("HttpOnly", "SameSite=Strict", "Path=/;", "Max-Age="):
            assert part in cookie, cookie
        assert notice_of(headers) == "task %d cancelled" % task_id
        sent = {"Cookie": cookie.split(";")[0]}
        status, body, headers = fetch(served.url + headers["Location"], headers=sent)
        assert status == 200 and ">task %d cancelled<" % task_id in body
        assert headers["Set-Cookie"].startswith("taskrunner_notice=;") \
            and "Max-Age=0" in headers["Set-Cookie"]
        # What the browser sends after that (the cookie cleared): no notice.
        assert "task %d cancelled" % task_id not in fetch(served.url + "/tasks/%d" % task_id)[1]
        # A notice in the URL is not shown; one in the cookie is text, not markup.
        body = fetch(served.url + "/tasks?notice=%3Cb%3Eforged%3C%2Fb%3E")[1]
        assert "forged" not in body
        body = fetch(served.url + "/tasks", headers={
            "Cookie": "other=1; taskrunner_notice=%3Cb%3Ehi%3C%2Fb%3E"})[1]
        assert '<p class="notice" role="status">&lt;b&gt;hi&lt;/b&gt;</p>' in body
    finally:
        served.stop()
        queue.close()


def test_on_a_phone_the_task_list_shows_each_tasks_status_first(sqlite_db):
    """Below 700 px the stylesheet lays each task out as a card, its status first: each cell
    names its column (data-label) and the rule ordering the status cell first selects the
    label the Status cell carries. (No browser here: test_dashboard_browser.py has one.)"""
    queue = sqlite_db.queue()
    task_id = queue.add_task("taskrunner.handlers.Echo")
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks")[1]
        css = fetch(served.url + "/static/app.css")[1]
    finally:
        served.stop()
        queue.close()
    headers = re.findall(r"<th>(.*?)</th>", body.split('<table class="tasks">')[1])
    row = next(r for r in rows_of(body) if ">%d<" % task_id in r)
    cells = re.findall(r'<td data-label="([^"]*)">(.*?)</td>', row, re.S)
    assert [label for label, _ in cells] == headers and "Status" in headers
    assert 'status-scheduled">scheduled' in dict(cells)["Status"]
    phone = re.sub(r"/\*.*?\*/", "", css.split("@media (max-width: 700px)")[1], flags=re.S)
    rules = dict(re.findall(r"([^{}]+)\{([^}]*)\}", phone))
    rules = {selector.strip(): rule for selector, rule in rules.items()}
    assert "order: -1" in rules['table.tasks td[data-label="Status"]']
    assert "display: flex" in rules["table.tasks tr"]
    assert "display: none" in rules["table.tasks thead"]
    assert "attr(data-label)" in rules["table.tasks td::before"]


def test_workflows_page_lists_each_workflow_and_cancels_an_unfinished_one(sqlite_db):
    """/workflows: newest first, each with its name (escaped), outcome, progress, counts per
    state and creation time; Cancel (CSRF-checked) on those that have not ended does what
    `taskrunner workflow cancel ID` does; linked from the navigation."""
    from test_dashboard import notice_of, token_of
    queue = sqlite_db.queue()
    step = "taskrunner.handlers.Echo"
    queue.chain(step, step)
    queue.run_pending()
    later = utc(utcnow()) + timedelta(days=1)
    open_one = queue.add_workflow([{"key": "a", "handler": step, "scheduled_on": later},
                                   {"key": "b", "handler": step, "after": ["a"]}],
                                  name="<b>nightly</b>")
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/workflows")[1]
        assert '<a href="/workflows" class="active">Workflows</a>' in body.split("</nav>")[0]
        rows = rows_of(body)
        assert len(rows) == 2 and 'href="/workflows/%d"' % open_one.id in rows[0]
        first, second = rows
        assert "&lt;b&gt;nightly&lt;/b&gt;" in first and "<b>nightly" not in body
        assert 'status-running">running' in first and "0 of 2 final" in first
        assert "1 <span" in first and ">scheduled<" in first and ">waiting<" in first
        assert "<time" in first
        assert 'action="/workflows/%d/cancel"' % open_one.id in first
        assert 'status-success">success' in second and "2 of 2 final" in second
        assert "/cancel" not in second
        assert 'action="/workflows/%d/cancel"' % open_one.id in fetch(
            served.url + "/workflows/%d" % open_one.id)[1]
        assert fetch(served.url + "/workflows/%d/cancel" % open_one.id, data="x=1")[0] == 403
        assert {t.status for t in queue.tasks()} == {"success", "scheduled", "waiting"}
        token = token_of(served, "/workflows")
        status, _, headers = fetch(served.url + "/workflows/%d/cancel" % open_one.id,
                                   data="csrf=" + token)
        assert status == 303 and headers["Location"] == "/workflows"
        assert notice_of(headers) == ("workflow %d: 2 task(s) cancelled, 0 running one(s) "
                                      "asked to stop" % open_one.id)
        assert queue.workflow(open_one.id).outcome == "cancelled"
        assert "/cancel" not in fetch(served.url + "/workflows")[1]
        status, body, _ = fetch(served.url + "/workflows/999/cancel", data="csrf=" + token)
        assert status == 404 and "no workflow with id 999" in body
        assert fetch(served.url + "/workflows?before=x")[0] == 400
    finally:
        served.stop()
        queue.close()


def test_tasks_are_found_by_a_key_and_value_of_their_data_on_every_database(queue):
    """``order_id=44`` finds the tasks whose data has that top-level key with that scalar
    value, given as a number or a string; nothing nested, no object or array (a secret key
    nested in one cannot be tested by guessing its whole value), never a secret key."""
    from taskrunner.errors import InputError
    from taskrunner.reads import data_search, summaries
    echo = "taskrunner.handlers.Echo"
    ids = {name: queue.add_task(echo, data) for name, data in (
        ("int", {"order_id": 44, "customer": "ann"}), ("text", {"order_id": "44"}),
        ("longer", {"order_id": 440}), ("other", {"order_id": 45}),
        ("nested", {"order": {"order_id": 44}}), ("flag", {"urgent": True}),
        ("list", [44, {"order_id": 44}]),
        ("creds", {"creds": {"password": "hunter2"}}), ("secret", {"db_password": "hunter2"}))}

    def found(text, **others):
        chosen = summaries.TaskFilter(data=data_search.parse(queue.store, text), **others)
        return sorted(t.id for t in summaries.find_tasks(queue.store, chosen).tasks)
    assert found("order_id=44") == sorted([ids["int"], ids["text"]])
    assert found(" order_id = 44 ", handler=echo) == sorted([ids["int"], ids["text"]])
    assert found("order_id=44", handler="taskrunner.handlers.Fail") == []
    assert found("customer=ann") == [ids["int"]]
    assert found("urgent=true") == [ids["flag"]]
    assert found("order_id=4") == [] and found("order={\"order_id\": 44}") == []
    assert found('creds={"password": "hunter2"}') == []
    assert found('creds={"password":"hunter2"}') == []
    assert summaries.matching_task_ids(queue.store, summaries.TaskFilter(
        data=("order_id", "45")), 10) == [ids["other"]]
    for bad in ("order_id", "=44", "a.b=1", 'x"=1', "db_password=hunter2",
                "X-Api-Token=t"):
        with pytest.raises(InputError):
            data_search.parse(queue.store, bad)


def test_tasks_page_searches_the_data_and_keeps_the_search_in_its_links(sqlite_db):
    queue = sqlite_db.queue()
    wanted = queue.add_task("taskrunner.handlers.Echo", {"order_id": 44})
    for n in range(60):
        queue.add_task("taskrunner.handlers.Echo", {"order_id": 1000 + n % 2})
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks?data=order_id%3D44")[1]
        rows = rows_of(body)
        assert len(rows) == 1 and ">%d<" % wanted in rows[0]
        assert 'name="data" value="order_id=44"' in body
        assert 'name="data" value="order_id=44"' in body.split('class="bulk"')[1]
        body = fetch(served.url + "/tasks?data=order_id%3D1001")[1]
        assert len(rows_of(body)) == 30 and "Older" not in body
        body = fetch(served.url + "/tasks?data=order_id%3D1000")[1]
        assert len(rows_of(body)) == 30
        status, body, _ = fetch(served.url + "/tasks?data=db_password%3Dx")
        assert status == 400 and "secret" in body
        assert fetch(served.url + "/tasks?data=nonsense")[0] == 400
    finally:
        served.stop()
        queue.close()


def test_a_data_search_reads_a_window_of_ids_a_page(sqlite_db, monkeypatch):
    """No index serves a data search: each page reads DATA_WINDOW ids at most, and pages on
    below them until the oldest task."""
    from taskrunner.reads import summaries
    monkeypatch.setattr(summaries, "DATA_WINDOW", 10)
    queue = sqlite_db.queue()
    ids = [queue.add_task("taskrunner.handlers.Echo", {"order_id": 44 if n % 7 == 0 else n})
           for n in range(35)]
    chosen = summaries.TaskFilter(data=("order_id", "44"))
    seen, before, pages = [], None, 0
    while True:
        page = summaries.find_tasks(queue.store, chosen, before, limit=50)
        assert page.searched_from is not None and all(t.id >= page.searched_from
                                                      for t in page.tasks)
        seen += [t.id for t in page.tasks]
        pages += 1
        if page.next_before is None:
            break
        before = page.next_before
    assert seen == [ids[n] for n in range(34, -1, -1) if n % 7 == 0] and pages == 4
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks?data=order_id%3D44")[1]
        assert "data searched in tasks from id" in body and "Older" in body
    finally:
        served.stop()
        queue.close()
