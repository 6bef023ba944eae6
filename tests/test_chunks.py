"""Chunks (chunks.py, runner/chunks.py): a handler called once with up to N tasks of its kind,
each ending with its own outcome. In-process through run_pending where the runner's loop is
the point, with real runner processes where waiting, signals and kill -9 are.

Every test of a chunk's call fails on a taskrunner without chunks: ``@task`` refuses the
``chunk`` option there, so tests/chunk_tasks.py does not import (and a handler called once
per task records as many calls as tasks)."""
import json
import os
import signal
import time

import pytest

import chunk_tasks
from chunk_tasks import calls
from conftest import START_TIMEOUT, runs_of, taskrunner, usage_error, wait_for
from taskrunner import InputError, TaskError
from taskrunner.chunks import Chunk, ChunkHandler, ChunkItem
from taskrunner.functions import task
from taskrunner.runs import lifecycle
from taskrunner.store.models import (CANCELLED, ERROR, RUNNING, SUCCESS, TIMEOUT, Run, Runner,
                                     Task)

EXIT_TIMEOUT = 60.0


def chunk_config(database, tmp_path, extra=""):
    return database.write_config(
        tmp_path / "c.toml", "[runner]\npoll_interval = 0.1\nheartbeat_interval = 0.2\n%s\n"
        "[task]\nretry_backoff = 0\n[overseer]\ncrash_grace = 0\ncheck_interval = 0.2\n"
        "kill_grace = 2\n" % extra)


def ended(task_ids):
    return not Task.select().where(Task.id.in_(list(task_ids)) & Task.finished_on.is_null()
                                   ).exists()


def stop(proc, procs):
    os.killpg(proc.pid, signal.SIGTERM)   # the group, as a terminal or supervisord
    assert procs.wait(proc, EXIT_TIMEOUT) == 0, procs.logs([proc])


# -- one call for many tasks -------------------------------------------------------------------

def test_a_chunk_is_one_call_of_up_to_chunk_tasks_each_with_its_own_result(database, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "calls")
    handles = [chunk_tasks.index.using(on=queue).enqueue(log=log, n=n) for n in range(7)]
    assert queue.run_pending() == 7
    assert [ids for _, ids, _ in calls(log)] == [[h.id for h in handles[:5]],
                                                [h.id for h in handles[5:]]]
    for n, handle in enumerate(handles):
        assert handle.status == "success"
        assert handle.result(timeout=0) == {"n": n}
    assert {Task.get_by_id(h.id).queue for h in handles} == {"chunk_tasks.index"}
    queue.close()


def test_one_task_fails_alone_and_is_retried_while_the_others_succeed(database, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "calls")
    handles = [chunk_tasks.index.using(on=queue).enqueue(log=log, n=n, fail=n == 1)
               for n in range(3)]
    queue.run_pending()
    failed = handles[1]
    assert [h.status for h in handles] == ["success", "retrying", "success"]
    run = queue.runs_of(failed.id)[0]
    assert (run.status, run.error_code, run.error_message) == (ERROR, "NoDocument",
                                                               "no such document")
    assert queue.get_task(failed.id).runs_failed == 1
    queue.run_pending(now=queue.get_task(failed.id).next_run_on)
    assert failed.status == "success" and failed.result(timeout=0) == {"n": 1}
    assert [ids for _, ids, _ in calls(log)] == [[h.id for h in handles], [failed.id]]
    assert [len(queue.runs_of(h.id)) for h in handles] == [1, 2, 1]
    queue.close()


def test_a_chunk_that_raises_fails_each_of_its_tasks_under_its_own_count(sqlite_db):
    queue = sqlite_db.queue()
    first = chunk_tasks.failing.using(on=queue, max_attempts=1).enqueue()
    second = chunk_tasks.failing.using(on=queue, max_attempts=3).enqueue()
    queue.run_pending()
    for handle in (first, second):
        run = queue.runs_of(handle.id)[0]
        assert (run.status, run.error_code) == (ERROR, "ValueError")
        assert "the index is down" in run.traceback
    assert (first.status, second.status) == ("given-up", "retrying")
    queue.close()


def test_a_class_handler_takes_chunks_from_a_queue_named_after_it(sqlite_db, tmp_path):
    queue = sqlite_db.queue()
    ids = [queue.add_task("chunk_tasks.Count") for _ in range(6)]
    assert {Task.get_by_id(i).queue for i in ids} == {"chunk_tasks.Count"}
    assert queue.run_pending() == 6
    assert [queue.runs_of(i)[0].results for i in ids] == [4, 4, 4, 4, 2, 2]
    queue.close()


