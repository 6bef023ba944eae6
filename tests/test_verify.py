"""`taskrunner verify` (issue 45): the checker reads only a history and reports, per
property, its counts and the first counter-example; the unmutated build passes on every
database; defects seeded into a copy of the claim and end statements (tests/verify_mutants,
a sitecustomize put on PYTHONPATH of the verify process and the runners it starts) are
reported, on SQLite and PostgreSQL; a SQLite deployment that gives up the promise is refused
up front with one line naming the setting."""
import json
import os
import shlex
from datetime import datetime, timedelta

import pytest

from conftest import REPO_DIR, TESTS_DIR, Database, taskrunner
from taskrunner.config import Config
from taskrunner.fleet import liveness
from taskrunner.periodic.scheduler import PeriodicScheduler, add_periodic
from taskrunner.runs import lifecycle, sql
from taskrunner.store.models import SUCCESS
from taskrunner.verify import checker
from taskrunner.verify.session import mount_of, preflight
from taskrunner.errors import InputError

MUTANTS = os.path.join(TESTS_DIR, "verify_mutants")


# -- the checker, on histories written by hand -------------------------------------------------

def at(second):
    return "2026-01-01T00:00:%06.3f+00:00" % second


def db(second):
    return "2026-01-01 00:00:%06.3f" % second


def clean_history():
    """Task 1 plain, run 10; task 2 after task 1 (fan-in of one, read it); task 3 a step."""
    return [
        {"kind": "enqueue", "task": 1, "shape": "plain"},
        {"kind": "enqueue", "task": 2, "shape": "fan-in", "parents": [1], "reads": True},
        {"kind": "enqueue", "task": 3, "shape": "steps", "steps": 1},
        {"kind": "start", "task": 1, "run": 10, "pid": 7, "at": at(1)},
        {"kind": "done", "task": 1, "run": 10, "pid": 7, "at": at(2)},
        {"kind": "start", "task": 2, "run": 20, "pid": 8, "at": at(3)},
        {"kind": "fanin", "task": 2, "run": 20, "pid": 8, "at": at(3.5), "parents": 1},
        {"kind": "done", "task": 2, "run": 20, "pid": 8, "at": at(4)},
        {"kind": "start", "task": 3, "run": 30, "pid": 7, "at": at(5)},
        {"kind": "exec", "task": 3, "run": 30, "pid": 7, "at": at(5.1), "step": "s0"},
        {"kind": "step", "task": 3, "run": 30, "pid": 7, "at": at(5.2), "step": "s0"},
        {"kind": "done", "task": 3, "run": 30, "pid": 7, "at": at(5.3)},
        {"kind": "end", "task": 1, "run": 10, "attempt": 1, "status": "success",
         "started": db(1), "finished": db(2)},
        {"kind": "end", "task": 2, "run": 20, "attempt": 1, "status": "success",
         "started": db(3), "finished": db(4)},
        {"kind": "end", "task": 3, "run": 30, "attempt": 1, "status": "success",
         "started": db(5), "finished": db(5.3)},
        {"kind": "effect", "task": 3, "step": "s0", "count": 1},
        {"kind": "final", "task": 1, "status": "success"},
        {"kind": "final", "task": 2, "status": "success"},
        {"kind": "final", "task": 3, "status": "success"},
    ]


def periodic_history(finished=11.5, next_start=None):
    """Periodic task p, every 1 s from 10; two schedulers whose last passes were at 12.2 and
    12.5 (due times 10, 11, 12 were theirs); task 40 due at 10, run 400 by pid 9, which
    returned from it at `finished` and started its next run at `next_start` (None: it started
    none); task 41 due at 12. Task 40 finished at 11.5 was unfinished at 11: that due time
    skipped."""
    events = [
        {"kind": "periodic", "name": "p", "every": 1, "first": db(10)},
        {"kind": "pass", "pid": 7, "now": db(12.5)},
        {"kind": "pass", "pid": 8, "now": db(12.2)},
        {"kind": "instance", "periodic": "p", "task": 40, "scheduled": db(10),
         "created": db(10.01), "finished": db(finished)},
        {"kind": "instance", "periodic": "p", "task": 41, "scheduled": db(12),
         "created": db(12.01), "finished": db(12.05)},
        {"kind": "start", "task": 40, "run": 400, "pid": 9, "at": at(10.05),
         "db_at": db(10.05)},
        {"kind": "done", "task": 40, "run": 400, "pid": 9, "at": at(finished),
         "db_at": db(finished)},
        {"kind": "end", "task": 40, "run": 400, "attempt": 1, "status": "success",
         "started": db(10.05), "finished": db(finished)},
    ]
    if next_start is not None:
        events.append({"kind": "start", "task": 43, "run": 430, "pid": 9, "at": at(next_start),
                       "db_at": db(next_start)})
    return events


