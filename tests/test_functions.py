"""Function tasks (issue 40): ``@task`` on a plain or async function, named by its import
path; arguments checked at enqueue; handles; durable functions; children added exactly once
from inside a handler, and waited for without holding a runner; workflows of functions."""
import json
import os
import subprocess
import sys
import textwrap
import importlib.util

import pytest

import function_tasks as ft
from conftest import REPO_DIR, TESTS_DIR, process_env, taskrunner
from taskrunner import (InputError, RunContext, TaskFailed, TaskHandle, chain, group, task,
                        use_queue)


@pytest.fixture
def default(queue):
    """`queue` as where function tasks are enqueued from this process."""
    before = use_queue(queue)
    yield queue
    use_queue(before)


def drain(queue, rounds=5):
    """run_pending until nothing is left to run (a retry's run is made by the next pass)."""
    for _ in range(rounds):
        if not queue.run_pending():
            return


def tasks_named(queue, name):
    return queue.tasks(handler=name, limit=None)


def test_a_function_task_is_enqueued_by_its_import_path_and_returns_its_value(default):
    handle = ft.add.enqueue(2, b=3)
    assert isinstance(handle, TaskHandle) and handle.status == "scheduled"
    task = default.get_task(handle.id)
    assert task.handler == "function_tasks.add"
    assert task.data == {"a": 2, "b": 3}     # the arguments by name: readable, searchable
    default.run_pending()
    assert handle.status == "success"
    assert handle.result(timeout=5) == 5
    assert ft.add(2, 3) == 5                  # still the plain function when called


def test_a_wrong_or_unencodable_argument_is_one_line_naming_it_and_stores_nothing(default):
    from datetime import datetime
    with pytest.raises(InputError, match=r"function_tasks\.add\(\): missing a required "
                                         r"argument: 'a'"):
        ft.add.enqueue()
    with pytest.raises(InputError, match="unexpected keyword argument 'c'"):
        ft.add.enqueue(1, c=2)
    with pytest.raises(InputError, match="argument 'b' is not JSON-serialisable"):
        ft.add.enqueue(1, datetime.now())
    with pytest.raises(InputError, match="argument 'a' is not JSON-serialisable"):
        ft.add.enqueue(float("nan"))
    assert default.tasks(limit=None) == []


def test_decorator_options_apply_and_each_call_may_override_them(default):
    handle = ft.send_receipt.enqueue(42)
    task = default.get_task(handle.id)
    assert (task.queue, task.priority, task.max_retries, task.run_timeout) == ("mail", 5, 3, 300)
    row = default.store.Task.get_by_id(handle.id)
    assert row.concurrency_key == "order-42"
    later = ft.send_receipt.using(queue="urgent", priority=9, delay="1h",
                                  concurrency_key="mailbox").enqueue(43, to="x@example.com")
    task = default.get_task(later.id)
    assert (task.queue, task.priority, task.data) == ("urgent", 9, {"order_id": 43,
                                                                    "to": "x@example.com"})
    assert default.store.Task.get_by_id(later.id).concurrency_key == "mailbox"
    assert task.scheduled_on > task.queued_on
    # "No retry" is one word: one run, never retried.
    assert default.get_task(ft.fails.enqueue("x").id).max_retries == 1
    with pytest.raises(InputError, match="unknown option"):
        ft.add.using(queues="x")


def test_retry_false_gives_up_after_one_failure(default):
    handle = ft.fails.enqueue("boom")
    default.run_pending()
    assert handle.status == "given-up"
    with pytest.raises(TaskFailed, match="given-up: ValueError: boom"):
        handle.result(timeout=5)


def test_async_functions_and_every_kind_of_parameter_round_trip(default):
    loud = ft.shout.enqueue("hi")
    spread = ft.gather_args.enqueue(1, 2, 3, scale=10, extra=7)
    default.run_pending()
    assert loud.result(timeout=5) == "HI"
    assert spread.result(timeout=5) == {"sum": 60, "named": {"extra": 7}}


def test_a_function_that_asks_for_the_run_gets_it_and_not_from_the_caller(default):
    handle = default.enqueue(ft.durable_sum, [1, 2, 3])
    assert default.get_task(handle.id).data == {"values": [1, 2, 3]}
    default.run_pending()
    assert handle.result(timeout=5) == 12
    assert [step.name for step in default.steps_of(handle.id)] == ["double"]
    with pytest.raises(InputError, match="missing a required argument: 'values'"):
        ft.durable_sum.enqueue()


def test_children_added_in_a_handler_are_added_once_though_it_runs_again(queue):
    """The parent fails after adding its children; its retry comes back to the same
    enqueue calls and gets the same handles: each child exists once."""
    handle = queue.enqueue(ft.parent, 5)
    drain(queue)
    children = tasks_named(queue, "function_tasks.add")
    assert sorted(task.data["a"] for task in children) == [0, 1, 2, 3, 4]
    assert handle.result(timeout=5) == sum(range(5)) + 500
    assert [run.attempt for run in queue.runs_of(handle.id)][:2] == [1, 2]
    names = [step.name for step in queue.steps_of(handle.id)]
    assert [name.rsplit(":", 1)[0] for name in names] == ["add:function_tasks.add"] * 5 + [
        "join-1"]
    assert len(set(names)) == 6