def test_results_that_do_not_fit_the_chunk_fail_every_task_of_it(sqlite_db):
    queue = sqlite_db.queue()
    ids = [queue.add_task("chunk_tasks.TwoResults") for _ in range(3)]
    queue.run_pending()
    assert {(queue.runs_of(i)[0].status, queue.runs_of(i)[0].error_code) for i in ids} == {
        (ERROR, "InputError")}
    assert "returned 2 results for a chunk of 3 tasks" in queue.runs_of(ids[0])[0].error_message
    queue.close()


# -- a runner process: waiting, cancels, timeouts, kill -9 -------------------------------------

@pytest.mark.timeout(120)
def test_a_runner_waits_within_for_more_then_calls_with_what_arrived(database, procs,
                                                                    tmp_path):
    """chunk=5, chunk_within=1s: a second task added 0.3 s after the first is in the same
    call, which comes at least 1 s after the first was added, with the two alone."""
    queue = database.queue()
    log = str(tmp_path / "calls")
    runner = procs.spawn("runner", config=chunk_config(database, tmp_path))
    wait_for(lambda: Runner.select().where(Runner.pid == runner.pid).exists(),
             timeout=START_TIMEOUT, message="the runner to register")
    added = time.time()
    first = chunk_tasks.index.using(on=queue).enqueue(log=log, n=1)
    wait_for(lambda: first.status == "running", message="the first task to be claimed")
    time.sleep(0.3)     # added while the runner waits for more: part of the call
    second = chunk_tasks.index.using(on=queue).enqueue(log=log, n=2)
    wait_for(lambda: ended([first.id, second.id]), timeout=30, message="both to end")
    assert [(ids, at - added >= 1.0) for _, ids, at in calls(log)] == [
        ([first.id, second.id], True)]
    assert first.result(timeout=0) == {"n": 1} and second.result(timeout=0) == {"n": 2}
    stop(runner, procs)
    queue.close()


def gated(queue, tmp_path, count, **extra):
    """`count` tasks of chunk_tasks.index, the first holding its call until the gate opens;
    (the handles, the calls' log, the gate's path)."""
    log, gate = str(tmp_path / "calls"), str(tmp_path / "gate")
    handles = [chunk_tasks.index.using(on=queue, **extra).enqueue(
        log=log, n=n, **({"gate": gate} if n == 0 else {})) for n in range(count)]
    return handles, log, gate


def wait_in_call(gate):
    wait_for(lambda: os.path.exists(gate + ".started"), timeout=START_TIMEOUT,
             message="the chunk's call to start")


@pytest.mark.timeout(120)
def test_a_task_cancelled_while_its_chunk_runs_ends_cancelled_and_the_others_succeed(
        database, procs, tmp_path):
    queue = database.queue()
    handles, log, gate = gated(queue, tmp_path, 3)
    runner = procs.spawn("runner", config=chunk_config(database, tmp_path))
    wait_in_call(gate)
    queue.cancel(handles[1].id)
    open(gate, "w").close()
    wait_for(lambda: ended([h.id for h in handles]), timeout=30, message="all to end")
    assert [h.status for h in handles] == ["success", "cancelled", "success"]
    assert runs_of(handles[1].id)[0].status == CANCELLED
    assert [ids for _, ids, _ in calls(log)] == [[h.id for h in handles]]
    stop(runner, procs)
    queue.close()


