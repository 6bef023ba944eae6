"""Workflows (DESIGN "Graph", rule 10; issue 26): tasks that run after others — released in
the transaction of their last parent's success, exactly once, never before; chains, groups
and fan-in over results; the failure policy; a workflow read, waited for and cancelled."""
import os
import random
import time

import pytest

from conftest import Database, wait_for
from taskrunner import TaskQueue
from taskrunner.errors import InputError, WaitTimeout
from taskrunner.fleet import liveness
from taskrunner.runs import lifecycle
from taskrunner.store.models import CANCELLED, SUCCESS, utcnow

STEP = "workflow_handlers.Step"
SUM = "workflow_handlers.Sum"


def test_a_task_after_others_has_no_run_until_its_last_parent_succeeded(queue):
    a = queue.add_task(STEP, {"value": 1})
    b = queue.add_task(STEP, {"value": 2})
    c = queue.add_task(STEP, {"value": 3}, after=[a, b])
    Run = queue.store.Run
    assert Run.select().where(Run.task_id == c).count() == 0
    assert queue.get_task(c).waiting_parents == 2
    queue.run_pending(max_runs=1)
    assert Run.select().where(Run.task_id == c).count() == 0
    assert queue.get_task(c).waiting_parents == 1
    queue.run_pending(max_runs=1)
    # Released by b's success: its run exists now (created in that transaction).
    assert Run.select().where(Run.task_id == c).count() == 1
    assert queue.get_task(c).waiting_parents is None
    queue.run_pending()
    assert queue.get_task(c).status == SUCCESS
    assert dict(queue.parent_results(c).items()) == {a: 1, b: 2}


def test_a_parent_that_already_succeeded_counts_as_done_and_an_unknown_one_is_refused(queue):
    a = queue.add_task(STEP)
    queue.run_pending()
    b = queue.add_task(STEP, after=[a])
    assert queue.get_task(b).waiting_parents is None and queue.get_task(b).runs == 1
    with pytest.raises(InputError, match="after: no task with id 999999"):
        queue.add_task(STEP, after=[a, 999999])
    with pytest.raises(InputError, match="on_parent_failure"):
        queue.add_task(STEP, after=[a], on_parent_failure="maybe")


def test_chain_group_and_fan_in_over_results(queue):
    chain = queue.chain({"handler": STEP, "data": {"value": 1}}, STEP, STEP, name="c")
    group = queue.group([{"handler": STEP, "data": {"value": i}} for i in range(1, 21)],
                        then=SUM)
    assert queue.workflow(chain.id).counts == {"scheduled": 1, "waiting": 2}
    queue.run_pending()
    info = queue.workflow(group.id)
    assert info.outcome == SUCCESS and info.progress == 1.0 and info.total == 21
    assert queue.get_task(group.task_ids[-1]).results == {"sum": 210, "parents": 20}
    assert info.tasks[-1].after == group.task_ids[:-1]
    runs = [queue.runs_of(t)[0] for t in chain.task_ids]
    assert runs[0].finished_on <= runs[1].started_on and runs[1].finished_on <= runs[2].started_on
    assert queue.wait_workflow(chain.id, timeout=5).outcome == SUCCESS


def test_a_given_up_parent_cancels_its_dependents_transitively_unless_they_run_anyway(queue):
    a = queue.add_task(STEP, {"fail": True}, max_retries=1)
    b = queue.add_task(STEP, after=[a])
    c = queue.add_task(STEP, after=[b])
    d = queue.add_task(STEP, after=[a], on_parent_failure="run")
    queue.run_pending()
    for task_id in (b, c):
        task = queue.get_task(task_id)
        assert task.status == CANCELLED and task.last_error_code == "ParentFailed", task
    assert "task %d" % a in queue.get_task(b).last_error_message
    assert queue.get_task(d).status == SUCCESS
    assert queue.parent_results(d)[a] is None
    # A retry of the given-up parent re-arms what its failure cancelled.
    queue.store.Task.update(data='{}').where(queue.store.Task.id == a).execute()
    assert queue.retry(a) == 2
    assert queue.get_task(b).waiting_parents == 1 and queue.get_task(c).waiting_parents == 1
    queue.run_pending()
    assert [queue.get_task(t).status for t in (a, b, c, d)] == [SUCCESS] * 4
    assert len(queue.runs_of(d)) == 1     # ran once: its edge from a was satisfied


