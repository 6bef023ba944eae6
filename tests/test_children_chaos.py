"""Children added from inside a handler, under kill -9, on each database (issue 40, "Children
exactly once from inside a handler"): a 1 -> 1,000 -> 1 graph built by a running function
task, while runners and overseers are killed -9 (SQLite: one overseer, its runners many
processes on one file; PostgreSQL: two overseers; MariaDB), as in test_workflow_chaos.

Two roots run side by side (tests/children_tasks.py):

- ``fan``: a step, then ``group(child.s(i) ...).then(collect.s()).enqueue()`` — GROUP children
  and their fan-in in one add — then ``result()`` of the fan-in, a durable wait (the root ends
  ``waiting`` as the fan-in's dependent and runs again when it has ended);
- ``fan_loop``: a step, then LOOP children enqueued one by one (``child.enqueue(i)``, each add
  its own exactly-once step), then ``results_of(handles)`` and their sum.

Besides the random kills of `Overseers.chaos`, the roots' own runners are killed -9 at chosen
points, read from the roots' log (`RootKiller`): the group's root as it starts its add (most
often inside the add's transaction) and once it has added; the loop's root a quarter and a
half of the way through its adds and after its last one. Their next attempts replay what was
recorded and go on.

Afterwards, what "held" means is `taskrunner verify`'s checker's (taskrunner/verify/checker.py),
read from the same kind of history: every task records each run's start and return, and the
fan-in its reading of its parents' results; the test records each task's enqueue (the fan-in
with its parents: the group) and what the database recorded (every run's claim and end,
every task's final state). The checker says that every task ended ``success`` once
(nothing-lost, one-success); no two runs of a task were live at once (one-live-run); no run
was started twice (claimed-once); the fan-in was released once, after every child of the
group had returned, and read them all (fan-in). Besides: each child (tag, index) is one task;
the fan-in's result has all GROUP results in order; each root's result is right; each root
recorded each add once, and the ids it recorded are the children that exist. While the tasks run, a child found twice fails the
test at once (an add replayed would otherwise go on adding, and waiting, for ever).

Scale: the issue's 1,000 for the group, 200 for the loop (each of its adds is a transaction
of its own), children of 50 ms, at most 4 runners, kills for up to 40 s: 25-40 s a database
on a shared two-core machine. TASKRUNNER_CHAOS_FULL=1: 1,000 in the loop too, children of
100 ms (a run by hand, not CI's)."""
import json
import os
import signal
import threading
import time
from collections import Counter, defaultdict

import pytest

import children_tasks as ct
from conftest import wait_for
from test_overseer import fresh_overseers, own_tasks
from taskrunner.store.models import CRASHED, RUNNING, SCHEDULED, Run, Step, Task
from taskrunner.verify import checker, history
from taskrunner.verify.session import collect

FULL = os.environ.get("TASKRUNNER_CHAOS_FULL") == "1"
GROUP, LOOP = 1000, (1000 if FULL else 200)
# Children of 50 ms: 1,200 of them keep 4 runners busy for 15 s or more, long enough for the
# chaos's kills (at least 8 runners and 2 overseers) on an idle machine.
CHILD_SLEEP = 0.1 if FULL else 0.05
OVERSEERS = {"sqlite": 1, "postgresql": 2, "mysql": 1}
CHILD, COLLECT = "children_tasks.child", "children_tasks.collect"


@pytest.fixture(params=("sqlite", "postgresql", "mysql"))
def overseers(request, tmp_path):
    with fresh_overseers(request.param, tmp_path) as group:
        yield group


