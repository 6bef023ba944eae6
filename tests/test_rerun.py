"""Re-running an ended durable task from one of its steps (DBOS's fork): the steps before it
keep their results, it and the later ones run again as a new run of the same task, recorded
with who asked and why — from the API, the CLI and the dashboard."""
import json
import re
from urllib.parse import quote

import pytest

import rerun_tasks as rt
from conftest import taskrunner
from taskrunner import InputError, StateError, TaskNotFound, chain, use_queue


@pytest.fixture
def default(queue):
    before = use_queue(queue)
    yield queue
    use_queue(before)


def executed(log):
    with open(log) as lines:
        return lines.read().split()


def ended(queue, task_id):
    for _ in range(5):
        if not queue.run_pending():
            break
    return queue.get_task(task_id)


def test_a_rerun_keeps_the_steps_before_it_and_runs_it_and_the_later_ones_again(default,
                                                                               tmp_path):
    log = str(tmp_path / "log")
    handle = rt.pipeline.enqueue(log)
    assert ended(default, handle.id).status == "success"
    assert executed(log) == ["fetch", "transform", "load"]
    before = {s.name: s for s in default.steps_of(handle.id)}

    run_id = default.rerun_from(handle.id, "transform", reason="the rates table was wrong",
                                requested_by="ops@example")
    task = default.get_task(handle.id)
    assert task.status == "scheduled" and task.checkpoint is None
    assert [s.name for s in default.steps_of(handle.id)] == ["fetch"]
    assert ended(default, handle.id).status == "success"
    # fetch kept its record and did not run again; transform and load ran once more
    assert executed(log) == ["fetch", "transform", "load", "transform", "load"]
    after = {s.name: s for s in default.steps_of(handle.id)}
    assert after["fetch"].run_id == before["fetch"].run_id
    assert after["load"].run_id == run_id != before["load"].run_id
    assert handle.result(timeout=5) == {"loaded": 6, "resumed_from": None}
    runs = default.runs_of(handle.id)
    assert [r.status for r in runs] == ["success", "success"] and runs[-1].id == run_id
    [rerun] = default.reruns_of(handle.id)
    assert (rerun.from_step, rerun.steps_dropped, rerun.run_id, rerun.requested_by,
            rerun.reason) == ("transform", 2, run_id, "ops@example", "the rates table was wrong")


def test_a_given_up_task_rerun_after_the_fix_succeeds_and_its_cancelled_dependents_run(
        default, tmp_path):
    log = str(tmp_path / "log")
    open(log + ".broken", "w").close()
    workflow = chain(rt.pipeline.s(log), rt.notify.s(log)).enqueue()
    first, after = [h.id for h in workflow.tasks]
    assert ended(default, first).status == "given-up"
    assert default.get_task(after).status == "cancelled"
    assert executed(log) == ["fetch", "transform"]

    (tmp_path / "log.broken").unlink()          # the bug is fixed, and transform's too
    with pytest.raises(InputError, match="never recorded: retry runs it again keeping"):
        default.rerun_from(first, "load")      # the step that failed was never recorded
    default.rerun_from(first, "transform")
    assert ended(default, first).status == "success"
    assert ended(default, after).status == "success"
    assert executed(log) == ["fetch", "transform", "transform", "load", "notify"]
    assert [r.status for r in default.runs_of(first)] == ["error", "success"]


def test_a_rerun_is_refused_while_the_task_lives_or_for_a_step_it_never_recorded(default,
                                                                                 tmp_path):
    log = str(tmp_path / "log")
    handle = rt.pipeline.enqueue(log)
    with pytest.raises(StateError, match="is scheduled; only a task that succeeded or gave up"):
        default.rerun_from(handle.id, "fetch")
    ended(default, handle.id)
    with pytest.raises(InputError, match=r"has no step 'fetchh' \(its steps: fetch, "
                                         r"transform, load\)"):
        default.rerun_from(handle.id, "fetchh")
    with pytest.raises(TaskNotFound):
        default.rerun_from(handle.id + 1000, "fetch")
    with pytest.raises(InputError, match="the reason"):
        default.rerun_from(handle.id, "fetch", reason="x" * 1001)
    default.rerun_from(handle.id, "load")
    with pytest.raises(StateError, match="is scheduled"):    # a second click before it ran
        default.rerun_from(handle.id, "load")
    assert executed(log) == ["fetch", "transform", "load"]
    assert len(default.steps_of(handle.id)) == 2 and len(default.reruns_of(handle.id)) == 1