def test_a_cancelled_parent_cancels_its_dependents_and_a_workflow_cancels_as_one(queue):
    wf = queue.add_workflow([{"key": "a", "handler": STEP},
                             {"key": "b", "handler": STEP, "after": ["a"]},
                             {"key": "c", "handler": STEP, "after": ["b"]}], name="three")
    a, b, c = wf.task_ids
    queue.cancel(a)
    assert queue.get_task(b).status == CANCELLED == queue.get_task(c).status
    wf2 = queue.chain(STEP, STEP, STEP)
    assert queue.cancel_workflow(wf2.id) == {"cancelled": 3, "stopping": 0}
    info = queue.workflow(wf2.id)
    assert info.outcome == CANCELLED and info.counts == {CANCELLED: 3}
    assert queue.workflow(wf.id).outcome == CANCELLED
    # A task added after a cancelled one is cancelled at once; "run" lets it run.
    x = queue.add_task(STEP, after=[a])
    y = queue.add_task(STEP, after=[a], on_parent_failure="run")
    assert queue.get_task(x).status == CANCELLED and queue.get_task(y).runs == 1


def test_wait_workflow_times_out_while_tasks_wait(queue):
    wf = queue.chain(STEP, STEP)
    with pytest.raises(WaitTimeout):
        queue.wait_workflow(wf.id, timeout=0.2)


def test_workflow_specs_are_checked(queue):
    with pytest.raises(InputError, match="neither a task id nor the key"):
        queue.add_workflow([{"handler": STEP, "after": ["nope"]}])
    with pytest.raises(InputError, match="key of a task added before it"):
        queue.add_workflow([{"key": "a", "handler": STEP, "after": ["a"]}])
    with pytest.raises(InputError, match="at least one task"):
        queue.add_workflow([])
    assert queue.store.Task.select().count() == 0


@pytest.mark.timeout(400)
def test_fan_out_and_fan_in_of_10000_tasks_in_set_based_inserts(database):
    """10,000 tasks and a report over their results, added in one transaction with
    multi-row INSERTs (not one statement per task: counted), the report released by the
    last of them and reading their results in pages."""
    queue = database.queue()
    n = 10000 if database.backend != "mysql" else 2000     # MySQL inserts tasks row by row
    statements = []
    original = queue.store.db.execute_sql

    def counting(sql, params=None, *args, **kwargs):
        statements.append(sql)
        return original(sql, params, *args, **kwargs)
    queue.store.db.execute_sql = counting
    started = time.monotonic()
    wf = queue.group([{"handler": STEP, "data": {"value": 1}} for _ in range(n)],
                     then={"handler": SUM, "queue": "reports"})
    added = time.monotonic() - started
    queue.store.db.execute_sql = original
    if database.backend != "mysql":
        assert len(statements) < n / 50, len(statements)
    Task, Run = queue.store.Task, queue.store.Run
    report = wf.task_ids[-1]
    assert Task.get_by_id(report).waiting_parents == n
    # Every parent succeeds, ended as a batched runner ends them (lifecycle.end_successes).
    runner_id = liveness.register(queue.store).id
    while True:
        def batch():
            claimed = lifecycle.claim_many(queue.store, runner_id, ["default"], utcnow(), 500)
            if claimed:
                lifecycle.end_successes(queue.store, runner_id, [
                    (c.run_id, c.task_id, "1", utcnow(), None) for c in claimed])
            return len(claimed)
        if not queue.store.write(batch):
            break
    assert Run.select().where(Run.task_id == report).count() == 1
    queue.run_pending()
    assert queue.get_task(report).results == {"sum": n, "parents": n}
    assert Run.select().where(Run.task_id == report).count() == 1
    print("added %d tasks in %.2fs" % (n + 1, added))
    queue.close()


