"""Searching tasks by their data off an index per key (issue 42): ``taskrunner index add
KEY`` builds it, the dashboard's search and ``tasks --data KEY=VALUE`` read it, however far
back the task is; a key without one keeps the bounded window, and says so."""
import json
import sys

import pytest

from taskrunner.reads import data_search, records, summaries

from conftest import REPO_DIR, ok, taskrunner, usage_error

sys.path.insert(0, REPO_DIR)
from bench.search import fill  # noqa: E402

ECHO = "taskrunner.handlers.Echo"


def plan_of(queue, query):
    """The database's plan of a peewee query, as one line."""
    db, backend = queue.store.db, queue.store.backend
    if backend == "mysql":
        db.execute_sql("ANALYZE TABLE task_queue")
    statement, params = query.sql()
    prefix = "EXPLAIN QUERY PLAN " if backend == "sqlite" else "EXPLAIN "
    return " | ".join(str(row) for row in db.execute_sql(prefix + statement, params))


def searched(queue, text):
    """The ids of the dashboard's first page of a search, and where it started reading."""
    page = summaries.find_tasks(queue.store, summaries.TaskFilter(
        data=data_search.parse(queue.store, text)))
    return [t.id for t in page.tasks], page.searched_from


def test_an_indexed_key_finds_a_task_older_than_the_window_off_its_index(database):
    """A task more than 100,000 tasks back: the bounded search does not reach it; after
    ``index add`` the dashboard, the CLI and the plan all read the key's index."""
    queue = database.queue()
    old = queue.add_task(ECHO, {"order_id": "X-1", "customer": "ann"})
    fill(queue.store, data_search.WINDOW + 500)
    assert searched(queue, "order_id=X-1")[0] == []
    result = taskrunner("tasks", "--data", "order_id=X-1", "--json", url=database.url)
    assert json.loads(ok(result)) == []
    assert "not indexed" in result.stderr and "taskrunner index add order_id" in result.stderr

    added = json.loads(ok(taskrunner("index", "add", "order_id", "--json", url=database.url)))
    assert added == {"key": "order_id", "indexed": True, "changed": True}
    assert searched(queue, "order_id=X-1") == ([old], None)
    result = taskrunner("tasks", "--data", "order_id=X-1", "--json", url=database.url)
    assert [t["id"] for t in json.loads(ok(result))] == [old] and result.stderr == ""

    Task = queue.store.Task
    query = records.tasks_query(queue.store, data=("order_id", "X-1")).order_by(
        Task.id.desc()).limit(50)
    plan = plan_of(queue, query)
    assert "task_queue_data_key_order_id" in plan, plan
    # A key without an index is read row by row: the plan names no data index.
    query = records.tasks_query(queue.store, data=("customer", "ann")).order_by(
        Task.id.desc()).limit(50)
    assert "task_queue_data_key" not in plan_of(queue, query)
    queue.close()


def test_values_compare_as_text_with_or_without_the_index(database):
    """``order_id=44`` finds the number 44 and the string "44" (not 44.5, not an object or
    an array holding 44); ``true`` the boolean; a long value whole (the index holds its
    first 255 characters: a whole value may not fit in an entry); the same tasks with and
    without the index. A task whose data PostgreSQL's jsonb refuses (a NUL character) is
    still added, and its search ends well: found, except on PostgreSQL (where it used to
    fail the search)."""
    queue = database.queue()
    long_value = "L" * 3000     # over a PostgreSQL b-tree entry's 2,704 bytes
    ids = {name: queue.add_task(ECHO, {"order_id": value}) for name, value in (
        ("number", 44), ("text", "44"), ("decimal", 44.5), ("object", {"a": 44}),
        ("array", [44]), ("flag", True), ("long", long_value), ("longer", long_value + "M"))}

    def found():
        return {text: sorted(searched(queue, "order_id=" + text)[0])
                for text in ("44", "44.5", "true", long_value, "1")}
    expected = {"44": sorted([ids["number"], ids["text"]]), "44.5": [ids["decimal"]],
                "true": [ids["flag"]], long_value: [ids["long"]], "1": []}
    assert found() == expected
    ok(taskrunner("index", "add", "order_id", url=database.url))
    assert found() == expected
    assert searched(queue, "order_id=44")[1] is None
    nul = queue.add_task(ECHO, {"order_id": "a\u0000b", "n": 1})
    assert searched(queue, "n=1")[0] == ([] if database.backend == "postgresql" else [nul])
    queue.close()


@pytest.mark.parametrize("key", ["order-id", "1st", "x'); DROP TABLE task_queue; --", "a.b",
                                 "k" * 44, "ключ", ""])
def test_a_bad_key_is_refused_and_nothing_is_built(sqlite_db, key):
    usage_error(taskrunner("index", "add", key, url=sqlite_db.url), "invalid data key")
    assert json.loads(ok(taskrunner("index", "list", "--json", url=sqlite_db.url))) == []


def test_index_list_and_drop_and_keys_that_differ_by_case(database):
    url = database.url
    ok(taskrunner("index", "add", "order_id", url=url))
    again = json.loads(ok(taskrunner("index", "add", "order_id", "--json", url=url)))
    assert again["changed"] is False
    usage_error(taskrunner("index", "add", "Order_ID", url=url), "differs only by case")
    usage_error(taskrunner("index", "add", "db_password", url=url), "is secret")
    assert json.loads(ok(taskrunner("index", "list", "--json", url=url))) == [
        {"key": "order_id", "index": "task_queue_data_key_order_id", "ready": True}]
    assert "order_id" in ok(taskrunner("index", "list", url=url))
    dropped = json.loads(ok(taskrunner("index", "drop", "order_id", "--json", url=url)))
    assert dropped == {"key": "order_id", "indexed": False, "changed": True}
    assert json.loads(ok(taskrunner("index", "drop", "order_id", "--json", url=url)))[
        "changed"] is False
    assert json.loads(ok(taskrunner("index", "list", "--json", url=url))) == []
    usage_error(taskrunner("tasks", "--data", "nonsense", url=url), "KEY=VALUE")


def test_the_dashboard_says_when_a_search_is_bounded_and_how_to_index_the_key(database):
    pytest.importorskip("prometheus_client")
    from dashboard_helpers import Served, fetch
    queue = database.queue()
    wanted = queue.add_task(ECHO, {"order_id": 44, "customer": "ann"})
    ok(taskrunner("index", "add", "order_id", url=database.url))
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks?data=order_id%3D44")[1]
        assert '<a href="/tasks/%d">' % wanted in body and "search-bounded" not in body
        body = fetch(served.url + "/tasks?data=customer%3Dann")[1]
        assert '<a href="/tasks/%d">' % wanted in body and 'id="search-bounded"' in body
        assert "taskrunner index add customer" in body
    finally:
        served.stop()
        queue.close()