def test_a_parent_waiting_for_its_children_holds_no_run_until_the_last_ends(queue):
    handle = queue.enqueue(ft.parent, 3)
    queue.run_pending(max_runs=1)        # the first attempt adds them and fails
    queue.run_pending(max_runs=1)        # the second waits for them
    queue.process_queue()
    task = queue.get_task(handle.id)
    assert task.status == "waiting" and task.waiting_parents == 3
    Run = queue.store.Run
    live = Run.select().where((Run.task_id == handle.id)
                              & Run.status.in_(["scheduled", "running"])).count()
    assert live == 0
    queue.run_pending()
    assert handle.result(timeout=5) == 303


def test_a_child_that_gives_up_reaches_its_waiting_parent_as_task_failed(queue):
    handle = queue.enqueue(ft.waits_for_a_failure)
    queue.run_pending()
    assert handle.result(timeout=5).startswith("TaskFailed: task ")
    assert "given-up: ValueError: child broke" in handle.result(timeout=5)


def test_a_workflow_added_from_a_handler_is_added_once_and_its_fan_in_gets_every_result(queue):
    handle = queue.enqueue(ft.fan_out, 4)
    drain(queue)
    assert handle.result(timeout=5) == {"label": "fan-in", "results": [1, 2, 3, 4]}
    assert len(tasks_named(queue, "function_tasks.add")) == 4
    assert len(tasks_named(queue, "function_tasks.collect")) == 1


def test_chains_pass_each_result_on_and_groups_pass_the_list_in_order(default):
    three = chain(ft.add.s(1, 2), ft.add.s(10), ft.add.si(100, 1)).enqueue(name="sums")
    fan = group(ft.add.s(n, n) for n in range(3)).then(ft.collect.s("pairs")).enqueue()
    default.run_pending()
    assert [t.result(timeout=5) for t in three.tasks] == [3, 13, 101]
    assert fan.result(timeout=5) == {"label": "pairs", "results": [0, 2, 4]}
    assert default.workflow(three.id).name == "sums"
    # A bad call in a workflow stores none of it.
    before = len(default.tasks(limit=None))
    with pytest.raises(InputError, match=r"function_tasks\.add\(\)"):
        chain(ft.add.s(1), ft.add.s(1, 2, 3)).enqueue()
    assert len(default.tasks(limit=None)) == before


def test_the_cli_lists_and_filters_a_function_task_by_its_import_path(database, default):
    ft.add.enqueue(1)
    ft.shout.enqueue("x")
    result = taskrunner("tasks", "--handler", "function_tasks.add", "--json",
                        url=database.url, check=True)
    assert [task["handler"] for task in json.loads(result.stdout)] == ["function_tasks.add"]


def test_task_refuses_what_a_runner_could_not_find_by_its_import_path():
    def local(x: int) -> int:
        return x
    with pytest.raises(TypeError, match="not a module-level function"):
        task(local)
    with pytest.raises(TypeError, match="unknown option queues"):
        task(queues="x")


def test_a_class_handler_and_a_function_task_run_side_by_side(default):
    class_task = default.add_task("taskrunner.handlers.Echo", {"n": 1})
    function = ft.add.enqueue(1, 1)
    default.run_pending()
    assert default.get_task(class_task).status == "success"
    assert function.result(timeout=5) == 2


@pytest.mark.timeout(240)
def test_mypy_flags_a_wrong_argument_in_the_users_code(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install '.[test]')")
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent('''
        from taskrunner import RunContext, TaskHandle, task

        @task(queue="mail")
        def send_receipt(order_id: int, *, to: str = "x") -> dict[str, int]:
            return {"order": order_id}

        @task
        async def durable(run: RunContext, name: str) -> str:
            return str(run.step("s", lambda: name))

        ok: TaskHandle[dict[str, int]] = send_receipt.enqueue(42, to="a@b")
        fine: TaskHandle[str] = durable.using(priority=3).enqueue("n")
        send_receipt.enqueue("42")
        durable.enqueue(1)
    '''))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), str(app)],
        capture_output=True, text=True, cwd=str(tmp_path), timeout=230,
        env=process_env({"MYPYPATH": REPO_DIR}))
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout
    assert 'Argument 1 to "enqueue" of "FunctionTask" has incompatible type "str"; ' \
           'expected "int"' in errors[0]
    assert 'incompatible type "int"; expected "str"' in errors[1]