@pytest.mark.timeout(240)
def test_eight_runner_processes_release_every_dependent_once_and_never_early(database, procs,
                                                                              tmp_path):
    """Rule 10 under 8 concurrent runner processes: chains, a fan-out with a fan-in, and
    tasks added after running ones while the runners work. No dependent starts before all
    its parents finished successfully (database times), none runs twice, none is forgotten."""
    queue = database.queue()
    log = str(tmp_path / "records")
    step = {"handler": STEP, "data": {"log": log, "sleep": 0.01}}
    chains = [queue.chain(*[step] * 4) for _ in range(10)]
    fan = queue.group([step] * 30, then=SUM)
    config = database.write_config(tmp_path / "c.toml",
                                   "[runner]\nlimit = 8\npoll_interval = 0.2\n")
    for _ in range(8):
        procs.spawn("runner", config=config, name="runner")
    rng = random.Random(os.getpid())
    existing = [t for wf in chains for t in wf.task_ids] + fan.task_ids
    late = []
    for _ in range(40):          # after whatever state their parents are in now
        parents = rng.sample(existing, rng.randint(1, 3))
        late.append(queue.add_task(STEP, {"log": log}, after=parents))
        existing.append(late[-1])
    Task, Run, Dependency = queue.store.Task, queue.store.Run, queue.store.Dependency
    wait_for(lambda: not Task.select().where(Task.finished_on.is_null()).exists(),
             timeout=180, interval=0.2, message="every task to end")
    tasks = list(Task.select(Task.id, Task.last_status))
    assert {t.last_status for t in tasks} == {SUCCESS}, procs.logs()
    runs = {}
    for run in Run.select():
        runs.setdefault(run.task_id, []).append(run)
    twice = {t: [(r.status, r.error_code, r.error_message) for r in rs]
             for t, rs in runs.items() if len(rs) != 1 or rs[0].status != SUCCESS}
    assert not twice, (twice, procs.logs())
    assert set(runs) == {t.id for t in tasks}, "a task never ran"
    # The order of the records (appended): a dependent starts after each parent ended.
    lines = [line.split() for line in open(log)]
    started = {int(task): at for at, (word, task, _) in enumerate(lines) if word == "start"}
    ended = {int(task): at for at, (word, task, _) in enumerate(lines) if word == "end"}
    assert len(started) == len([x for x in lines if x[0] == "start"]), "a handler ran twice"
    for edge in Dependency.select():
        assert edge.satisfied
        # The fan-in (Sum) records nothing, as a child or as a parent of a late task.
        if edge.task_id in started and edge.parent_id in ended:
            assert ended[edge.parent_id] < started[edge.task_id], (edge.task_id,
                                                                   edge.parent_id)
    assert queue.get_task(fan.task_ids[-1]).results == {"sum": sum(fan.task_ids[:-1]),
                                                         "parents": 30}
    queue.close()


def test_cli_add_after_and_workflow_show_and_cancel(database):
    from conftest import taskrunner, usage_error
    import json
    queue = database.queue()
    wf = queue.chain(STEP, STEP)
    first, second = wf.task_ids
    result = taskrunner("add", STEP, "--after", "%d,%d" % (first, second),
                        "--on-parent-failure", "run", url=database.url)
    assert result.returncode == 0, result.stderr
    third = int(result.stdout)
    assert queue.get_task(third).waiting_parents == 2
    assert queue.get_task(third).workflow_id == wf.id
    shown = json.loads(taskrunner("workflow", "show", str(wf.id), "--json",
                                  url=database.url).stdout)
    assert shown["counts"] == {"scheduled": 1, "waiting": 2} and shown["outcome"] == "running"
    assert [t["after"] for t in shown["tasks"]] == [[], [first], [first, second]]
    text = taskrunner("workflow", "show", str(wf.id), url=database.url).stdout
    assert "waiting" in text and "%d,%d" % (first, second) in text
    usage_error(taskrunner("add", STEP, "--after", "999999", url=database.url),
                "after: no task with id 999999")
    usage_error(taskrunner("workflow", "show", "999999", url=database.url),
                "no workflow with id 999999")
    usage_error(taskrunner("add", STEP, "--after", "x", url=database.url), "--after")
    cancelled = json.loads(taskrunner("workflow", "cancel", str(wf.id), "--json",
                                      url=database.url).stdout)
    assert cancelled == {"cancelled": 3, "stopping": 0, "workflow": wf.id}
    assert queue.workflow(wf.id).outcome == CANCELLED
    # With the other options of `add` (a merge once left --after on a name that no longer
    # existed: NameError on every `add --after`).
    parent = queue.add_task(STEP)
    result = taskrunner("add", STEP, "--after", str(parent), "--in", "60", "--rate-key", "k",
                        "--tenant", "acme", "--json", url=database.url)
    assert result.returncode == 0, result.stderr
    later = queue.get_task(json.loads(result.stdout)["id"])
    assert 55 < (later.scheduled_on - later.queued_on).total_seconds() <= 61
    assert later.waiting_parents == 1
    queue.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mysql"])
