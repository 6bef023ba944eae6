"""Why a task that has not ended is not running (``blocked_by``), said by ``show`` (text and
JSON), ``tasks --json``, the Python API and the dashboard's task page; and ``queue list``
counting what ``tasks --status S --queue Q`` counts."""
import json
from datetime import timedelta

from prometheus_client.parser import text_string_to_metric_families

from taskrunner.fleet import liveness
from taskrunner.reads import records as reads
from taskrunner.runs import lifecycle
from taskrunner.store.models import utcnow

from conftest import ok, taskrunner, utc
from dashboard_helpers import Served, fetch


def reasons(task):
    return [b["reason"] for b in task["blocked_by"] or []]


def held_by_a_key(queue):
    """(running, held): two tasks of concurrency key ``k`` (limit 1), the first running."""
    running = queue.add_task("taskrunner.handlers.Echo", concurrency_key="k",
                             concurrency_limit=1)
    queue.process_queue()       # a keyed task's run is created by the queue pass
    claimed = lifecycle.claim(queue.store, liveness.register(queue.store).id)
    assert claimed.task_id == running
    held = queue.add_task("taskrunner.handlers.Echo", concurrency_key="k", concurrency_limit=1)
    queue.process_queue()
    return running, held


def test_a_task_held_by_a_concurrency_key_says_so_on_every_face(database):
    queue = database.queue()
    running, held = held_by_a_key(queue)
    url = database.url
    shown = json.loads(ok(taskrunner("show", str(held), "--json", url=url)))
    assert shown["status"] == "scheduled"
    [blocker] = shown["blocked_by"]
    assert (blocker["reason"], blocker["key"], blocker["limit"], blocker["tasks"]) == (
        "concurrency-key", "k", 1, [{"id": running, "status": "running"}])
    assert blocker["text"] == "held by concurrency key k (limit 1): task %d running" % running
    listed = {t["id"]: t for t in json.loads(ok(taskrunner("tasks", "--json", url=url)))}
    assert listed[held]["blocked_by"] == shown["blocked_by"]
    assert listed[running]["blocked_by"] is None         # it runs: nothing holds it back
    assert queue.get_task(held).blocked_by == shown["blocked_by"]
    text = ok(taskrunner("show", str(held), url=url))
    assert "waiting because:\n  held by concurrency key k (limit 1): task %d running" \
        % running in text
    assert "held by concurrency key k" in ok(taskrunner("tasks", "--wide", url=url))
    served = Served(queue.store)
    try:
        status, page, _ = fetch(served.url + "/tasks/%d" % held)
        assert status == 200
        assert "<dt>Waiting because</dt>" in page
        assert "held by concurrency key k (limit 1): task %d running" % running in page
        assert "held by concurrency key k" in fetch(served.url + "/tasks")[1]
    finally:
        served.stop()
    queue.close()


def test_each_reason_a_task_waits(sqlite_db):
    queue = sqlite_db.queue()
    later = utc(utcnow()) + timedelta(hours=2)
    queue.set_rate_limit("slow", "1/h")
    spent = queue.add_task("taskrunner.handlers.Echo", rate_key="slow")
    retrying = queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                              retry_backoff=3600)
    snoozed = queue.add_task("sample_handlers.Snooze", {"times": 1})
    queue.run_pending()
    throttled = queue.add_task("taskrunner.handlers.Echo", rate_key="slow")
    not_due = queue.add_task("taskrunner.handlers.Echo", scheduled_on=later)
    child = queue.add_task("taskrunner.handlers.Echo", after=[not_due])
    paused = queue.add_task("taskrunner.handlers.Echo", queue="mail")
    queue.pause_queue("mail")
    due = queue.add_task("taskrunner.handlers.Echo")
    got = {t.id: t.to_json() for t in queue.tasks(limit=None)}
    assert got[spent]["blocked_by"] is None
    assert reasons(got[retrying]) == ["backoff"]
    assert got[retrying]["status"] == "retrying"
    assert reasons(got[snoozed]) == ["snoozed"]
    assert got[snoozed]["blocked_by"][0]["text"].startswith("snoozed until ")
    [rate] = got[throttled]["blocked_by"]
    assert (rate["reason"], rate["kind"], rate["name"]) == ("rate-limit", "key", "slow")
    assert 0 < rate["next_slot_in"] <= 3600
    assert rate["text"].startswith("rate limit of key slow: next slot in ")
    assert reasons(got[not_due]) == ["not-due"]
    assert got[not_due]["blocked_by"][0]["until"] == later.isoformat()
    assert reasons(got[child]) == ["parents"]
    assert got[child]["blocked_by"][0]["tasks"] == [not_due]
    assert got[child]["blocked_by"][0]["text"] == "waiting for 1 parent: task %d" % not_due
    assert reasons(got[paused]) == ["queue-paused", "due"]
    assert got[paused]["blocked_by"][0]["text"] == "queue mail paused"
    assert reasons(got[due]) == ["due"]
    queue.close()


