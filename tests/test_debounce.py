"""Debounce: enqueues of one key within a span collapse into one task (runs/debounce.py),
whichever process or host enqueues, on each database: exactly one task per window under
concurrent enqueues from real processes, with the last (or first) data, run once after the
quiet span; a window closes when its task is due, has a run or has ended. Time is injected
(``now=``) where the rule is about time."""
import json
import subprocess
import sys
from datetime import timedelta, timezone

import pytest

from conftest import process_env, taskrunner, usage_error, wait_for
from taskrunner import InputError
from taskrunner.reads import summaries
from taskrunner.runs import enqueue, lifecycle
from taskrunner.store.models import Run, Task, utcnow

ECHO = "taskrunner.handlers.Echo"
OTHER = "taskrunner.handlers.Sleep"


def add(queue, data, at, **options):
    """(task id, whether a task was added) of a debounced enqueue at `at` (naive UTC)."""
    options.setdefault("debounce", "10s")
    options.setdefault("debounce_key", "user-1")
    return enqueue.add_task_created(queue.store, options.pop("handler", ECHO), data=data,
                                    now=at, **options)


def test_enqueues_within_the_span_land_in_one_task_with_the_last_data(queue):
    t0 = utcnow()
    first, added = add(queue, {"n": 1}, t0)
    assert added
    assert add(queue, {"n": 2}, t0 + timedelta(seconds=5)) == (first, False)
    assert add(queue, {"n": 3}, t0 + timedelta(seconds=12)) == (first, False)
    task = queue.get_task(first)
    assert task.data == {"n": 3} and task.debounce_key == "user-1"
    assert task.debounce_enqueues == 3 and task.status == "scheduled"
    # Trailing: due a span after the last enqueue; not a run before.
    due = queue.store.database_time(t0 + timedelta(seconds=22))
    assert Task.get_by_id(first).scheduled_on == Task.get_by_id(first).next_run_on == due
    lifecycle.create_missing_runs(queue.store, t0 + timedelta(seconds=21))
    assert Run.select().count() == 0
    [why] = task.blocked_by
    assert why["reason"] == "debounce" and why["key"] == "user-1" and why["enqueues"] == 3
    assert queue.run_pending(now=(t0 + timedelta(seconds=23)).replace(tzinfo=timezone.utc)) == 1
    assert queue.get_task(first).results == {"n": 3}
    assert Task.select().count() == 1


def test_keep_first_keeps_the_first_data_and_still_moves_the_due_time(queue):
    t0 = utcnow()
    first, _ = add(queue, {"n": 1}, t0, debounce_keep="first")
    assert add(queue, {"n": 2}, t0 + timedelta(seconds=8), debounce_keep="first") == (
        first, False)
    row = Task.get_by_id(first)
    assert json.loads(row.data) == {"n": 1}
    assert row.scheduled_on == queue.store.database_time(t0 + timedelta(seconds=18))


def test_debounce_max_caps_the_window_so_a_steady_stream_still_runs(queue):
    t0 = utcnow()
    first, _ = add(queue, {"n": 0}, t0, debounce_max="25s")
    for n in range(1, 5):            # every 6 seconds: never 10 quiet seconds
        assert add(queue, {"n": n}, t0 + timedelta(seconds=6 * n), debounce_max="25s")[0] == first
    row = Task.get_by_id(first)
    assert row.scheduled_on == row.debounce_until == queue.store.database_time(
        t0 + timedelta(seconds=25))
    # At 30 s the window has closed (due at 25 s): a new task, a new window.
    second, added = add(queue, {"n": 6}, t0 + timedelta(seconds=30), debounce_max="25s")
    assert added and second != first
    assert Task.get_by_id(first).debounce_open is None
    assert Task.get_by_id(second).debounce_open == "user-1"


