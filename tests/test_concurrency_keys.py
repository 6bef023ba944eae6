"""Concurrency keys: at most N live runs of the tasks sharing a key, on every host at once,
enforced by a unique index on the key's slots; a task that finds its key full waits and
runs when a slot frees. Race-tested with 8 runner processes creating and claiming runs."""
from collections import Counter

import pytest

from conftest import START_TIMEOUT, taskrunner, usage_error, wait_for
from taskrunner import InputError
from taskrunner.runs import lifecycle
from taskrunner.fleet import liveness
from taskrunner.store.models import RUNNING, SUCCESS, Run, Task

ECHO = "taskrunner.handlers.Echo"


def live_by_key():
    return Counter(k for (k,) in Run.select(Run.concurrency_key).where(
        Run.concurrency_slot.is_null(False)).tuples())


def test_a_key_has_at_most_its_limit_of_live_runs(database):
    queue = database.queue()
    runner_id = liveness.register(queue.store).id
    busy = queue.add_tasks([{"handler": ECHO, "concurrency_key": "customer:42",
                             "concurrency_limit": 2} for _ in range(5)])
    other = queue.add_task(ECHO, concurrency_key="customer:7")
    plain = queue.add_task(ECHO)
    lifecycle.create_missing_runs(queue.store)
    assert live_by_key() == {"customer:42": 2, "customer:7": 1}
    assert Task.select().where(Task.waiting_key == "customer:42").count() == 3
    queue.process_queue()                  # a second pass: nothing changes while slots are held
    assert live_by_key() == {"customer:42": 2, "customer:7": 1}
    claimed = [lifecycle.claim(queue.store, runner_id) for _ in range(4)]
    assert {c.task_id for c in claimed} == {busy[0], busy[1], other, plain}
    assert lifecycle.claim(queue.store, runner_id) is None
    done = next(c for c in claimed if c.task_id == busy[0])
    assert lifecycle.end_run(queue.store, done.run_id, done.task_id, SUCCESS, runner_id=runner_id)
    assert live_by_key() == {"customer:42": 1, "customer:7": 1}      # its slot is free
    queue.cancel(busy[4])                                               # waiting: cancellable
    queue.process_queue()
    assert live_by_key() == {"customer:42": 2, "customer:7": 1}
    assert Task.get_by_id(busy[2]).waiting_key is None                  # first come, first run
    for c in claimed:
        if c is not done:
            lifecycle.end_run(queue.store, c.run_id, c.task_id, SUCCESS, runner_id=runner_id)
    assert queue.run_pending() == 2
    assert [queue.get_task(t).status for t in busy] == [SUCCESS] * 4 + ["cancelled"]
    assert live_by_key() == Counter()
    queue.close()


def test_run_pending_runs_every_task_of_a_full_key(sqlite_db):
    queue = sqlite_db.queue()
    ids = queue.add_tasks([{"handler": ECHO, "concurrency_key": "k"} for _ in range(4)])
    assert queue.run_pending() == 4
    assert {queue.get_task(i).status for i in ids} == {SUCCESS}
    queue.close()


def test_bad_concurrency_options_are_refused(sqlite_db):
    queue = sqlite_db.queue()
    for options, message in (({"concurrency_key": ""}, "concurrency_key"),
                             ({"concurrency_key": "k", "concurrency_limit": 0}, "between"),
                             ({"concurrency_limit": 2}, "needs a concurrency_key")):
        with pytest.raises(InputError, match=message):
            queue.add_task(ECHO, **options)
    usage_error(taskrunner("add", ECHO, "--concurrency-limit", "0", url=sqlite_db.url),
                "--concurrency-limit")
    task_id = int(taskrunner("add", ECHO, "--concurrency-key", "c:1", "--concurrency-limit", "3",
                             url=sqlite_db.url, check=True).stdout)
    assert (Task.get_by_id(task_id).concurrency_key, Task.get_by_id(task_id).concurrency_limit) \
        == ("c:1", 3)
    assert Task.select().count() == 1
    queue.close()


def overlaps(log):
    """The most handlers of the log running at once (its start/end lines are in order)."""
    most = current = 0
    with open(log) as fh:
        lines = fh.read().split("\n")
    for line in lines:
        if line.startswith("start"):
            current += 1
        elif line.startswith("end"):
            current -= 1
        most = max(most, current)
    return most


@pytest.mark.timeout(240)
def test_eight_runners_never_run_more_than_the_limit_of_a_key(database, procs, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "spans.log")
    ids = queue.add_tasks([{"handler": "sample_handlers.Span", "concurrency_key": "customer:42",
                            "concurrency_limit": 2, "data": {"log": log, "sleep": 0.3}}
                           for _ in range(24)])
    config = database.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.05\n")
    for i in range(8):
        procs.spawn("runner", config=config, name="runner%d" % i)
    most = Counter()

    def done():
        running = Run.select().where((Run.concurrency_key == "customer:42")
                                     & (Run.status == RUNNING)).count()
        most["running"] = max(most["running"], running)
        most["live"] = max(most["live"], live_by_key()["customer:42"])
        return Task.select().where(Task.id.in_(ids) & (Task.last_status == SUCCESS)).count() \
            == len(ids)
    wait_for(done, timeout=START_TIMEOUT * 6, interval=0.02, message="the 24 keyed tasks")
    assert overlaps(log) == 2
    assert most["running"] <= 2 and most["live"] <= 2, most
    assert Run.select().where(Run.task_id.in_(ids)).count() == len(ids)
    queue.close()
