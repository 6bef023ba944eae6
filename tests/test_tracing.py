"""OpenTelemetry traces (taskrunner.tracing): a web request's enqueue, the runs of the task
it adds, their steps and retries, the children a run adds and their fan-in are one trace,
across real processes; without a configured provider nothing imports OpenTelemetry and no
trace context is stored."""
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import process_env, taskrunner

pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")


def spans_in(path):
    with open(path) as lines:
        return [json.loads(line) for line in lines]


REQUEST = textwrap.dedent("""
    import otel_setup, sys
    from opentelemetry import trace
    from taskrunner import TaskQueue, use_queue
    import traced_tasks

    otel_setup.configure()
    queue = TaskQueue(sys.argv[1])
    use_queue(queue)
    with trace.get_tracer("shop.web").start_as_current_span("POST /orders"):
        print(traced_tasks.checkout.enqueue(44, ["cup", "glass", "plate"]).id)
""")


def traced(database, tmp_path, request, bursts):
    """Run the web request `request` (a script, traced, given the database's URL), then
    `bursts` traced `runner --burst`s: (what the request printed, the spans file)."""
    spans_file = tmp_path / "spans.jsonl"
    env = process_env({"TEST_SPANS": str(spans_file)})
    database.queue().close()
    added = subprocess.run([sys.executable, "-c", request, database.url], env=env,
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    config = tmp_path / "taskrunner.toml"
    config.write_text('[tracing]\nsetup = "otel_setup:configure"\n')
    for _ in range(bursts):
        ran = taskrunner("runner", "--burst", config=str(config), url=database.url, env=env)
        assert ran.returncode == 0, ran.stderr
    return added.stdout, spans_file


def test_a_request_its_task_the_retries_children_and_fan_in_are_one_trace(database, tmp_path):
    # Six bursts: the parent waits for its fan-in, which waits for the group.
    printed, spans_file = traced(database, tmp_path, REQUEST, 6)
    task_id = int(printed)
    with database.queue() as queue:
        assert queue.get_task(task_id).status == "success"
        assert queue.get_task(task_id).results == {
            "order": 44, "boxes": ["box of cup", "box of glass", "box of plate"]}

    spans = spans_in(spans_file)
    by_id = {s["span_id"]: s for s in spans}
    [request] = [s for s in spans if s["name"] == "POST /orders"]
    assert {s["trace_id"] for s in spans} == {request["trace_id"]}, "one trace"

    def parent_of(span):
        return by_id[span["parent_id"]]

    runs = [s for s in spans if s["name"].startswith("taskrunner.run ")]
    checkout = [s for s in runs if s["name"] == "taskrunner.run traced_tasks.checkout"]
    assert len(checkout) == 2     # its first run ends waiting for the fan-in, then resumes
    enqueue = parent_of(checkout[0])
    assert enqueue["name"] == "taskrunner.enqueue traced_tasks.checkout" \
        and enqueue["kind"] == "PRODUCER" and parent_of(enqueue) is request
    assert all(parent_of(run) is enqueue for run in checkout)
    assert [r["attributes"]["taskrunner.run.attempt"] for r in checkout] == [1, 2]
    assert checkout[0]["attributes"]["taskrunner.task.id"] == task_id
    assert checkout[0]["attributes"]["taskrunner.queue"] == "default"
    assert [r["attributes"]["taskrunner.run.status"] for r in checkout] == ["waiting",
                                                                           "success"]
    [charge] = [s for s in spans if s["name"] == "taskrunner.step charge"]
    assert parent_of(charge) is checkout[0]
    assert "taskrunner.step replayed" in checkout[1]["events"]

    # The children and their fan-in were added by checkout's first run: under its span.
    packs = [s for s in runs if s["name"] == "taskrunner.run traced_tasks.pack"]
    assert len(packs) == 4        # the glass twice: its failed attempt and its retry
    for run in packs:
        assert parent_of(parent_of(run)) is checkout[0]
    [failed] = [r for r in packs if r["status"] == "ERROR"]
    assert failed["exceptions"] == ["RuntimeError"], failed
    assert failed["description"] == "RuntimeError: dropped the glass"
    assert failed["attributes"]["taskrunner.run.status"] == "error"
    glass = [r for r in packs if parent_of(r) is parent_of(failed)]
    assert [r["attributes"]["taskrunner.run.attempt"] for r in glass] == [1, 2]
    [fan_in] = [s for s in runs if s["name"] == "taskrunner.run traced_tasks.summary"]
    assert parent_of(parent_of(fan_in)) is checkout[0]


CHUNK_REQUEST = textwrap.dedent("""
    import otel_setup, sys
    from opentelemetry import trace
    from taskrunner import TaskQueue, use_queue
    import traced_tasks

    otel_setup.configure()
    use_queue(TaskQueue(sys.argv[1]))
    with trace.get_tracer("shop.web").start_as_current_span("POST /labels"):
        print(" ".join(str(traced_tasks.label.enqueue(name=name).id)
                       for name in ("cup", "broken", "plate")))
""")


def test_a_chunks_call_is_a_span_linked_to_its_tasks_and_each_run_has_its_own(sqlite_db,
                                                                              tmp_path):
    """A chunk handler's one call for three tasks: a span of the call linked to the three
    enqueue spans, and a run span per task under its own enqueue span, linked to the call's,
    with that task's outcome (one item failed alone). SQLite only: the spans are made by
    the runner whatever its database."""
    database = sqlite_db
    printed, spans_file = traced(database, tmp_path, CHUNK_REQUEST, 1)
    task_ids = [int(word) for word in printed.split()]
    with database.queue() as queue:
        assert [queue.get_task(i).status for i in task_ids] == ["success", "given-up",
                                                                "success"]

    spans = spans_in(spans_file)
    by_id = {s["span_id"]: s for s in spans}
    [request] = [s for s in spans if s["name"] == "POST /labels"]
    enqueues = [s for s in spans if s["name"] == "taskrunner.enqueue traced_tasks.label"]
    assert len(enqueues) == 3 and all(by_id[s["parent_id"]] is request for s in enqueues)
    [call] = [s for s in spans if s["name"] == "taskrunner.chunk traced_tasks.label"]
    assert call["parent_id"] is None and call["kind"] == "CONSUMER"
    assert sorted(call["links"]) == sorted(s["span_id"] for s in enqueues)
    assert call["attributes"]["taskrunner.chunk.size"] == 3
    assert list(call["attributes"]["taskrunner.chunk.task_ids"]) == task_ids
    runs = {s["attributes"]["taskrunner.task.id"]: s for s in spans
            if s["name"] == "taskrunner.run traced_tasks.label"}
    assert sorted(runs) == sorted(task_ids)
    for task_id, run in runs.items():
        enqueue = by_id[run["parent_id"]]
        assert enqueue in enqueues and run["trace_id"] == request["trace_id"]
        assert run["links"] == [call["span_id"]]
    assert [runs[i]["attributes"]["taskrunner.run.status"] for i in task_ids] == [
        "success", "error", "success"]
    broken = runs[task_ids[1]]
    assert broken["status"] == "ERROR" and broken["exceptions"] == ["taskrunner.errors.TaskError"]
    assert broken["description"] == "NoLabel: no label for it"


def test_without_a_provider_nothing_imports_opentelemetry_or_stores_a_context(database):
    script = textwrap.dedent("""
        import sys
        from taskrunner import TaskQueue, use_queue
        import traced_tasks
        queue = TaskQueue(sys.argv[1])
        use_queue(queue)
        handle = traced_tasks.pack.enqueue("cup")
        queue.run_pending()
        assert handle.result(timeout=10) == "box of cup"
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        assert not loaded, loaded
        Task = queue.store.Task
        assert Task.select(Task.trace_context).where(Task.id == handle.id).scalar() is None
    """)
    database.queue().close()
    done = subprocess.run([sys.executable, "-c", script, database.url], env=process_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_setup_that_fails_is_logged_and_the_runner_works_untraced(sqlite_db, tmp_path):
    config = tmp_path / "taskrunner.toml"
    config.write_text('[tracing]\nsetup = "otel_setup:no_such_function"\n')
    with sqlite_db.queue() as queue:
        task_id = queue.add_task("taskrunner.handlers.Echo", {"x": 1})
    ran = taskrunner("runner", "--burst", config=str(config), url=sqlite_db.url)
    assert ran.returncode == 0, ran.stderr
    assert "[tracing] setup 'otel_setup:no_such_function' failed" in ran.stderr
    with sqlite_db.queue() as queue:
        assert queue.get_task(task_id).status == "success"


def test_a_setup_path_that_is_not_module_function_is_a_config_error(sqlite_db, tmp_path):
    config = tmp_path / "taskrunner.toml"
    config.write_text('[tracing]\nsetup = "not a path"\n')
    bad = taskrunner("check", config=str(config), url=sqlite_db.url)
    assert bad.returncode == 2 and "tracing" in bad.stderr and "module:function" in bad.stderr