def test_a_window_closes_when_its_task_is_due_has_a_run_or_is_cancelled(queue):
    t0 = utcnow()
    due, _ = add(queue, {"n": 1}, t0)
    later, added = add(queue, {"n": 2}, t0 + timedelta(seconds=10))      # exactly due: closed
    assert added and later != due
    # Its run created (by a pass whose clock is ahead of this enqueue's): closed too.
    lifecycle.create_missing_runs(queue.store, t0 + timedelta(seconds=21))
    assert add(queue, {"n": 3}, t0 + timedelta(seconds=15))[1]
    cancelled, _ = add(queue, {"n": 4}, t0, debounce_key="user-2")
    queue.cancel(cancelled)
    again, added = add(queue, {"n": 5}, t0 + timedelta(seconds=1), debounce_key="user-2")
    assert added and again != cancelled
    assert queue.get_task(again).data == {"n": 5}


def test_a_key_is_per_handler_and_defaults_to_the_handler(queue):
    t0 = utcnow()
    echo, _ = add(queue, None, t0, debounce_key=None)
    assert add(queue, None, t0, debounce_key=None) == (echo, False)
    assert Task.get_by_id(echo).debounce_key == ECHO
    other, added = add(queue, None, t0, debounce_key=None, handler=OTHER)
    assert added and other != echo
    keyed, added = add(queue, None, t0, debounce_key=ECHO, handler=OTHER)
    assert added and keyed not in (echo, other)     # the key ECHO of another handler
    plain = queue.add_task(ECHO)
    assert plain not in (echo, other)
    assert Task.get_by_id(plain).debounce_key is None
    assert queue.get_task(plain).debounce_enqueues is None


@pytest.mark.parametrize("options,match", [
    ({"debounce": 0}, "debounce must be a positive"),
    ({"debounce": "soon"}, "debounce must be a positive"),
    ({"debounce": "1s", "debounce_keep": "middle"}, "debounce_keep must be one of"),
    ({"debounce": "1s", "debounce_key": ""}, "debounce_key must not be empty"),
    ({"debounce": "1s", "delay": 5}, "cannot be combined with"),
    ({"debounce": "1s", "unique_key": "u"}, "cannot be combined with"),
    ({"debounce_key": "k"}, "debounce_key needs debounce"),
    ({"debounce_max": "1min"}, "debounce_max needs debounce"),
])
def test_bad_debounce_options_are_refused_and_store_nothing(sqlite_db, options, match):
    queue = sqlite_db.queue()
    with pytest.raises(InputError, match=match):
        queue.add_task(ECHO, **options)
    with pytest.raises(InputError, match="debounce cannot be used for tasks of a workflow"):
        queue.add_workflow([dict(handler=ECHO, debounce="1s")])
    assert Task.select().count() == 0
    queue.close()


def test_add_tasks_lands_each_debounced_task_in_its_window(queue):
    ids = queue.add_tasks([{"handler": ECHO, "data": {"n": n}, "debounce": "1min",
                            "debounce_key": "k%d" % (n % 2)} for n in range(4)]
                          + [{"handler": ECHO}])
    assert ids[0] == ids[2] and ids[1] == ids[3] and len(set(ids)) == 3
    assert queue.get_task(ids[0]).data == {"n": 2}
    assert queue.get_task(ids[1]).debounce_enqueues == 2


def test_a_function_task_debounces_by_its_formatted_key(queue):
    from function_tasks import reindex
    first = reindex.using(on=queue).enqueue(7, "a")
    assert reindex.using(on=queue).enqueue(7, "ab") == first
    other = reindex.using(on=queue).enqueue(8, "x")
    assert other != first
    assert queue.get_task(first.id).data == {"user_id": 7, "query": "ab"}
    assert queue.get_task(first.id).debounce_key == "search-7"
    kept = reindex.using(on=queue, debounce_key="all", debounce_keep="first")
    assert kept.enqueue(1, "first") == kept.enqueue(2, "second")
    assert queue.get_task(kept.enqueue(3, "third").id).data == {"user_id": 1, "query": "first"}