def test_migration_0020_keeps_history_and_old_tasks_release_nothing(backend, tmp_path):
    """A database with history at 0019's schema (or before): migrated, its tasks have no
    dependents and no workflow, finish as before, and can be parents of new tasks."""
    db = Database(backend, tmp_path, empty=True)
    try:
        store = db.store_at("0018_consecutive_crashes_and_stopping_since")
        for status in ("success", "scheduled"):
            store.db.execute_sql(
                "INSERT INTO task_queue (queued_on, scheduled_on, handler, data, priority, "
                "last_status, max_retries, runs_failed, run_count, run_timeout, updated_on) "
                "VALUES ('2026-01-01 00:00:00', '2026-01-01 00:00:00', '%s', '{}', 0, "
                "'%s', 5, 0, 1, 60, '2026-01-01 00:00:00')" % (STEP, status))
        store.db.execute_sql(
            "INSERT INTO task_runs (task_id, created_on, updated_on, attempt, active_task_id, "
            "priority, scheduled_on, status, percent_completed, queue) VALUES (2, "
            "'2026-01-01 00:00:00', '2026-01-01 00:00:00', 1, 2, 0, '2026-01-01 00:00:00', "
            "'scheduled', 0, 'default')")
        store.close()
        queue = TaskQueue(db.url, migrate=True)
        old = queue.store.Task.get_by_id(2)
        assert old.dependents == 0 and old.workflow_id is None and old.waiting_parents is None
        child = queue.add_task(STEP, after=[1, 2])
        assert queue.get_task(child).waiting_parents == 1
        queue.run_pending()
        assert queue.get_task(2).status == SUCCESS == queue.get_task(child).status
        queue.close()
    finally:
        db.drop()


def test_rotation_deletes_the_edges_and_workflows_of_the_tasks_it_deletes(queue):
    """Rotation and an operator's delete take a deleted task's edges once both of their ends
    are gone, and a workflow once none of its tasks is left; an edge whose other end is still
    kept (a failed child kept longer than its successful parent) stays with it."""
    from datetime import timedelta
    from taskrunner.runs import rotation
    Dependency, Workflow = queue.store.Dependency, queue.store.Workflow
    done = queue.chain(STEP, STEP, STEP)
    mixed = queue.add_workflow([{"key": "x", "handler": STEP},
                                {"key": "y", "handler": STEP, "data": {"fail": True},
                                 "max_retries": 1, "after": ["x"]}])
    deleted = queue.chain(STEP, STEP)
    queue.run_pending()
    assert Dependency.select().count() == 4 and Workflow.select().count() == 3
    from taskrunner.runs.rotation import delete_finished
    assert set(delete_finished(queue.store, deleted.task_ids).values()) == {None}
    assert Workflow.select().where(Workflow.id == deleted.id).count() == 0
    now = utcnow()
    rotation.rotate(queue.store, now + timedelta(days=8))     # successes go, failures stay
    x, y = mixed.task_ids
    assert [(d.parent_id, d.task_id) for d in Dependency.select()] == [(x, y)]
    assert [w.id for w in Workflow.select()] == [mixed.id]
    rotation.rotate(queue.store, now + timedelta(days=31))
    assert Dependency.select().count() == 0 and Workflow.select().count() == 0