class RootKiller(threading.Thread):
    """Kills -9 the runner of a root at the points of its plan, read from the roots' log:
    plan {root task id: [(kind, least index)]}, one kill each, in order, each in an attempt
    after the one killed before (a line ``kind ROOT ATTEMPT PID INDEX ...`` of a later
    attempt, its INDEX at least the one given; a runner the chaos killed first leaves the
    point to a later attempt). What it killed: `kills`, [(root, attempt, kind, index)]."""

    def __init__(self, log, plan):
        super().__init__(daemon=True)
        self.log, self.plan = log, {root: list(points) for root, points in plan.items()}
        self.kills = []
        self.done = threading.Event()
        self.killed = defaultdict(int)     # root -> the attempt last killed

    def run(self):
        offset = 0
        while not self.done.is_set() and any(self.plan.values()):
            lines, offset = ct.read_log(self.log, offset)
            for line in lines:
                points = self.plan.get(line.root)
                if not points or line.attempt <= self.killed[line.root]:
                    continue
                kind, least = points[0]
                if line.kind == kind and line.index >= least:
                    try:
                        os.kill(line.pid, signal.SIGKILL)
                    except ProcessLookupError:     # killed by the chaos meanwhile
                        continue
                    self.kills.append((line.root, line.attempt, kind, line.index))
                    points.pop(0)
                    self.killed[line.root] = line.attempt
            self.done.wait(0.01)

    def stop(self):
        self.done.set()
        self.join(10)


def children():
    """{(tag, index): [task ids]} of the children that exist."""
    found = defaultdict(list)
    for task in Task.select(Task.id, Task.data).where(Task.handler == CHILD):
        data = json.loads(task.data)
        found[(data["tag"], data["index"])].append(task.id)
    return found


def assert_no_child_twice():
    twice = {key: ids for key, ids in children().items() if len(ids) > 1}
    assert not twice, "children added more than once: %d, e.g. %s" % (
        len(twice), sorted(twice.items())[:5])


def wait_all_final_once(overseers, timeout):
    """wait_all_final, failing at once when a child exists twice."""
    def final():
        for proc in overseers.started[-1:]:
            if proc.poll() is not None:
                raise AssertionError("overseer exited %s\n%s"
                                     % (proc.returncode, overseers.log(proc)))
        assert_no_child_twice()
        return Task.select().where(Task.finished_on.is_null()).count() == 0
    wait_for(final, timeout=timeout, interval=0.5, message="every task to end")