@pytest.mark.timeout(120)
def test_a_run_of_a_chunk_timed_out_by_someone_else_interrupts_the_call(database, procs,
                                                                       tmp_path):
    """Rule 8 for a chunk: one of its runs ended ``timeout`` by another process — the
    handler is interrupted, and every run of the chunk still this runner's ends timeout."""
    queue = database.queue()
    handles, log, gate = gated(queue, tmp_path, 2)
    runner = procs.spawn("runner", config=chunk_config(database, tmp_path))
    wait_in_call(gate)
    other = runs_of(handles[1].id)[0]
    assert lifecycle.end_run(queue.store, other.id, other.task_id, TIMEOUT,
                             error_code="RunTimeout", error_message="by the test")
    wait_for(lambda: runs_of(handles[0].id)[0].status != RUNNING, timeout=20,
             message="the gated run to end")
    gated_run = runs_of(handles[0].id)[0]
    assert (gated_run.status, gated_run.error_code) == (TIMEOUT, "Interrupted")
    assert not os.path.exists(log + ".done")     # the call never returned
    assert runner.poll() is None                 # the runner carries on
    open(gate, "w").close()
    stop(runner, procs)
    queue.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_mid_chunk_loses_no_task_and_succeeds_none_twice(database, procs, tmp_path):
    queue = database.queue()
    handles, log, gate = gated(queue, tmp_path, 4)
    config = chunk_config(database, tmp_path)
    victim = procs.spawn("runner", config=config)
    wait_in_call(gate)
    victim_row = Runner.get(Runner.pid == victim.pid)
    os.kill(victim.pid, signal.SIGKILL)
    assert procs.wait(victim) == -signal.SIGKILL
    # This host's sweep: the victim's row and every run of its chunk become timeout.
    taskrunner("run-event", "task-queue:OnProcess", config=config, check=True)
    assert Runner.get_by_id(victim_row.id).status == TIMEOUT
    lost = list(Run.select().where(Run.runner_id == victim_row.id))
    assert sorted(r.task_id for r in lost) == [h.id for h in handles]
    assert {(r.status, r.error_code) for r in lost} == {(TIMEOUT, "RunnerDied")}

    open(gate, "w").close()
    rescuer = procs.spawn("runner", "--burst", config=config)
    assert procs.wait(rescuer, 180) == 0, procs.logs([rescuer])
    wait_for(lambda: ended([h.id for h in handles]), timeout=60, message="every task to end")
    assert [h.status for h in handles] == ["success"] * 4
    success = [r.task_id for r in Run.select(Run.task_id).where(Run.status == SUCCESS)]
    assert sorted(success) == [h.id for h in handles], "a task has no or two successes"
    done = [task_id for call in calls(log + ".done") for task_id in call[1]]
    assert sorted(done) == [h.id for h in handles], "a task's work was done twice or never"
    assert [len(ids) for _, ids, _ in calls(log)] == [4, 4]
    queue.close()


# -- refused -------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    ({"chunk": 0}, "chunk must be a whole number of tasks >= 1, not 0"),
    ({"chunk": True}, "chunk must be a whole number"),
    ({"chunk": "10"}, "chunk must be a whole number"),
    ({"chunk": 10, "chunk_within": "soon"}, "chunk_within: invalid time span 'soon'"),
    ({"chunk": 10, "chunk_within": -1}, "chunk_within: a time span cannot be negative"),
    ({"chunk_within": "2s"}, "chunk_within needs chunk"),
])
def test_bad_chunk_options_are_refused_naming_what_is_wrong(options, words):
    with pytest.raises(InputError) as caught:
        task(**options)(_one_parameter)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def _one_parameter(chunk):
    return None


def test_a_chunk_function_takes_one_parameter_and_its_tasks_take_arguments_by_name(sqlite_db):
    def two(chunk, extra):
        return None
    two.__qualname__ = "two"
    with pytest.raises(TypeError, match="must take one parameter, the chunk"):
        task(chunk=3)(two)
    queue = sqlite_db.queue()
    with pytest.raises(InputError, match="takes its arguments by name"):
        chunk_tasks.index.using(on=queue).enqueue(1)
    with pytest.raises(InputError, match="'when' is not JSON-serialisable"):
        chunk_tasks.index.using(on=queue).enqueue(when=object())
    with pytest.raises(InputError, match="a chunk task's queue is set on @task"):
        chunk_tasks.index.using(queue="other")
    assert Task.select().count() == 0
    queue.close()


def test_taskrunner_add_of_a_chunk_task_refuses_data_that_is_not_arguments(sqlite_db,
                                                                            tmp_path):
    queue, config = sqlite_db.queue(), sqlite_db.write_config(tmp_path / "c.toml")
    usage_error(taskrunner("add", "chunk_tasks.index", "--data", "[1, 2]", config=config),
                "must be a JSON object of arguments by name")
    added = taskrunner("add", "chunk_tasks.index", "--data", json.dumps({"n": 1}),
                       config=config, check=True)
    assert queue.get_task(int(added.stdout.split()[0])).queue == "chunk_tasks.index"
    queue.close()


def test_item_fail_takes_an_exception_or_a_message():
    one = ChunkItem(1, 1, 1, {})
    one.fail("gone")
    assert isinstance(one.failure, TaskError) and str(one.failure) == "gone"
    with pytest.raises(TypeError):
        one.fail(42)


class _Later(ChunkHandler):
    chunk_size = 2


def test_a_chunk_handler_class_queue_is_its_path_unless_it_names_one():
    assert _Later.queue == "test_chunks._Later"

    class Named(ChunkHandler):
        queue = "bulk"
    assert Named.queue == "bulk"
    assert isinstance(Chunk([]), list)
