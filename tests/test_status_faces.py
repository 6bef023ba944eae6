"""One word per state on every face: the Python API, the CLI (table, ``--json``, ``show``),
the dashboard (task list, task page, overview tiles), the metrics and the docs say the same
status for the same task, and that word finds it again as a filter."""
import json
import os
import re
from datetime import timedelta

from prometheus_client.parser import text_string_to_metric_families

from taskrunner.fleet import liveness
from taskrunner.functions import TaskHandle
from taskrunner.reads.records import TASK_STATES
from taskrunner.runs import lifecycle
from taskrunner.store.models import utcnow

from conftest import ok, taskrunner, utc
from dashboard_helpers import Served, fetch

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def one_task_in_each_state(queue):
    """{status word: task id}, a task in each of TASK_STATES, on the real store."""
    later = utc(utcnow()) + timedelta(days=1)
    running = queue.add_task("taskrunner.handlers.Echo")
    claimed = lifecycle.claim(queue.store, liveness.register(queue.store).id)
    assert claimed.task_id == running
    success = queue.add_task("taskrunner.handlers.Echo")
    given_up = queue.add_task("taskrunner.handlers.Fail", {"code": "Planned"}, max_retries=1)
    retrying = queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                              retry_backoff=3600)
    queue.run_pending()
    scheduled = queue.add_task("taskrunner.handlers.Echo", scheduled_on=later)
    waiting = queue.add_task("taskrunner.handlers.Echo", after=[scheduled])
    cancelled = queue.add_task("taskrunner.handlers.Echo", scheduled_on=later)
    queue.cancel(cancelled)
    ids = {"scheduled": scheduled, "running": running, "waiting": waiting,
           "retrying": retrying, "given-up": given_up, "success": success,
           "cancelled": cancelled}
    assert set(ids) == set(TASK_STATES)
    return ids


def test_every_face_shows_the_same_word_for_every_status(database):
    queue = database.queue()
    ids = one_task_in_each_state(queue)
    url = database.url
    listed = {t["id"]: t for t in json.loads(ok(taskrunner("tasks", "--json", url=url)))}
    table = ok(taskrunner("tasks", "--wide", url=url)).splitlines()
    in_table = {int(line.split()[0]): line.split()[2] for line in table[1:-1]}
    expected_counts = {word: 0 for word in TASK_STATES}
    for task in queue.tasks(limit=None):
        expected_counts[task.status] += 1
    served = Served(queue.store)
    try:
        _, overview, _ = fetch(served.url + "/")
        _, task_list, _ = fetch(served.url + "/tasks")
        for word, task_id in ids.items():
            faces = {
                "api get_task": queue.get_task(task_id).status,
                "api handle": TaskHandle(task_id, queue).status,
                "cli tasks --json": listed[task_id]["status"],
                "cli tasks table": in_table[task_id],
                "cli show --json": json.loads(ok(taskrunner("show", str(task_id), "--json",
                                                            url=url)))["status"],
                "cli show": re.search(r"^status:\s+(\S+)$", ok(taskrunner(
                    "show", str(task_id), url=url)), re.M).group(1),
                "dashboard list": re.search(
                    r'href="/tasks/%d">%d</a>.*?class="status status-([^"]+)">\1<' % (
                        task_id, task_id), task_list, re.S).group(1),
                "dashboard task": re.search(r'<dt>Status</dt><dd><span class="status status-'
                                            r'([^"]+)">\1<', fetch(
                                                served.url + "/tasks/%d" % task_id)[1]).group(1),
            }
            assert set(faces.values()) == {word}, (word, [k for k, v in faces.items() if v != word])
            # The word finds the task again, on every face that filters.
            assert task_id in [t.id for t in queue.tasks(status=word, limit=None)]
            assert task_id in [t["id"] for t in json.loads(ok(taskrunner(
                "tasks", "--status", word, "--json", url=url)))]
            assert 'href="/tasks/%d"' % task_id in fetch(
                served.url + "/tasks?status=%s" % word)[1]
            # The overview's tile names it by the same word, with the same count.
            tile = re.search(r'class="tile tile-%s"[^>]*><span class="n">(\d+)</span><span>'
                             r'([^<]+)</span>' % re.escape(word), overview)
            assert tile and tile.group(2) == word, (word, tile and tile.group(2))
            assert int(tile.group(1)) == expected_counts[word]
    finally:
        served.stop()
    metrics = {s.labels["status"]: s.value for f in text_string_to_metric_families(
        ok(taskrunner("metrics", url=url))) for s in f.samples if s.name == "taskrunner_tasks"}
    assert metrics == expected_counts
    queue.close()


def test_json_keeps_how_a_failed_run_ended_apart_from_the_status(sqlite_db):
    queue = sqlite_db.queue()
    ids = one_task_in_each_state(queue)
    task = json.loads(ok(taskrunner("show", str(ids["given-up"]), "--json", url=sqlite_db.url)))
    assert (task["status"], task["last_run_status"], task["given_up"]) == (
        "given-up", "error", True)
    by_error = [t["id"] for t in json.loads(ok(taskrunner(
        "tasks", "--status", "error", "--json", url=sqlite_db.url)))]
    assert by_error == [ids["retrying"], ids["given-up"]]
    queue.close()


def test_the_docs_name_every_status_word(sqlite_db):
    with open(os.path.join(DOCS, "index.md")) as fh:
        words = fh.read().split("### Task statuses and filters", 1)[1].split("\n### ", 1)[0]
    named = re.findall(r"^\| `([a-z-]+)` \|", words, re.M)
    assert named[:len(TASK_STATES)] == list(TASK_STATES)