def step_results(task_id):
    return {s.name: (json.loads(s.result), s.run_id)
            for s in Step.select().where(Step.task_id == task_id)}


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(1800 if FULL else 420)
def test_chaos_kill_9_children_added_from_a_handler_exist_once_and_the_fan_in_gets_all(
        overseers, tmp_path):
    database = overseers.database
    queue = database.queue(task={"max_retries": 100, "retry_backoff": 0})
    log = str(tmp_path / "roots")
    directory = str(tmp_path / "history")
    os.mkdir(directory)
    fan = queue.enqueue(ct.fan, GROUP, log, CHILD_SLEEP, history=directory)
    fan_loop = queue.enqueue(ct.fan_loop, LOOP, log, CHILD_SLEEP, history=directory)
    killer = RootKiller(log, {fan.id: [("adding", -1), ("added", -1)],
                              fan_loop.id: [("added", LOOP // 4), ("added", LOOP // 2),
                                            ("added", LOOP - 1)]})
    killer.start()
    config = overseers.config(limit=4, check_interval=0.5, max_retries=100,
                              heartbeat_interval=1, max_start_failures=1000)
    started = time.monotonic()
    try:
        kills, overseer_kills = overseers.chaos(config, OVERSEERS[database.backend])
        assert_no_child_twice()
        wait_all_final_once(overseers, timeout=1200 if FULL else 240)
    finally:
        killer.stop()
    elapsed = time.monotonic() - started
    assert kills >= 8 and overseer_kills >= 2, "the graph ended before the chaos had a chance"
    assert len(killer.kills) == 5, killer.kills

    # Every child once.
    found = children()
    expected = {("group", i) for i in range(GROUP)} | {("loop", i) for i in range(LOOP)}
    assert set(found) == expected, (len(found), sorted(set(expected) - set(found))[:5])
    assert all(len(ids) == 1 for ids in found.values())
    tasks = {t.id: t for t in own_tasks()}
    assert Counter(t.handler for t in tasks.values()) == {
        CHILD: GROUP + LOOP, COLLECT: 1, "children_tasks.fan": 1, "children_tasks.fan_loop": 1}
    assert all(t.waiting_parents is None for t in tasks.values())
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0
    runs = defaultdict(list)
    for r in Run.select(Run.id, Run.task_id, Run.status, Run.attempt,
                        Run.error_code).order_by(Run.id):
        runs[r.task_id].append(r)
    (fan_in,) = [t for t in tasks.values() if t.handler == COLLECT]

    # Held, as `taskrunner verify` says it. The roots' waits on their children are waits
    # inside a run, not dependencies the fan-in property describes: only the group's
    # fan-in is recorded with its parents.
    Dependency = queue.store.Dependency
    parents = [d.parent_id for d in Dependency.select().where(Dependency.task_id == fan_in.id)]
    assert sorted(parents) == sorted(found[("group", i)][0] for i in range(GROUP))
    for task in tasks.values():
        is_fan_in = task.id == fan_in.id
        history.record(directory, "enqueue", task=task.id, shape=task.handler,
                       parents=parents if is_fan_in else [], reads=is_fan_in)
    collect(queue.store, directory, list(tasks), effects=False)
    results = checker.check(history.read(directory))
    assert checker.held(results), "\n".join(r.line() for r in results)

    # The fan-in's result has every result of the group in order; the roots' results.
    group_results = [1000 + i for i in range(GROUP)]
    expected_fan_in = {"tag": "group", "count": GROUP, "sum": sum(group_results),
                       "results": group_results}
    assert queue.get_task(fan_in.id).results == expected_fan_in
    assert fan.result(timeout=5) == expected_fan_in
    assert fan_loop.result(timeout=5) == {"count": LOOP, "sum": sum(5000 + i for i in range(
        LOOP)), "first": 5000, "last": 5000 + LOOP - 1}

    # Each add recorded once, and what it recorded is what exists.
    steps = step_results(fan.id)
    (workflow,) = [name for name in steps if name.startswith("add:workflow:")]
    assert set(steps) == {"base", workflow, "join-1"}
    ids, group_adder = steps[workflow]
    assert ids[1:] == [found[("group", i)][0] for i in range(GROUP)] + [fan_in.id]
    steps = step_results(fan_loop.id)
    # One step per child, named by the function and a digest of its arguments.
    adds = [name for name in steps if name.startswith("add:%s:" % CHILD)]
    assert set(steps) == {"base", "join-1"} | set(adds) and len(adds) == LOOP
    assert sorted(steps[name][0][0] for name in adds) == sorted(
        found[("loop", i)][0] for i in range(LOOP))
    # The loop's adds were made by several attempts (its runner killed in the middle), and
    # each root ran again after a crash.
    adders = [steps[name][1] for name in adds]
    assert len(set(adders)) >= 3, Counter(adders)
    for root in (fan.id, fan_loop.id):
        assert any(r.error_code == CRASHED for r in runs[root]), \
            [(r.attempt, r.status, r.error_code) for r in runs[root]]

    crashed = sum(1 for r in sum(runs.values(), []) if r.error_code == CRASHED)
    (adder,) = [r.attempt for r in runs[fan.id] if r.id == group_adder]
    lines, _ = ct.read_log(log)
    at = {(line.kind, line.attempt): line.at for line in lines if line.root == fan.id}
    print("backend %s: %d tasks, %d runner kills (+%d of the roots: %s), %d overseer kills, "
          "%d runs crashed, root attempts %d and %d; the group added by attempt %d in %.2fs, "
          "the loop's adds by %d attempts; %.1fs\n%s"
          % (database.backend, len(tasks), kills, len(killer.kills), killer.kills,
             overseer_kills, crashed, len(runs[fan.id]), len(runs[fan_loop.id]), adder,
             at[("added", adder)] - at[("adding", adder)], len(set(adders)), elapsed,
             "\n".join(r.line() for r in results)))
    queue.close()