def test_per_call_after_and_connection_and_the_awaitable_enqueue(database, default):
    import asyncio
    from test_transactional import connect
    first = ft.add.enqueue(1, 1)
    second = ft.collect.using(after=[first]).enqueue([0], "after")
    assert default.get_task(second.id).status == "waiting"
    app = connect(database)
    try:
        ft.add.using(connection=app).enqueue(5, 5)
        app.rollback()
        kept = ft.add.using(connection=app).enqueue(6, 6)
        app.commit()
    finally:
        app.close()
    loud = asyncio.run(ft.shout.enqueue_async("async"))
    default.run_pending()
    assert second.result(timeout=5) == {"label": "after", "results": [0]}
    assert kept.result(timeout=5) == 12 and loud.result(timeout=5) == "ASYNC"
    stored = [t.data for t in default.tasks(handler="function_tasks.add", limit=None)]
    assert {"a": 5, "b": 5} not in stored and {"a": 6, "b": 6} in stored


def test_a_transaction_step_commits_its_rows_and_its_children_together_once(queue):
    queue.store.db.execute_sql("CREATE TABLE payments (order_id INTEGER)")
    handle = queue.enqueue(ft.pay_and_ship, 7)
    drain(queue)
    shipping = handle.result(timeout=5)
    assert list(queue.store.db.execute_sql("SELECT order_id FROM payments").fetchall()) == [(7,)]
    assert [t.id for t in tasks_named(queue, "function_tasks.add")] == [shipping]
    assert [s.name for s in queue.steps_of(handle.id)] == ["pay"]


def test_the_cli_add_of_a_function_task_checks_its_data_against_the_signature(database):
    database.queue().close()
    wrong = taskrunner("add", "function_tasks.add", "--data", '{"a": 1, "c": 2}',
                       url=database.url)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert "function_tasks.add(): the task's data names no parameter of the function: c" \
        in wrong.stderr
    missing = taskrunner("add", "function_tasks.add", "--data", '{"b": 2}', url=database.url)
    assert missing.returncode == 2 and "missing a required argument: 'a'" in missing.stderr
    not_named = taskrunner("add", "function_tasks.add", "--data", "[1, 2]", url=database.url)
    assert not_named.returncode == 2 and "arguments by name" in not_named.stderr
    right = taskrunner("add", "function_tasks.add", "--data", '{"a": 1, "b": 2}',
                       url=database.url, check=True)
    with database.queue() as queue:
        assert [t.data for t in queue.tasks(limit=None)] == [{"a": 1, "b": 2}]
        queue.run_pending()
        assert queue.wait(int(right.stdout), timeout=5).results == 3


def test_a_child_failure_a_parent_lets_through_gives_the_parent_up_at_once(queue):
    handle = queue.enqueue(ft.lets_a_failure_through)
    drain(queue)
    task = queue.get_task(handle.id)
    assert handle.status == "given-up" and task.last_error_code == "TaskFailed"
    assert len(queue.runs_of(handle.id)) == 2     # the wait, then the failure: no retries


def test_a_replay_finds_each_child_by_its_arguments_in_whatever_order_it_comes(queue):
    """The retry adds the same children in the opposite order, and one call twice: each
    handle is its own call's task, and the repeated call is two tasks, both times."""
    handle = queue.enqueue(ft.reorders, [1, 2, 3])
    drain(queue)
    assert handle.result(timeout=5) == [101, 102, 103, 109, 109]
    stored = sorted(t.data["a"] for t in tasks_named(queue, "function_tasks.add"))
    assert stored == [1, 2, 3, 9, 9]
    names = [step.name for step in queue.steps_of(handle.id)]
    assert sum(name.startswith("add-2:function_tasks.add:") for name in names) == 1


def test_metrics_and_the_workflow_graph_name_a_function_task_by_its_import_path(database,
                                                                                  default):
    fan = group(ft.add.s(n, n) for n in range(2)).then(ft.collect.s("m")).enqueue()
    default.run_pending()
    graph = default.workflow(fan.id)
    assert sorted(task.handler for task in graph.tasks) == [
        "function_tasks.add", "function_tasks.add", "function_tasks.collect"]
    metrics = taskrunner("metrics", url=database.url, check=True).stdout
    assert 'taskrunner_runs_ended_total{handler="function_tasks.add",status="success"} 2.0' \
        in metrics


def test_a_handles_status_is_one_read_of_the_tasks_row_in_every_state(default):
    """A poll of `handle.status` reads the task's row alone (not its results, traceback and
    blockers, which get_task reads), and says what get_task says."""
    db = default.store.db
    plain, executed = db.execute_sql, []

    def counted(sql, params=None, *args, **kwargs):
        executed.append(sql)
        return plain(sql, params, *args, **kwargs)
    handles = [ft.add.enqueue(1, 2), ft.fails.enqueue("no"),
               ft.add.using(concurrency_key="k").enqueue(3)]
    default.run_pending(max_runs=2)
    for handle in handles:
        executed.clear()
        db.execute_sql = counted
        try:
            status = handle.status
        finally:
            db.execute_sql = plain
        assert len(executed) == 1, executed
        assert status == default.get_task(handle.id).status
    assert [h.status for h in handles] == ["success", "given-up", "scheduled"]
    with pytest.raises(Exception, match="no task with id"):
        default.status_of(10 ** 30)
