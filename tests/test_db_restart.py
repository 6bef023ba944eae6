"""Database restarts ridden out, on real servers the tests create and remove: a throwaway
PostgreSQL cluster (fast restart, immediate restart, a 45 s outage) and a throwaway MariaDB
instance (kill -9, then started again on the same data directory).

A real overseer with three runners works through a stream of tasks whose handler reports
progress all along; the server goes away under it. Measured for each scenario, printed as
one "figures" line and asserted:

- runner crashes: runner processes that exited, runner rows marked dead, RunnerDied runs,
  Task.crash_count — all 0;
- handler-visible database errors: runs that ended other than success, exceptions that
  reached the handler — 0;
- lost or duplicated work: every task succeeds, and its handler started exactly once. No
  duplicate is allowed, not even for the runs in flight at the outage: their handlers finish,
  and their outcome is written once the server is back. (A claim whose commit the client
  never saw is given back and shows as a ``requeued`` run whose handler never started.)
- time to resume: from the server accepting connections again to the next handler start —
  under 2 s (plus slack for this shared machine, see MACHINE_SLACK);
- progress reported during the outage is written when the server is back (every run ends
  at 100 %).

With TASKRUNNER_FIGURES=FILE each scenario's figures are also appended to FILE as a JSON line
(bench/results/*-db-restart.json were made that way).

Needs root (or the tools runnable as the current user): pg_createcluster/pg_ctlcluster and
mariadb-install-db/mariadbd. Skipped where they are missing, except in CI, where that fails.
"""
import json
import os
import signal
import subprocess
import time
import warnings

import pytest

from taskrunner import TaskQueue
from taskrunner.store.models import RUNNER, SUCCESS, TIMEOUT

from conftest import START_TIMEOUT, databases_required, spawn, wait_for
from servers import MariaDBInstance, PostgresCluster, ServerMissing
from test_overseer import children_of

RESUME_LIMIT = 2.0
# The figure itself is printed and reported; the assertion allows for a shared two-core
# machine where a runner may not be scheduled for a while after the server is back.
RESUME_SLACK = 1.0
TASKS = 30
RUNNERS = 3


# -- servers ------------------------------------------------------------------------------