def failed(results):
    return {r.name: r.example for r in results if not r.held}


def test_checker_passes_a_clean_history_with_one_line_per_property():
    results = checker.check(clean_history())
    assert [r.name for r in results] == list(checker.PROPERTIES)
    assert failed(results) == {}
    assert results[0].line() == "ok   one-success: 3 tasks, 3 successful runs"


@pytest.mark.parametrize("name, change, example", [
    ("one-success", [{"kind": "end", "task": 1, "run": 11, "attempt": 2, "status": "success",
                      "started": db(2.5), "finished": db(2.6)}],
     "task 1 has 2 runs ended success: 10, 11"),
    ("one-live-run", [{"kind": "end", "task": 1, "run": 11, "attempt": 2, "status": "timeout",
                       "started": db(1.5), "finished": db(2.6)}],
     "task 1: run 11 claimed at 2026-01-01 00:00:01.500000 while run 10 was live"),
    ("claimed-once", [{"kind": "start", "task": 1, "run": 10, "pid": 9, "at": at(2.5)}],
     "run 10 (task 1) started by pid 9 after pid 7 had returned from it"),
    ("claimed-once", [{"kind": "start", "task": 1, "run": 10, "pid": 9, "at": at(1.5)}],
     "run 10 (task 1) started by pid 9 while pid 7 executed it"),
    ("steps-once", [{"kind": "exec", "task": 3, "run": 31, "pid": 9, "at": at(6),
                     "step": "s0"}],
     "task 3 step s0 executed again (pid 9, run 31) after its record committed (pid 7, "
     "run 30)"),
    ("steps-once", [{"kind": "effect", "task": 3, "step": "s0", "count": 1}],
     "task 3 step s0: 2 application rows written in its transaction, not 1"),
    ("fan-in", [{"kind": "start", "task": 2, "run": 19, "pid": 9, "at": at(1.8)}],
     "task 2 started at 2026-01-01 00:00:01.800000 before its parent 1 returned"),
    ("fan-in", [{"kind": "end", "task": 2, "run": 21, "attempt": 1, "status": "cancelled"}],
     "task 2 released 2 times (runs [20, 21] of attempt 1)"),
    ("nothing-lost", [{"kind": "enqueue", "task": 4, "shape": "plain"}],
     "task 4 (plain) ended nowhere: it is missing, not success"),
])
def test_checker_reports_the_first_counter_example(name, change, example):
    events = clean_history() + change
    if change[0]["kind"] == "effect":          # the step's row written twice
        events = [e for e in events if e["kind"] != "effect"] + [dict(change[0], count=2)]
    results = failed(checker.check(events))
    assert name in results, results
    assert results[name].startswith(example), results[name]


def test_checker_reports_a_periodic_due_time_with_two_tasks_or_none():
    clean = checker.check(clean_history() + periodic_history())
    assert failed(clean) == {}
    assert clean[-1].line() == ("ok   periodic-once: 1 periodic tasks, 3 due times, 2 tasks, "
                                "1 skipped, 2 passes")
    twice = failed(checker.check(periodic_history() + [
        {"kind": "instance", "periodic": "p", "task": 42, "scheduled": db(12),
         "created": db(12.02), "finished": db(12.1)}]))
    assert twice == {"periodic-once": "periodic task p: its due time 2026-01-01 00:00:12 "
                                      "yielded 2 tasks: 41, 42"}
    # Task 40's end committed before 11: its runner started its next run at 10.6.
    missed = failed(checker.check(periodic_history(finished=10.5, next_start=10.6)))
    assert missed == {"periodic-once": "periodic task p: its due time 2026-01-01 00:00:11 "
                                       "yielded no task, though its previous task 40 (due "
                                       "2026-01-01 00:00:10) had finished at 2026-01-01 "
                                       "00:00:10.500, its end committed by 2026-01-01 "
                                       "00:00:10.600000"}
    # Created after the due time that has no task: a late pass's catch-up once.
    late = periodic_history(finished=10.5, next_start=10.6)
    late[3]["created"] = db(11.2)
    assert failed(checker.check(late)) == {}


