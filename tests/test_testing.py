"""taskrunner.testing (issue 40): an application's tests run what they enqueued, and what it
added, in-process through the real store, with durable sleeps and backoffs fast-forwarded."""
import time

import function_tasks as ft
from taskrunner import TaskQueue
from taskrunner.testing import run_all, task_queue


def test_run_all_runs_children_and_fast_forwards_sleeps_and_backoffs(tmp_path):
    with task_queue(tmp_path / "tasks.db") as queue:
        started = time.monotonic()
        rested = ft.sleeps_a_day.enqueue("ada")
        retried = ft.flaky.enqueue()
        fan = ft.fan_out.enqueue(3)
        runs = run_all(queue)
        assert time.monotonic() - started < 30          # not a day, not two hours
        assert rested.result(timeout=0) == "rested ada"
        assert retried.result(timeout=0) == 3
        assert fan.result(timeout=0) == {"label": "fan-in", "results": [1, 2, 3]}
        assert runs >= 1 + 1 + 3 + 3 + 1                 # every attempt, every child
        assert [s.name for s in queue.steps_of(rested.id)] == ["sleep-1"]


def test_a_task_waiting_for_an_event_waits_until_the_test_sends_it(tmp_path):
    with task_queue(tmp_path / "tasks.db") as queue:
        handle = ft.twice.enqueue()
        run_all(queue)
        assert handle.status == "waiting"
        handle.send_event("shipped", {"box": 1})
        handle.send_event("shipped", {"box": 2})
        run_all(queue)
        assert handle.result(timeout=0) == [{"box": 1}, {"box": 2}]


def test_the_queue_is_where_function_tasks_go_only_inside_the_block(tmp_path):
    with task_queue(tmp_path / "a.db") as queue:
        handle = ft.add.enqueue(1, 2)
        assert handle.queue is queue
    with TaskQueue("sqlite:///%s" % (tmp_path / "a.db")) as again:
        assert again.get_task(handle.id).handler == "function_tasks.add"