def test_the_cli_reruns_from_a_step_and_show_lists_the_reruns(database, tmp_path):
    log = str(tmp_path / "log")
    with database.queue() as queue:
        before = use_queue(queue)
        try:
            handle = rt.pipeline.enqueue(log)
        finally:
            use_queue(before)
        ended(queue, handle.id)
    for args, says in ((["--from-step", "nope"], "has no step 'nope'"),
                       (["--from-step", ""], "the step must not be empty")):
        bad = taskrunner("rerun", str(handle.id), *args, url=database.url)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert says in bad.stderr and "Traceback" not in bad.stderr
    done = taskrunner("rerun", str(handle.id), "--from-step", "load", "--reason",
                      "retry the load", "--json", url=database.url, check=True)
    answer = json.loads(done.stdout)
    assert answer["from_step"] == "load" and answer["requested_by"].count("@") == 1
    shown = taskrunner("show", str(handle.id), url=database.url, check=True).stdout
    assert "re-runs:" in shown and "retry the load" in shown
    shown = json.loads(taskrunner("show", str(handle.id), "--json", url=database.url,
                                  check=True).stdout)
    assert shown["reruns"][0]["run_id"] == answer["run_id"]
    assert shown["reruns"][0]["steps_dropped"] == 1
    again = taskrunner("rerun", str(handle.id), "--from-step", "load", url=database.url)
    assert again.returncode == 2 and "is scheduled; only a task" in again.stderr
    missing = taskrunner("rerun", str(handle.id), url=database.url)
    assert missing.returncode == 2 and "--from-step" in missing.stderr


def test_the_dashboard_reruns_from_a_step_with_its_csrf_token(sqlite_db, tmp_path):
    pytest.importorskip("prometheus_client")
    from dashboard_helpers import Served, fetch
    from test_dashboard import notice_of, token_of
    log = str(tmp_path / "log")
    queue = sqlite_db.queue()
    before = use_queue(queue)
    served = Served(queue.store)
    try:
        handle = rt.pipeline.enqueue(log)
        ended(queue, handle.id)
        page = fetch(served.url + "/tasks/%d" % handle.id)[1]
        assert 'action="/tasks/%d/rerun"' % handle.id in page
        assert re.findall(r'<option value="([^"]+)">', page) == ["fetch", "transform", "load"]
        url = served.url + "/tasks/%d/rerun" % handle.id
        status, _, _ = fetch(url, data="step=transform&csrf=forged")
        assert status == 403 and queue.get_task(handle.id).status == "success"
        token = token_of(served, "/tasks/%d" % handle.id)
        status, _, headers = fetch(url, data="step=transform&reason=%s&csrf=%s" % (
            quote("<b>bad rates</b>"), token))
        assert status == 303 and notice_of(headers).startswith(
            "task %d runs again from step transform" % handle.id)
        ended(queue, handle.id)
        assert executed(log) == ["fetch", "transform", "load", "transform", "load"]
        page = fetch(served.url + "/tasks/%d" % handle.id)[1]
        assert "&lt;b&gt;bad rates&lt;/b&gt;" in page and "<b>bad rates</b>" not in page
        assert re.search(r"dashboard@127\.0\.0\.1", page)
        status, _, headers = fetch(url, data="step=nope&csrf=" + token)
        assert status == 303 and "has no step 'nope'" in notice_of(headers)
    finally:
        served.stop()
        use_queue(before)
        queue.close()