def test_checker_skips_a_due_time_while_the_previous_tasks_end_has_not_committed():
    """The counter-example of a loaded SQLite session: task 40's handler returned at 10.5,
    the time its end stamped, but the end's transaction waited for the database's lock and
    the pass at 11 went first — task 40 was unfinished there, and rule 9 skipped 11. Its
    end committed before its runner started its next run, at 11.3; with no next run, its
    commit is bounded by nothing."""
    for next_start in (11.3, None):
        results = checker.check(periodic_history(finished=10.5, next_start=next_start))
        assert failed(results) == {}, next_start
        assert results[-1].counts["skipped"] == 1


def test_a_due_time_the_scheduler_skipped_before_the_previous_tasks_end_committed_holds(queue):
    """Driven with chosen times, on each database: the scheduler submits task X at due time
    D; X's handler returns at D + 0.5, the time its end stamps as finished_on, but the pass
    at D + 1 goes before that end's transaction — X is unfinished there, so rule 9 skips
    D + 1 — and the end commits after it. The history the session would record (X's runner
    starts its next run once the end has committed) holds periodic-once."""
    store = queue.store
    t0 = datetime(2024, 1, 1, 12, 0, 0)
    add_periodic(store, "p", "taskrunner.handlers.Echo", "every 1s", queue="periodic", now=t0)
    due = t0 + timedelta(seconds=1)
    scheduler = PeriodicScheduler(store)
    [task] = scheduler.run_pending(now=due)["submitted"]
    runner = liveness.register(store)
    claimed = lifecycle.claim(store, runner.id, ("periodic",), now=due + timedelta(seconds=0.1))
    returned = due + timedelta(seconds=0.5)
    assert scheduler.run_pending(now=due + timedelta(seconds=1)) == {"submitted": [],
                                                                     "skipped": ["p"]}
    assert lifecycle.end_run(store, claimed.run_id, task, SUCCESS, runner.id, now=returned,
                             periodic_task_id=claimed.periodic_task_id)
    [following] = scheduler.run_pending(now=due + timedelta(seconds=2))["submitted"]

    Task = store.Task
    rows = {t.id: t for t in Task.select().where(Task.id.in_([task, following]))}
    assert rows[task].finished_on == returned < due + timedelta(seconds=1)
    assert rows[following].scheduled_on == due + timedelta(seconds=2)

    def iso(value):       # a history's own time: this host's, with its zone
        return value.isoformat() + "+00:00"
    events = [{"kind": "periodic", "name": "p", "every": 1, "first": str(due)}]
    events += [{"kind": "pass", "pid": 1, "now": str(due + timedelta(seconds=k))}
               for k in (0, 1, 2)]
    events += [{"kind": "instance", "periodic": "p", "task": t.id,
                "scheduled": str(t.scheduled_on), "created": str(t.queued_on),
                "finished": t.finished_on and str(t.finished_on)} for t in rows.values()]
    events += [{"kind": "end", "task": task, "run": claimed.run_id, "attempt": 1,
                "status": SUCCESS, "started": str(claimed.started_on), "finished": str(returned)},
               {"kind": "start", "task": task, "run": claimed.run_id, "pid": 9,
                "at": iso(claimed.started_on), "db_at": str(claimed.started_on)},
               {"kind": "done", "task": task, "run": claimed.run_id, "pid": 9,
                "at": iso(returned), "db_at": str(returned)},
               {"kind": "start", "task": 99, "run": 990, "pid": 9,
                "at": iso(due + timedelta(seconds=1.3)),
                "db_at": str(due + timedelta(seconds=1.3))}]
    results = checker.check(events)
    assert failed(results) == {}
    assert results[-1].counts == {"periodic tasks": 1, "due times": 3, "tasks": 2,
                                  "skipped": 1, "passes": 3}


