"""Code versions (docs: "Changing durable code under running work"): a runner records the
version of the code it runs, a durable task the version it started under; `run.patched`
answers once per task and keeps its answer; a deploy (HUP) in the middle of 100 durable runs
whose handler gained, removed, reordered and renamed steps ends every run as the rules say,
no completed step running again; the operator sees runs by version and old ones drain."""
import json
import re
import os
import signal
import textwrap
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from conftest import REPO_DIR, TESTS_DIR, spawn, taskrunner, wait_for
from durable_handlers import lines
from test_overseer import fresh_overseers, overseer_toml, runner_rows
from taskrunner import TaskError, TaskHandler
from taskrunner.store.models import RUNNER, Run, Runner, Step, Task

# The handler before the deploy: five steps, a durable pause between b and c (so that many
# tasks are half done at once), a check for a stop between steps (a deploy hands the run
# back there). Each execution of a step is logged outside the database.
V1 = '''
import os
import time

from taskrunner import TaskError, TaskHandler

LABEL = "v1"


def work(log, task_id, name):
    with open(log, "a") as fh:
        fh.write("%d %s %s\\n" % (task_id, name, LABEL))
    time.sleep(0.02)
    return name


class Flow(TaskHandler):
    def handle(self, run):
        log = run.data["log"]

        def step(name):
            if run.should_stop():
                raise TaskError("stopped before %s" % name, code="Stopped")
            return run.step(name, work, log, run.task_id, name)
        STEPS
'''
BODY_V1 = '''
        step("a")
        step("b")
        run.sleep(0.5, name="pause")
        step("c")
        step("d")
        step("e")
'''
# After the deploy: x added before the steps done, b removed, c and d reordered, e renamed
# e2, and a patched branch after a.
BODY_V2 = '''
        step("x")
        step("a")
        if run.patched("summary"):
            step("summary-v2")
        else:
            step("summary-v1")
        run.sleep(0.5, name="pause")
        step("d")
        step("c")
        step("e2")
'''


def module(label, body):
    return textwrap.dedent(V1).replace('LABEL = "v1"', 'LABEL = "%s"' % label).replace(
        "        STEPS\n", textwrap.indent(textwrap.dedent(body), " " * 8))


def steps_by_version(task_id):
    """{name: the code version of the runner that recorded it} of a task's steps."""
    return {name: version for name, version in Step.select(Step.name, Runner.code_version)
            .join(Run, on=(Run.id == Step.run_id)).join(Runner, on=(Runner.id == Run.runner_id))
            .where(Step.task_id == task_id).tuples()}