def test_reading_why_costs_the_same_for_a_page_of_three_or_of_thirty(sqlite_db):
    queue = sqlite_db.queue()
    running, _ = held_by_a_key(queue)
    queue.set_rate_limit("slow", "1/h")
    queue.pause_queue("mail", create=True)
    later = utc(utcnow()) + timedelta(hours=2)

    def add_blocked():
        parent = queue.add_task("taskrunner.handlers.Echo", scheduled_on=later, queue="mail")
        queue.add_task("taskrunner.handlers.Echo", after=[parent])
        queue.add_task("taskrunner.handlers.Echo", concurrency_key="k", concurrency_limit=1)
        queue.add_task("taskrunner.handlers.Echo", rate_key="slow")
    db = queue.store.db
    executed = []
    plain = db.execute_sql

    def counted(sql, params=None, *args, **kwargs):
        executed.append(sql)
        return plain(sql, params, *args, **kwargs)

    def statements_to_list():
        queue.process_queue()
        executed.clear()
        db.execute_sql = counted
        try:
            tasks = reads.list_tasks(queue.store, limit=None)
        finally:
            db.execute_sql = plain
        assert all(t.blocked_by for t in tasks if t.id != running)
        return len(tasks), len(executed)
    add_blocked()
    few = statements_to_list()
    for _ in range(9):
        add_blocked()
    many = statements_to_list()
    assert many[0] > few[0] * 5
    assert many[1] == few[1], (few, many)
    queue.close()


def test_queue_list_counts_what_the_task_filter_counts(database):
    queue = database.queue()
    held_by_a_key(queue)
    later = utc(utcnow()) + timedelta(days=1)
    queue.add_task("taskrunner.handlers.Echo", scheduled_on=later)
    queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                   retry_backoff=3600, queue="reports")
    queue.run_pending()
    # A queue no config declares, with no run yet: only its tasks name it.
    parent = queue.add_task("taskrunner.handlers.Echo", scheduled_on=later, queue="undeclared")
    queue.add_task("taskrunner.handlers.Echo", after=[parent], queue="undeclared")
    cancelled = queue.add_task("taskrunner.handlers.Echo", scheduled_on=later,
                               queue="undeclared")
    queue.cancel(cancelled)
    queue.close()
    url = database.url
    listed = {q["name"]: q for q in json.loads(ok(taskrunner("queue", "list", "--json",
                                                             url=url)))}
    assert {"default", "reports", "undeclared"} <= set(listed)
    for name, q in listed.items():
        counted = {word: len(json.loads(ok(taskrunner("tasks", "--status", word, "--queue", name,
                                                      "--all", "--json", url=url))))
                   for word in reads.OPEN_STATES}
        assert (q["scheduled"], q["running"]) == (counted["scheduled"], counted["running"]), name
        assert q["tasks"] == counted, name
    assert listed["default"]["scheduled"] == 2 and listed["default"]["running"] == 1
    assert listed["default"]["due"] == 0       # neither of its scheduled tasks has a run
    assert listed["undeclared"]["tasks"]["waiting"] == 1
    metrics = {s.labels["queue"]: s.value for f in text_string_to_metric_families(
        ok(taskrunner("metrics", url=url))) for s in f.samples
        if s.name == "taskrunner_queue_scheduled"}
    assert metrics["default"] == listed["default"]["scheduled"] == 2
    table = ok(taskrunner("queue", "list", url=url)).splitlines()
    assert table[0].split()[3:6] == ["SCHEDULED", "DUE", "RUNNING"]
    default = next(line.split() for line in table if line.startswith("default "))
    assert default[3:6] == ["2", "0", "1"]