ENQUEUER = """
import json, sys, time
from taskrunner import TaskQueue
from taskrunner.runs.enqueue import add_task_created
queue = TaskQueue(sys.argv[1])
me, keep, span, pause = int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
most = sys.argv[6] or None
print("ready", flush=True)
sys.stdin.readline()
ids = []
for n in range(50):
    ids.append(add_task_created(queue.store, "taskrunner.handlers.Echo",
                                data={"process": me, "n": n}, debounce=span,
                                debounce_key="hot", debounce_keep=keep, debounce_max=most))
    time.sleep(pause)
print(json.dumps(ids), flush=True)
"""


def enqueue_from_processes(url, keep, span, count=8, pause=0.0, most=""):
    """`count` processes enqueue the key ``hot`` 50 times each, all at once, `pause`
    seconds apart (`most`: their debounce_max); the (task id, added) of every enqueue."""
    procs = [subprocess.Popen([sys.executable, "-c", ENQUEUER, url, str(me), keep, span,
                               str(pause), most],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=process_env()) for me in range(count)]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:                  # go together
            proc.stdin.write("\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            results += [tuple(pair) for pair in json.loads(out)]
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("keep", ["last", "first"])
def test_concurrent_enqueues_from_processes_make_exactly_one_task_run_once(database, keep):
    queue = database.queue()
    landed = enqueue_from_processes(database.url, keep, "3s")
    [task_id] = {task_id for task_id, _ in landed}
    creators = [pair for pair in landed if pair[1]]
    assert len(creators) == 1 and Task.select().count() == 1
    row = Task.get_by_id(task_id)
    assert row.debounce_count == 400
    if keep == "first":                 # the data of the enqueue that opened the window
        assert json.loads(row.data)["n"] == 0
    # The last enqueue's data, from here; it runs once, after the quiet span.
    final, added = enqueue.add_task_created(queue.store, ECHO, data={"final": True},
                                            debounce="3s", debounce_key="hot",
                                            debounce_keep=keep)
    assert (final, added) == (task_id, False)
    assert queue.run_pending() == 0                     # not due: quiet span not over
    wait_for(lambda: queue.run_pending() == 1, timeout=30, message="the debounced run")
    task = queue.get_task(task_id)
    assert task.status == "success" and task.runs == 1 and task.debounce_enqueues == 401
    assert task.results == ({"final": True} if keep == "last" else json.loads(row.data))
    # The window closed: the next enqueue opens a second one.
    second, added = enqueue.add_task_created(queue.store, ECHO, data={}, debounce="3s",
                                             debounce_key="hot")
    assert added and second != task_id
    queue.close()


def test_windows_that_close_under_concurrent_enqueues_never_overlap(database):
    """A stream of enqueues longer than debounce_max: a window closes every 0.2 s (whatever
    the stream), each before the next opened, and every enqueue counted in exactly the task
    it returned."""
    queue = database.queue()
    landed = enqueue_from_processes(database.url, "last", "1min", pause=0.01, most="0.2s")
    rows = list(Task.select().order_by(Task.id))
    assert len(rows) > 1 and sum(row.debounce_count for row in rows) == 400
    returned = {}
    for task_id, _ in landed:
        returned[task_id] = returned.get(task_id, 0) + 1
    assert returned == {row.id: row.debounce_count for row in rows}
    assert [row.id for row in rows if row.debounce_open is not None] == [rows[-1].id]
    # The next window opened at or after the previous one was due (the processes' clocks,
    # all this host's, may read the database's a few milliseconds apart).
    for before, after in zip(rows, rows[1:]):
        assert after.queued_on >= before.scheduled_on - timedelta(milliseconds=50)
    queue.close()


def test_metric_counts_the_open_windows(queue):
    t0 = utcnow()
    add(queue, None, t0 + timedelta(minutes=5))
    add(queue, None, t0 + timedelta(minutes=5), debounce_key="user-2")
    add(queue, None, t0 - timedelta(minutes=5), debounce_key="user-3")     # closed by now
    queue.add_task(ECHO)
    assert summaries.debouncing(queue.store) == 2
    from taskrunner.web.metrics import exposition
    assert b"\ntaskrunner_tasks_debouncing 2.0\n" in exposition(queue.store)


def test_cli_add_debounce_prints_the_task_it_landed_in(sqlite_db):
    args = ("add", ECHO, "--debounce", "1min", "--debounce-key", "k", "--json")
    first = json.loads(taskrunner(*args, "--data", '{"n": 1}', url=sqlite_db.url,
                                  check=True).stdout)
    second = json.loads(taskrunner(*args, "--data", '{"n": 2}', "--debounce-keep", "first",
                                   url=sqlite_db.url, check=True).stdout)
    assert first == {"id": first["id"], "existed": False}
    assert second == {"id": first["id"], "existed": True}
    shown = json.loads(taskrunner("show", str(first["id"]), "--json", url=sqlite_db.url,
                                  check=True).stdout)
    assert shown["debounce_key"] == "k" and shown["debounce_enqueues"] == 2
    assert shown["data"] == {"n": 1}
    assert shown["blocked_by"][0]["reason"] == "debounce"
    text = taskrunner("show", str(first["id"]), url=sqlite_db.url, check=True).stdout
    assert "debounce_key:" in text and "debounce key k: runs at" in text
    usage_error(taskrunner("add", ECHO, "--debounce-key", "k", url=sqlite_db.url),
                "debounce_key needs debounce")
    usage_error(taskrunner("add", ECHO, "--debounce", "1min", "--in", "5", url=sqlite_db.url),
                "cannot be combined")
    usage_error(taskrunner("add", ECHO, "--debounce", "0", url=sqlite_db.url), "--debounce")


def test_dashboard_task_page_shows_the_key_and_why_it_waits(sqlite_db):
    pytest.importorskip("prometheus_client")
    from dashboard_helpers import Served, fetch
    queue = sqlite_db.queue()
    task_id = queue.add_task(ECHO, debounce="1h", debounce_key="<doc>")
    queue.add_task(ECHO, debounce="1h", debounce_key="<doc>")
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks/%d" % task_id)[1]
        assert "<dt>Debounce key</dt><dd>&lt;doc&gt; <small" in body
        assert "2 enqueues landed in it" in body
        assert "debounce key &lt;doc&gt;: runs at" in body and "<doc>" not in body
    finally:
        served.stop()
        queue.close()


def test_the_window_lookup_reads_the_debounce_index(database):
    """The enqueue's lookup of its key's window (debounce.land) is one entry of the
    task_queue_debounce index, which a task without a debounce is not in (SQLite,
    PostgreSQL): no scan of task_queue, however many tasks it holds."""
    queue = database.queue()
    queue.add_tasks([{"handler": ECHO} for _ in range(2000)])
    for key in ("a", "b", "c"):
        queue.add_task(ECHO, debounce="1h", debounce_key=key)
    db = queue.store.db
    if database.backend == "postgresql":
        db.execute_sql("ANALYZE task_queue")
        [(entries,)] = db.execute_sql("SELECT reltuples FROM pg_class WHERE relname = "
                                      "'task_queue_debounce'").fetchall()
        assert entries <= 3
    elif database.backend == "mysql":
        db.execute_sql("ANALYZE TABLE task_queue")
    statement, params = Task.select(Task.id).where(
        (Task.debounce_open == "b") & (Task.handler == ECHO)).sql()
    prefix = "EXPLAIN QUERY PLAN " if database.backend == "sqlite" else "EXPLAIN "
    plan = " | ".join(str(row) for row in db.execute_sql(prefix + statement, params))
    assert "task_queue_debounce" in plan, plan
    queue.close()