def _missing(reason):
    if databases_required():
        pytest.fail(reason + " (required in CI)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def pg_cluster():
    try:
        cluster = PostgresCluster()
    except ServerMissing as exc:
        _missing(str(exc))
    try:
        yield cluster
    finally:
        cluster.drop()


@pytest.fixture(scope="module")
def mariadb(tmp_path_factory):
    try:
        instance = MariaDBInstance(tmp_path_factory.mktemp("mariadb"))
    except ServerMissing as exc:
        _missing(str(exc))
    try:
        yield instance
    finally:
        instance.remove()


# -- the work and what is measured ---------------------------------------------------------

def events(log):
    """Lines of sample_handlers.Steady: [(kind, task, run, pid, monotonic, rest)]."""
    try:
        with open(log) as fh:
            lines = [line.split() for line in fh if line.strip()]
    except FileNotFoundError:
        return []
    return [(k, int(t), int(r), int(p), float(m), rest) for k, t, r, p, m, *rest in lines]


class Scene:
    """An overseer with RUNNERS runners working through TASKS Steady tasks on `url`."""

    def __init__(self, url, tmp_path, heartbeat_timeout=5, run_timeout=30, seconds=0.5):
        self.url = url
        self.tmp_path = tmp_path
        self.log = str(tmp_path / "steady")
        queue = TaskQueue(url, migrate=True)
        self.task_ids = queue.add_tasks([
            {"handler": "sample_handlers.Steady", "run_timeout": run_timeout,
             "data": {"log": self.log, "seconds": seconds, "step": 0.05}}
            for _ in range(TASKS)])
        queue.close()
        config = tmp_path / "restart.toml"
        config.write_text(
            '[database]\nurl = "%s"\n[runner]\nlimit = %d\npoll_interval = 0.2\n'
            'heartbeat_interval = 0.5\n[overseer]\ncheck_interval = 0.5\nheartbeat_timeout = %s\n'
            'kill_grace = 2\ngraceful_timeout = 20\n[task]\nretry_backoff = 0\nmax_retries = 1\n'
            % (url, RUNNERS, heartbeat_timeout))
        self.overseer_log = tmp_path / "overseer.log"
        self.overseer = spawn("overseer", config=str(config), log_path=self.overseer_log)
        self.runner_pids = None

    def logs(self):
        return self.overseer_log.read_text(errors="replace")[-6000:] \
            if self.overseer_log.exists() else ""

    def runners(self):
        return sorted(kid.pid for kid in children_of(self.overseer.pid))

    def wait_working(self):
        """Runners up and handlers at work; the runners' PIDs are noted."""
        def working():
            if self.overseer.poll() is not None:
                raise AssertionError("overseer exited\n" + self.logs())
            return len(self.runners()) == RUNNERS and \
                len([e for e in events(self.log) if e[0] == "start"]) >= RUNNERS + 1
        wait_for(working, timeout=START_TIMEOUT, message="the runners to be at work")
        self.runner_pids = self.runners()

    def assert_alive(self):
        assert self.overseer.poll() is None, "overseer exited\n" + self.logs()
        assert self.runners() == self.runner_pids, "a runner exited\n" + self.logs()

    def outage(self, go_down, come_back, accepts, hold=0.0):
        """go_down() stops the server (or starts a restart); after `hold` seconds more of
        outage, come_back() (may be None: a restart comes back by itself). Returns the
        monotonic times the server refused a connection first and accepted one again."""
        self.began = time.monotonic()           # the server starts to go away
        go_down()
        wait_for(lambda: not accepts(), timeout=30, interval=0.02, message="the server down")
        down = time.monotonic()
        until = down + hold
        while time.monotonic() < until:         # the outage itself: its length is the point
            self.assert_alive()
            time.sleep(min(1.0, max(0.0, until - time.monotonic())))
        if come_back is not None:
            come_back()
        wait_for(accepts, timeout=60, interval=0.02, message="the server back")
        return down, time.monotonic()

    def finish(self, down, ready, scenario):
        """Wait for every task to end, stop the overseer; measure, print and return the
        figures."""
        def first_start_after():
            return [e[4] for e in events(self.log) if e[0] == "start" and e[4] > ready]
        wait_for(first_start_after, timeout=60, interval=0.02,
                 message="a run to start after the server came back")
        resume = min(first_start_after()) - ready
        queue = TaskQueue(self.url)
        store = queue.store
        Task, Run, Runner = store.Task, store.Run, store.Runner

        def all_ended():
            self.assert_alive()
            return Task.select().where(Task.finished_on.is_null()).count() == 0
        wait_for(all_ended, timeout=90, interval=0.2, message="every task to end")
        exited = sorted(set(self.runner_pids) - set(self.runners()))
        self.overseer.send_signal(signal.SIGTERM)
        code = self.overseer.wait(timeout=60)
        runs = list(Run.select())
        seen = events(self.log)
        starts = {}
        for kind, task, _, _, _, _ in seen:
            if kind == "start":
                starts[task] = starts.get(task, 0) + 1
        log = self.logs()
        figures = {
            "scenario": scenario,
            "outage_s": round(ready - down, 2),
            "resume_s": round(resume, 3),
            # Handlers that were running when the server began to go away (a stop under
            # load can take longer than a run: counted from its end, none would be left).
            "in_flight": len([s for s in seen if s[0] == "start" and s[4] < self.began and any(
                e[0] == "end" and e[2] == s[2] and e[4] > self.began for e in seen)]),
            "runner_exits": len(exited),
            "runners_marked_dead": Runner.select().where(
                (Runner.kind == RUNNER) & (Runner.status == TIMEOUT)).count(),
            "crash_count": sum(t.crash_count for t in Task.select()),
            "handler_db_errors": len([e for e in seen if e[0] == "raised"]),
            "runs_not_success": sorted({(r.status, r.error_code) for r in runs
                                        if r.status != SUCCESS}),
            "tasks_not_success": Task.select().where(Task.last_status != SUCCESS).count(),
            "duplicate_executions": sum(n - 1 for n in starts.values() if n > 1),
            "tasks_never_started": len(set(self.task_ids) - set(starts)),
            "progress_deferred": self.overseer_log.read_text(errors="replace").count(
                "not stored"),                  # the whole log: logs() keeps only its end
            "progress_not_100": len([r for r in runs if r.status == SUCCESS
                                     and r.percent_completed != 100]),
            "overseer_exit": code,
        }
        queue.close()
        print("figures %s" % json.dumps(figures))
        if os.environ.get("TASKRUNNER_FIGURES"):       # a JSON line per scenario, appended
            with open(os.environ["TASKRUNNER_FIGURES"], "a") as fh:
                fh.write(json.dumps(figures) + "\n")
        return figures, log

    def kill(self):
        for pid in [self.overseer.pid] + list(self.runner_pids or ()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.overseer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def assert_ridden_out(figures, log):
    where = "%s\n%s" % (json.dumps(figures), log)
    assert figures["overseer_exit"] == 0, where
    assert (figures["runner_exits"], figures["runners_marked_dead"], figures["crash_count"]) \
        == (0, 0, 0), where
    assert figures["handler_db_errors"] == 0, where
    # Allowed: a claim given back unstarted after the connection dropped during its commit.
    assert all(status == "requeued" for status, _ in figures["runs_not_success"]), where
    assert (figures["tasks_not_success"], figures["duplicate_executions"],
            figures["tasks_never_started"]) == (0, 0, 0), where
    assert figures["progress_not_100"] == 0, where
    assert figures["in_flight"] >= 1, "no run was in flight at the outage: " + where
    # Progress reported during the outage is deferred and written later (or dropped), never
    # raised: the handler errors above are the proof. Whether a report fell inside a short
    # outage depends on timing (seen once with a 1.3 s MariaDB outage and one run in flight),
    # so the figure is reported, not required.
    if figures["progress_deferred"] == 0:
        warnings.warn("no progress was reported during the outage: " + where)
    assert figures["resume_s"] <= RESUME_LIMIT + RESUME_SLACK, where


@pytest.fixture
def scenes():
    started = []
    yield started
    for scene in started:
        scene.kill()


# -- PostgreSQL -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgresql_restart_is_ridden_out(mode, pg_cluster, scenes, tmp_path):
    """`pg_ctlcluster restart -m fast` (sessions ended with 57P01) and `-m immediate`
    (no goodbye; crash recovery at start) while runs are in flight and reporting progress."""
    scene = Scene(pg_cluster.new_database(), tmp_path)
    scenes.append(scene)
    scene.wait_working()
    restart = []
    down, ready = scene.outage(
        lambda: restart.append(pg_cluster.ctl_in_background("restart", "-m", mode)),
        None, pg_cluster.accepts)
    restart[0].wait(timeout=60)
    figures, log = scene.finish(down, ready, "postgresql restart -m %s" % mode)
    assert_ridden_out(figures, log)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_postgresql_45_second_outage_longer_than_heartbeat_timeout(pg_cluster, scenes, tmp_path):
    """Stopped for 45 s, longer than heartbeat_timeout (10 s) and the tasks' run_timeout
    (20 s): nobody could write a heartbeat or progress, so nobody is declared dead or timed
    out for that when the server is back; the runners wait and carry on."""
    scene = Scene(pg_cluster.new_database(), tmp_path, heartbeat_timeout=10, run_timeout=20)
    scenes.append(scene)
    scene.wait_working()
    start = []
    down, ready = scene.outage(lambda: pg_cluster.ctl("stop", "-m", "fast"),
                               lambda: start.append(pg_cluster.ctl_in_background("start")),
                               pg_cluster.accepts, hold=45)
    start[0].wait(timeout=60)
    figures, log = scene.finish(down, ready, "postgresql 45 s outage")
    assert figures["outage_s"] >= 45
    assert_ridden_out(figures, log)


# -- MariaDB --------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_mariadb_kill_9_and_restart_is_ridden_out(mariadb, scenes, tmp_path):
    """mariadbd killed with SIGKILL mid-work (no goodbye to the clients, InnoDB recovery at
    start), started again on the same data directory."""
    scene = Scene(mariadb.new_database(), tmp_path)
    scenes.append(scene)
    scene.wait_working()
    down, ready = scene.outage(mariadb.kill9, mariadb.start, mariadb.accepts, hold=1.0)
    figures, log = scene.finish(down, ready, "mariadb kill -9 + start")
    assert_ridden_out(figures, log)