def test_checker_holds_concurrency_and_rate_windows():
    events = [{"kind": "limit", "what": "concurrency", "key": "k", "limit": 1},
              {"kind": "limit", "what": "rate", "key": "q", "rate": 1.0, "burst": 1}]
    for task in (1, 2):
        events.append({"kind": "enqueue", "task": task, "shape": "concurrency",
                       "concurrency_key": "k", "key": "k"})
    for task in (3, 4, 5, 6):
        events.append({"kind": "enqueue", "task": task, "shape": "rate", "queue": "q"})
    ends = [(1, db(1), db(3)), (2, db(2), db(4))] + [(t, db(10 + t / 100), db(11))
                                                     for t in (3, 4, 5, 6)]
    events += [{"kind": "end", "task": t, "run": t, "attempt": 1, "status": "success",
                "started": s, "finished": f} for t, s, f in ends]
    results = failed(checker.check(events))
    assert results["concurrency-key"].startswith("key k: 2 runs live at 2026-01-01 00:00:02")
    assert results["rate-window"].startswith("queue q: 3 runs claimed between")


# -- the verify command, on each database ------------------------------------------------------

def verify(database, tmp_path, *options, mutant=None, timeout=240):
    env = {"PYTHONPATH": os.pathsep.join([MUTANTS, TESTS_DIR, REPO_DIR,
                                          os.environ.get("PYTHONPATH", "")])}
    if mutant:
        env["TASKRUNNER_VERIFY_MUTANT"] = mutant
    os.makedirs(str(tmp_path), exist_ok=True)
    result = taskrunner("verify", "--json", "--history", str(tmp_path), *options,
                        url=database.url, env=env, timeout=timeout)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    return result.returncode, {p["property"]: p for p in report["properties"]}, report


def snapshot(store, task_ids):
    """What verify must leave as it was: the tasks, their runs, the runners."""
    Task, Run, Runner = store.Task, store.Run, store.Runner
    return ([tuple(t.__data__.items()) for t in Task.select().where(Task.id.in_(task_ids))],
            [tuple(r.__data__.items()) for r in Run.select().where(Run.task_id.in_(task_ids))],
            [(r.id, r.status) for r in Runner.select()])


@pytest.mark.slow
def test_verify_of_the_unmutated_build_holds_every_property(database, tmp_path):
    # The application's own: a task waiting on another queue, a run of the default queue,
    # running under another host's runner, overdue by an hour, and a periodic task due every
    # second. Verify times out, claims, sweeps, schedules none of them: they are the fleet's.
    other = database.queue(runner={"host_id": "elsewhere"})
    store = other.store
    waiting = other.add_task("taskrunner.handlers.Echo", {"n": 1}, queue="emails")
    overdue = other.add_task("taskrunner.handlers.Echo", {"n": 2}, run_timeout=1)
    row = liveness.register(store)
    at = store.database_time()
    assert [c[1] for c in store.write(lambda: sql.claim(store, row.id, "default", at))] \
        == [overdue]
    store.Run.update(updated_on=at - timedelta(hours=1)).where(
        store.Run.task_id == overdue).execute()
    mine = add_periodic(store, "mine", "taskrunner.handlers.Echo", "every 1s", queue="emails")
    before = snapshot(store, [waiting, overdue])
    periodic_before = [r.__data__ for r in store.PeriodicTask.select()]

    code, properties, report = verify(database, tmp_path, "--duration", "5", "--workers", "3",
                                      "--faults", "kill,stop")
    assert code == 0, [p for p in properties.values() if not p["held"]]
    after = snapshot(store, [waiting, overdue])
    assert [dict(t) for t in after[0]] == [dict(t) for t in before[0]]
    assert [dict(r) for r in after[1]] == [dict(r) for r in before[1]]
    assert set(before[2]) <= set(after[2])
    assert [r.__data__ for r in store.PeriodicTask.select()] == periodic_before
    assert store.Task.select().where(store.Task.periodic_task_id == mine.id).count() == 0
    other.close()
    # Enough work to have met the faults: how much fits in 5 s depends on the machine's load
    # (14-23 tasks at load 30, more than 30 when quiet).
    assert report["ok"] and report["happened"]["tasks"] > 10
    assert properties["nothing-lost"]["counts"]["succeeded"] == report["happened"]["tasks"]
    assert properties["steps-once"]["counts"]["application rows"] > 0
    assert properties["fan-in"]["counts"]["dependents"] > 0
    assert properties["periodic-once"]["counts"]["tasks"] > 0