@pytest.fixture(params=("sqlite", "postgresql", "mysql"))
def overseers(request, tmp_path):
    with fresh_overseers(request.param, tmp_path) as group:
        yield group


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_a_deploy_in_the_middle_of_100_durable_runs_ends_each_as_the_rules_say(
        overseers, tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    handlers = code / "deploy_flow.py"
    handlers.write_text(module("v1", BODY_V1))
    monkeypatch.syspath_prepend(str(code))          # add_task checks the handler
    queue = overseers.database.queue()
    log = str(tmp_path / "executed")
    ids = [queue.add_task("deploy_flow.Flow", {"log": log}, max_retries=3)
           for _ in range(100)]
    config = overseers.config(limit=4, check_interval=0.3)
    env = {"PYTHONPATH": os.pathsep.join([str(code), TESTS_DIR, REPO_DIR]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = spawn("overseer", config=config, env=env,
                 log_path=tmp_path / "overseer-0.log")
    proc.log_path = tmp_path / "overseer-0.log"
    overseers.started.append(proc)

    # The deploy once about a third of the tasks are past b: many paused, some in flight.
    wait_for(lambda: sum(name == "b" for _, name, _ in lines(log)) >= 35, timeout=120,
             message="35 tasks past step b")
    v1 = {r.code_version for r in Runner.select().where(Runner.kind == RUNNER)}
    assert len(v1) == 1 and None not in v1, v1
    handlers.write_text(module("v2", BODY_V2))
    os.killpg(proc.pid, signal.SIGHUP)              # as supervisord's `signal HUP` would
    wait_for(lambda: Task.select().where(Task.finished_on.is_null()).count() == 0,
             timeout=240, interval=0.2, message="every task to end")

    [old] = v1
    versions = {r.code_version for r in Runner.select().where(Runner.kind == RUNNER)}
    assert len(versions) == 2 and old in versions, versions
    [new] = versions - {old}
    live = {r.code_version for r in runner_rows()}
    assert live == {new}, "the runners left are the new code's"
    tasks = {t.id: t for t in Task.select().where(Task.id.in_(ids))}
    assert {t.last_status for t in tasks.values()} == {"success"}, overseers.log()

    executed = Counter((int(task), name) for task, name, _ in lines(log))
    assert max(executed.values()) == 1, [k for k, n in executed.items() if n > 1]
    labels = {(int(task), name): label for task, name, label in lines(log)}
    kinds = Counter()
    for task_id in ids:
        recorded = steps_by_version(task_id)
        for name, version in recorded.items():
            if name.startswith("patch:") or name == "pause":
                continue
            # each step ran once, under the code of the runner that recorded it
            assert executed[(task_id, name)] == 1, (task_id, name)
            assert labels[(task_id, name)] == {old: "v1", new: "v2"}[version]
        before = {name for name, version in recorded.items() if version == old}
        started = tasks[task_id].code_version
        if not before:
            kinds["new"] += 1
            assert started == new
            assert set(recorded) == {"x", "a", "patch:summary", "summary-v2", "pause", "d",
                                     "c", "e2"}, (task_id, recorded)
        elif set(recorded.values()) == {old}:
            kinds["old, ended before the deploy"] += 1
            assert started == old
            assert set(recorded) == {"a", "b", "pause", "c", "d", "e"}, (task_id, recorded)
        else:
            kinds["old, ended after it"] += 1
            assert started == old
            # The patch is False once the old code went past where it stands (b, the pause),
            # True when it had only done a.
            summary = "summary-v1" if before - {"a"} else "summary-v2"
            assert set(recorded) == before | {"x", "a", "patch:summary", summary, "pause",
                                              "d", "c", "e2"}, (task_id, before, recorded)
            assert "e" not in recorded and ("b" in recorded) == ("b" in before)
            assert recorded["x"] == new and recorded["e2"] == new
    # How many tasks span the deploy depends on how soon the old runners leave, i.e. on the
    # machine's load (7 to 20 seen): each of them was checked against the rules above.
    assert kinds["new"] >= 1 and kinds["old, ended after it"] >= 3, kinds

    # The operator's view: the old version has drained, the new one runs.
    shown = taskrunner("versions", "--json", config=config)
    assert shown.returncode == 0, shown.stderr
    found = {v["code_version"]: v for v in json.loads(shown.stdout)}
    assert found[old]["drained"] and found[old]["runners"] == 0 \
        and found[old]["open_tasks"] == 0
    assert found[new]["runners"] >= 1 and not found[new]["drained"]
    listed = taskrunner("tasks", "--code-version", old, "--all", "--json", config=config)
    assert sorted(t["id"] for t in json.loads(listed.stdout)) == sorted(
        i for i in ids if tasks[i].code_version == old)
    queue.close()


# -- run.patched and the versions recorded, in-process (run_pending) --------------------------

CODE = {"patch": False}     # whether the code running has the patch (the deploy, in-process)
SEEN = []                   # (task, attempt, run.code_version, the patch's answer or None)


class Branch(TaskHandler):
    """Step a, then (in the code with the patch) run.patched("fix"), then step b; fails its
    attempts before data["attempts"] (after a alone when data["fail_after_a"] on the first)."""

    def handle(self, run):
        run.step("a", lambda: "a")
        if run.data.get("fail_after_a") and run.attempt == 1:
            raise TaskError("again", code="Again")
        answer = run.patched("fix") if CODE["patch"] else None
        run.step("b", lambda: "b")
        SEEN.append((run.task_id, run.attempt, run.code_version, answer))
        if run.attempt < run.data["attempts"]:
            raise TaskError("again", code="Again")
        run.results = answer


class Plain(TaskHandler):
    def handle(self, run):
        run.results = "done"


def under(database, version, patch):
    """A queue whose runs run code `version` (with the patch or not)."""
    CODE["patch"] = patch
    return database.queue(runner={"code_version": version})


def answers(task_id):
    return [(attempt, version, answer) for task, attempt, version, answer in SEEN
            if task == task_id]


def test_patched_is_false_for_a_task_the_old_code_took_past_it_and_kept_on_every_attempt(
        database):
    SEEN.clear()
    queue = under(database, "v1", patch=False)
    past = queue.add_task(__name__ + ".Branch", {"attempts": 3}, retry_backoff=0)
    before = queue.add_task(__name__ + ".Branch", {"attempts": 2, "fail_after_a": True},
                            retry_backoff=0)
    plain = queue.add_task(__name__ + ".Plain")
    queue.run_pending()       # past: a, b, fails; before: a, fails; plain: success
    queue.close()
    queue = under(database, "v2", patch=True)
    new = queue.add_task(__name__ + ".Branch", {"attempts": 2}, retry_backoff=0)
    queue.run_pending(max_runs=3)    # past's and before's second attempts, new's first
    queue.close()
    queue = under(database, "v3", patch=True)
    while queue.run_pending():
        pass
    # The old code went past the patch (b recorded): False, on every later attempt, whatever
    # version runs them.
    assert answers(past) == [(1, "v1", None), (2, "v1", False), (3, "v1", False)]
    assert queue.get_task(past).results is False
    # The old code stopped before it (only a): the new path.
    assert answers(before)[-1] == (2, "v1", True)
    # A task the new code started: True, and kept under the next version.
    assert answers(new) == [(1, "v2", True), (2, "v2", True)]
    assert [s.name for s in queue.steps_of(new)] == ["a", "patch:fix", "b"]
    versions = {t: queue.get_task(t).code_version for t in (past, before, new, plain)}
    assert versions == {past: "v1", before: "v1", new: "v2", plain: None}
    assert Task.get_by_id(plain).code_version is None       # a plain job writes none
    runners = [r.code_version for r in Runner.select().order_by(Runner.id)]
    assert sorted(set(runners)) == ["v1", "v2", "v3"] and runners == sorted(runners)
    queue.close()


def test_a_task_recorded_before_versions_were_kept_takes_the_old_path(database):
    """Steps and no version (recorded before migration 0032): its version stays unknown and
    the attempt that replays past the patch takes the old path."""
    SEEN.clear()
    queue = under(database, "v1", patch=False)
    task_id = queue.add_task(__name__ + ".Branch", {"attempts": 2}, retry_backoff=0)
    queue.run_pending(max_runs=1)
    Task.update(code_version=None).where(Task.id == task_id).execute()
    queue.close()
    queue = under(database, "v2", patch=True)
    while queue.run_pending():
        pass
    assert answers(task_id) == [(1, "v1", None), (2, None, False)]
    assert queue.get_task(task_id).code_version is None
    queue.close()


class Counted(TaskHandler):
    """Resumes from its checkpoint; asks for the patch in the code that has it."""

    def handle(self, run):
        start = run.resumed_from or 0
        answer = run.patched("fix") if CODE["patch"] else None
        SEEN.append((run.task_id, run.attempt, run.code_version, answer))
        run.checkpoint(start + 1)
        if run.attempt < 2:
            raise TaskError("again", code="Again")
        run.results = start


def test_a_checkpoint_records_the_version_and_a_resume_from_older_code_keeps_the_old_path(
        database):
    SEEN.clear()
    queue = under(database, "v1", patch=False)
    task_id = queue.add_task(__name__ + ".Counted", retry_backoff=0)
    queue.run_pending(max_runs=1)
    assert queue.get_task(task_id).code_version == "v1"     # the checkpoint wrote it
    queue.close()
    queue = under(database, "v2", patch=True)
    while queue.run_pending():
        pass
    assert answers(task_id) == [(1, "v1", None), (2, "v1", False)]
    assert queue.get_task(task_id).results == 1
    queue.close()


def test_versions_and_tasks_by_version_on_the_command_line(database, tmp_path):
    SEEN.clear()
    queue = under(database, "v1", patch=False)
    old = queue.add_task(__name__ + ".Branch", {"attempts": 2}, retry_backoff=3600)
    queue.run_pending(max_runs=1)       # fails: its retry in an hour
    queue.close()
    queue = under(database, "v2", patch=True)
    new = queue.add_task(__name__ + ".Branch", {"attempts": 1})
    queue.run_pending(max_runs=1)
    config = database.write_config(tmp_path / "c.toml")
    shown = taskrunner("versions", "--json", config=config)
    assert shown.returncode == 0, shown.stderr
    found = {v["code_version"]: v for v in json.loads(shown.stdout)}
    assert found["v1"]["open_tasks"] == 1 and found["v1"]["runners"] == 0
    assert not found["v1"]["drained"]                   # its task has not ended
    assert found["v2"]["open_tasks"] == 0 and found["v2"]["drained"]
    listed = taskrunner("tasks", "--code-version", "v1", "--json", config=config)
    assert [(t["id"], t["code_version"]) for t in json.loads(listed.stdout)] == [(old, "v1")]
    text = taskrunner("versions", config=config).stdout
    assert "CODE VERSION" in text and "v1" in text
    queue.run_pending(now=datetime.now(timezone.utc) + timedelta(hours=2))
    assert queue.get_task(old).status == "success"
    found = {v["code_version"]: v for v in json.loads(
        taskrunner("versions", "--json", config=config).stdout)}
    assert found["v1"]["drained"], "its last task ended: v1 has drained"
    show = json.loads(taskrunner("show", str(new), "--json", config=config).stdout)
    assert show["code_version"] == "v2"
    queue.close()


@pytest.mark.parametrize("args, env, toml, said", [
    (("tasks", "--code-version", "two words"), None, "", "--code-version"),
    (("cancel", "--code-version", "x" * 65), None, "", "--code-version"),
    (("versions",), {"TASKRUNNER_CODE_VERSION": "a b"}, "", "TASKRUNNER_CODE_VERSION"),
    (("versions",), None, '[runner]\ncode_version = "a\\tb"\n', "code_version"),
    (("versions",), None, "[runner]\ncode_version = 3\n", "code_version"),
])
def test_a_bad_code_version_is_refused_in_one_line(sqlite_db, tmp_path, args, env, toml, said):
    config = sqlite_db.write_config(tmp_path / "c.toml", toml)
    result = taskrunner(*args, config=config, env=env)
    assert result.returncode == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_dashboard_and_the_metrics_show_versions(sqlite_db):
    from dashboard_helpers import Served, fetch
    from taskrunner.fleet import liveness
    from taskrunner.web.metrics import exposition
    SEEN.clear()
    queue = under(sqlite_db, "v1", patch=False)
    task_id = queue.add_task(__name__ + ".Branch", {"attempts": 2}, retry_backoff=3600)
    queue.run_pending(max_runs=1)          # started under v1, not ended
    liveness.register(queue.store, code_version="v2<b>")     # a runner of the next version
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/runners")[1]
        assert "Code version" in body and "v2&lt;b&gt;" in body and "<b>" not in body
        card = body[body.index("<h2>Code versions</h2>"):]
        rows = re.findall(r"<tr>.*?</tr>", card, re.S)
        assert any(">v1<" in r and ">1<" in r and ">no<" in r for r in rows), rows
        page = fetch(served.url + "/api/parts?page=task&id=%d" % task_id)[1]
        assert "<dt>Code version</dt><dd>v1</dd>" in json.loads(page)["task-live"]
    finally:
        served.stop()
    text = exposition(queue.store).decode()
    assert 'taskrunner_code_version_open_tasks{code_version="v1"} 1.0' in text
    assert 'taskrunner_code_version_runners{code_version="v2<b>"} 1.0' in text
    queue.close()


def test_a_computed_version_follows_the_source_and_warns_when_it_finds_none(tmp_path, caplog):
    """The default version hashes the application's source: a changed file changes it. With
    no source at all (an application installed into site-packages, without [handlers]
    allow) every deploy would keep one version: the runner says so once, when its first
    durable run starts (execute.py: a plain task never reads a version)."""
    from taskrunner.runner import versions
    package = tmp_path / "myapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tasks.py").write_text("def a(): pass\n")
    first = versions.digest([str(package)])
    (package / "tasks.py").write_text("def a(): return 1\n")
    assert versions.digest([str(package)]) != first
    with caplog.at_level("WARNING", logger="taskrunner.runner"):
        versions.warn_if_unnamed()
    assert "no application source" not in caplog.text
    versions.digest([])
    with caplog.at_level("WARNING", logger="taskrunner.runner"):
        versions.warn_if_unnamed()
        versions.warn_if_unnamed()
    assert caplog.text.count("no application source found") == 1