# Each seeded defect and the properties that report it (any of them).
MUTANT_REPORTS = {
    # A finished run is claimed again and its handler runs a second time.
    "claim-no-status-guard": ("claimed-once",),
    # A runner stopped past its run's timeout comes back and ends the run success over the
    # timeout, though the task ran again meanwhile: two successes, overlapping live runs.
    "end-no-runner-check": ("one-success", "one-live-run"),
    # A fan-in is released at its first parent's success.
    "release-no-parent-count": ("fan-in",),
    # PostgreSQL: two claimers read the same candidate and both take it.
    "claim-no-row-lock": ("claimed-once",),
    # Two schedulers read the same due time, neither holding its row: both submit it.
    "periodic-take-unlocked": ("periodic-once",),
}
# SQLite has no row lock to leave out: its claim holds the write lock from its first read.
POSTGRESQL_ONLY = ("claim-no-row-lock",)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", sorted(MUTANT_REPORTS))
def test_verify_reports_a_seeded_defect(mutant, database_sp,
                                                                 tmp_path):
    if mutant in POSTGRESQL_ONLY and database_sp.backend != "postgresql":
        pytest.skip("a PostgreSQL statement's defect")
    # A defect that needs a race (two claimers on one candidate, two schedulers on one due
    # time) shows when the race happens: on a loaded machine a 10 s session may see none, so
    # up to three sessions, as a user verifies again for longer. Every session that reports
    # must name a property of the defect.
    for session in range(3):
        code, properties, _ = verify(database_sp, tmp_path / str(session), "--duration", "10",
                                     "--workers", "3", "--faults", "stop", "--drain", "10",
                                     mutant=mutant)
        if code != 0:
            break
    assert code == 1, properties
    reported = [name for name in MUTANT_REPORTS[mutant] if not properties[name]["held"]]
    assert reported, properties
    assert properties[reported[0]]["counterexample"]


def test_verify_runs_the_restart_db_command_it_was_given(tmp_path):
    """The command runs as given, without a shell (a file whose name has a space and a
    quote); the restart of a real server is left to the user's own command."""
    marker = tmp_path / "restarted it's"
    code, properties, report = verify(
        Database("sqlite", tmp_path), tmp_path / "history", "--duration", "3", "--workers",
        "2", "--faults", "restart-db", "--restart-db-command", "touch %s" % shlex.quote(
            str(marker)))
    assert code == 0 and report["happened"]["restart-db"] >= 1 and marker.exists()


# -- a deployment refused up front -------------------------------------------------------------

def test_verify_refuses_sqlite_with_synchronous_off_naming_the_setting(tmp_path):
    config = tmp_path / "taskrunner.toml"
    config.write_text('[database]\nurl = "sqlite:///%s"\nsqlite_synchronous = "off"\n'
                      % (tmp_path / "app.db"))
    result = taskrunner("verify", "--duration", "1", config=str(config))
    assert result.returncode == 2
    assert result.stderr.startswith("taskrunner: error: [database] sqlite_synchronous = off")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""


def test_verify_refuses_a_sqlite_file_on_a_network_filesystem(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/export %s nfs4 rw 0 0\n"
                      % os.path.realpath(tmp_path))
    config = Config.from_dict({"database": {"url": "sqlite:///%s" % (tmp_path / "app.db")}})
    with pytest.raises(InputError, match="is on a nfs4 filesystem"):
        preflight(config.database, str(mounts))
    assert mount_of("/srv/a b/x.db", "d /srv/a\\040b nfs rw 0 0\nr / ext4 rw 0 0") == \
        ("/srv/a b", "nfs")


def test_verify_refuses_sqlite_in_exclusive_locking_mode(tmp_path):
    from taskrunner.store.db import open_database
    config = Config.from_dict({"database": {"url": "sqlite:///%s" % (tmp_path / "app.db")}})
    db = open_database(config.database)
    db.execute_sql("PRAGMA locking_mode = EXCLUSIVE")
    with pytest.raises(InputError, match="locking_mode is exclusive"):
        preflight(config.database, db=db)
    preflight(config.database)          # the file itself is fine


@pytest.mark.parametrize("args, error", [
    (["--faults", "explode"], "unknown fault 'explode'"),
    (["--faults", "restart-db"], "--faults restart-db needs --restart-db-command"),
    (["--workers", "0"], "expected a positive integer"),
])
def test_verify_bad_input_is_one_line_exit_2(args, error, tmp_path):
    result = taskrunner("verify", *args, url="sqlite:///%s" % (tmp_path / "app.db"))
    assert result.returncode == 2 and error in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "app.db").exists()
