"""The overseer as a real process: the host limit with forked runners (rule 5), noticing
dead runners (rule 7, PID reuse included), stopping overdue runs (rule 8), the graceful
stop, HUP/TTIN/TTOU, runners outliving a killed overseer, start failures, no database
connection across fork, and a kill -9 chaos run where no task is lost (rule 6).

Each test starts `taskrunner overseer` in its own process group (conftest's `spawn`), finds
its runners as its non-zombie children (psutil), and reads the outcome from the database
and from the file the handlers append to (`sample_handlers`). Everything is polled with
`wait_for`; deadlines are generous because the machine is shared and has two cores.
"""
import contextlib
import os
import random
import signal
import subprocess
import time
from datetime import timedelta

import psutil
import pytest

from conftest import (START_TIMEOUT, Database, direct_only, runs_of, spawn, utc, wait_for,
                      wait_started)
from sample_handlers import read_records
from taskrunner.fleet import liveness
from taskrunner.fleet.liveness import boot_id, create_time
from taskrunner.fleet.liveness import default_host_id as hostname
from taskrunner.overseer.overseer import Overseer
from taskrunner.store.models import (MAINTAINER, OVERSEER, REQUEUED, RUNNER, RUNNING,
                                     SCHEDULED, SUCCESS, TIMEOUT, Run, Runner, Task, utcnow)

EXIT_TIMEOUT = 30.0
CHECK_INTERVAL = 1.0
# Rule 7 says "within about one check interval"; the tests allow two, plus this much for a
# shared two-core machine where the overseer may not be scheduled for a while and a SQLite
# write may wait for the lock (seen: load average 8 while other suites run).
MACHINE_SLACK = 3.0


# -- helpers ------------------------------------------------------------------------------

def overseer_toml(limit=3, check_interval=CHECK_INTERVAL, graceful_timeout=30, kill_grace=2,
                  max_start_failures=10, max_retries=5, extra="", heartbeat_interval=5,
                  crash_grace=0, batch=1, heartbeat_timeout=60):
    return ("[runner]\nlimit = %d\npoll_interval = 0.1\nheartbeat_interval = %s\n%s"
            "[overseer]\ncheck_interval = %s\ngraceful_timeout = %s\nkill_grace = %s\n"
            "max_start_failures = %d\ncrash_grace = %s\nheartbeat_timeout = %s\n"
            "[task]\nretry_backoff = 0\nmax_retries = %d\n%s"
            % (limit, heartbeat_interval, "batch = %d\n" % batch if batch > 1 else "",
               check_interval, graceful_timeout, kill_grace, max_start_failures, crash_grace,
               heartbeat_timeout, max_retries, extra))


class Overseers:
    """The overseers a test started. At teardown each one's process group is killed, even
    when the overseer itself is already gone (its orphaned runners stay in its group)."""

    def __init__(self, database, tmp_path):
        self.database = database
        self.tmp_path = tmp_path
        self.started = []

    def config(self, **options):
        return self.database.write_config(self.tmp_path / "c.toml", overseer_toml(**options))

    def start(self, config):
        log_path = self.tmp_path / ("overseer-%d.log" % len(self.started))
        proc = spawn("overseer", config=config, log_path=log_path)
        proc.log_path = log_path
        self.started.append(proc)
        return proc

    def log(self, proc=None):
        out = []
        for p in [proc] if proc else self.started:
            text = p.log_path.read_text(errors="replace") if p.log_path.exists() else ""
            out.append("--- overseer pid %d (exit %s):\n%s" % (p.pid, p.poll(), text[-4000:]))
        return "\n".join(out)

    def wait(self, proc, timeout=EXIT_TIMEOUT):
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("overseer %d still running after %.0fs\n%s"
                                 % (proc.pid, timeout, self.log(proc))) from None

    def kill_all(self):
        for proc in self.started:
            for pgid in [proc.pid] + runner_pids():
                try:
                    os.killpg(pgid, signal.SIGKILL)   # a runner leads its own process group
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def chaos(self, config, count=1, up=2, seconds=40.0, most=None, limit=None,
              runner_gap=(0.3, 0.9), overseer_gap=(2.5, 4.5)):
        """Start `count` overseers on `config` and, once `up` runners are registered, kill -9
        a random registered runner every `runner_gap` seconds (drawn in that range) and,
        unless `overseer_gap` is None, an overseer that is up every `overseer_gap` seconds,
        starting another in its place; for `seconds`, or `most` runner kills, or until no
        task is left unfinished. Throughout, no overseer exits of itself and, with `limit`,
        no more than `limit` runners are registered or children of one overseer. Returns
        (runner kills, overseer kills); the overseers go on running."""
        running = [self.start(config) for _ in range(count)]

        def runners_up():
            self.assert_running(running)
            return len(runner_rows()) >= up
        wait_for(runners_up, timeout=START_TIMEOUT, message="%d runners up" % up)
        rng = random.Random(os.getpid())
        started, kills, overseer_kills = time.monotonic(), 0, 0
        next_runner_kill, next_overseer_kill = started + 0.5, started + 2.0
        while (time.monotonic() - started < seconds and (most is None or kills < most)
               and Task.select().where(Task.finished_on.is_null()).exists()):
            now = time.monotonic()
            self.assert_running(running)
            if limit is not None:
                assert len(runner_rows()) <= limit and all(
                    len(live_pids(proc.pid)) <= limit for proc in running), \
                    "over the limit of %d" % limit
            if now >= next_runner_kill:
                # Registered runners only (one killed before it registers is a start failure,
                # which the overseer throttles and, after many in a row, exits on): an
                # overseer's child, or one a killed overseer left winding down its run.
                registered = sorted(r.pid for r in runner_rows()
                                    if liveness.process_alive(r.pid, r.pid_create_time))
                if registered:
                    try:
                        os.kill(rng.choice(registered), signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass
                # From the time it was due (an even pace), but never to catch up more
                # than a tick behind.
                next_runner_kill = max(next_runner_kill, now - 0.05) + rng.uniform(*runner_gap)
            if overseer_gap is not None and now >= next_overseer_kill:
                # An overseer that is up (a runner of its own registered): one killed while
                # it starts (seconds on a loaded machine) would test nothing.
                mine = {r.pid for r in runner_rows()}
                alive = [i for i, proc in enumerate(running) if set(live_pids(proc.pid)) & mine]
                if alive:
                    victim = rng.choice(alive)
                    os.kill(running[victim].pid, signal.SIGKILL)
                    running[victim].wait(timeout=10)
                    running[victim] = self.start(config)
                    overseer_kills += 1
                    next_overseer_kill = now + rng.uniform(*overseer_gap)
            # Pacing of the kills, not a wait for a condition.
            time.sleep(max(0.0, min(0.05, next_runner_kill - time.monotonic())))
        return kills, overseer_kills

    def assert_running(self, running):
        for proc in running:
            assert proc.poll() is None, "overseer exited during the chaos\n" + self.log(proc)


@pytest.fixture
def overseers(database_sp, tmp_path):
    group = Overseers(database_sp, tmp_path)
    yield group
    group.kill_all()


@contextlib.contextmanager
def fresh_overseers(backend, tmp_path):
    """Overseers on a fresh database of `backend`: at the end, killed, and the database
    dropped."""
    database = Database(backend, tmp_path)
    group = Overseers(database, tmp_path)
    try:
        yield group
    finally:
        group.kill_all()
        database.drop()


@pytest.fixture
def pg_overseers(tmp_path):
    """Overseers on a fresh PostgreSQL database only."""
    with fresh_overseers("postgresql", tmp_path) as group:
        yield group


def is_gone(pid):
    """The process no longer runs (a zombie waiting for a parent that is not ours counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def children_of(pid, zombies=False):
    """The overseer's runners (its children but the wake-up hub, ``tr-hub``, and the
    maintainer, ``tr-maintainer``); without zombies unless asked."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for kid in kids:
        try:
            if (zombies or kid.status() != psutil.STATUS_ZOMBIE) \
                    and kid.name() not in (HUB, MAINTAINER_PROCESS):
                out.append(kid)
        except psutil.NoSuchProcess:
            pass
    return out


HUB = "tr-hub"      # the wake-up hub's process name (hub.py)
MAINTAINER_PROCESS = "tr-maintainer"     # the maintainer's (overseer/maintainer.py)


def hub_of(pid, name=HUB):
    """The overseer's wake-up hub process (or its child named `name`), or None."""
    try:
        return next((kid for kid in psutil.Process(pid).children() if kid.name() == name
                     and kid.status() != psutil.STATUS_ZOMBIE), None)
    except psutil.NoSuchProcess:
        return None


def maintainer_of(pid):
    """The overseer's maintainer process, or None."""
    return hub_of(pid, MAINTAINER_PROCESS)


def zombies_of(pid):
    found = []
    for kid in children_of(pid, zombies=True):
        try:
            if kid.status() == psutil.STATUS_ZOMBIE:
                found.append(kid.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def live_pids(pid):
    return sorted(kid.pid for kid in children_of(pid))


def overseer_row(proc):
    return Runner.get_or_none((Runner.kind == OVERSEER) & (Runner.pid == proc.pid))


def runner_rows(parent_id=None):
    """Runner rows holding a slot (``running``), optionally of one overseer."""
    query = Runner.select().where((Runner.kind == RUNNER) & (Runner.status == RUNNING)
                                 & Runner.slot.is_null(False))
    if parent_id is not None:
        query = query.where(Runner.parent_id == parent_id)
    return list(query)


def wait_up(overseers, proc, runners):
    """Wait until `proc` registered and has `runners` live children, each with its row;
    return the overseer's row."""
    def up():
        if proc.poll() is not None:
            raise AssertionError("overseer exited %s\n%s" % (proc.returncode, overseers.log(proc)))
        row = overseer_row(proc)
        if row is None:
            return None
        pids = live_pids(proc.pid)
        rows = sorted(r.pid for r in runner_rows(row.id))
        return row if len(pids) == runners and pids == rows else None
    return wait_for(up, timeout=START_TIMEOUT,
                    message="overseer with %d registered runners" % runners)


def own_tasks(*fields):
    """The tasks a test added: all but the built-in rotation task, which an overseer's
    maintainer submits when its timer is due (hourly by default; yearly in the configs
    conftest writes, and a test may set its own)."""
    return Task.select(*fields).where(Task.handler != "taskrunner.handlers.Rotate")


def wait_all_final(overseers, timeout=120.0):
    def final():
        for proc in overseers.started[-1:]:
            if proc.poll() is not None:
                raise AssertionError("overseer exited %s\n%s"
                                     % (proc.returncode, overseers.log(proc)))
        return Task.select().where(Task.finished_on.is_null()).count() == 0
    wait_for(final, timeout=timeout, interval=0.2, message="every task to end")


def runner_pids():
    """Live processes of this host that registered a runner row in the test's database (an
    overseer's children lead process groups of their own)."""
    try:
        rows = list(Runner.select().where(Runner.host == hostname()))
    except Exception:  # the database may be gone at teardown
        return []
    return [r.pid for r in rows if liveness.process_alive(r.pid, r.pid_create_time)]


def group_members(pgid):
    """Live processes in process group `pgid`, and live runners of the test's database with
    the groups they lead: what an overseer leaves behind."""
    pgids = {pgid} | set(runner_pids())
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


# -- 1. rule 5 with forked runners ----------------------------------------------------------

@pytest.mark.timeout(180)
def test_limit_3_never_more_than_3_runners_and_every_task_succeeds(database_sp, overseers,
                                                                   tmp_path):
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    task_ids = queue.add_tasks([{"handler": "sample_handlers.Started",
                                 "data": {"log": log, "sleep": 0.3}} for _ in range(20)])
    proc = overseers.start(overseers.config(limit=3))

    most_processes = most_rows = 0

    def sample():
        nonlocal most_processes, most_rows
        if proc.poll() is not None:
            raise AssertionError("overseer exited\n" + overseers.log())
        processes = len(children_of(proc.pid))
        rows = len(runner_rows())
        most_processes, most_rows = max(most_processes, processes), max(most_rows, rows)
        assert processes <= 3, "%d live runner processes (limit 3)" % processes
        assert rows <= 3, "%d runner rows running with a slot (limit 3)" % rows
        return Task.select().where(Task.finished_on.is_null()).count() == 0

    wait_for(sample, timeout=120, interval=0.02, message="the 20 tasks to end")
    assert most_processes == 3 and most_rows == 3, "the limit was never reached"
    assert [t.last_status for t in own_tasks(Task.last_status).order_by(Task.id)] == [SUCCESS] * 20
    assert sorted(t for t, _, _ in read_records(log)) == sorted(task_ids)
    assert Run.select().where(Run.task_id.in_(own_tasks(Task.id))).count() == 20
    assert len({pid for _, _, pid in read_records(log)}) > 1, "one runner did everything"
    queue.close()


# -- 2. rule 7: a runner killed mid-run -----------------------------------------------------

@pytest.mark.timeout(180)
def test_killed_runner_is_noticed_replaced_and_its_task_runs_again(database_sp, overseers,
                                                                   tmp_path):
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    # Attempt 1 sleeps a minute; the retry finishes at once.
    task_id = queue.add_task("sample_handlers.SlowFirstAttempt", data={"log": log, "sleep": 60})
    proc = overseers.start(overseers.config(limit=2))
    me = wait_up(overseers, proc, 2)

    [(_, run_id, victim)] = wait_started(log)
    assert victim in live_pids(proc.pid)
    row = Runner.get((Runner.pid == victim) & (Runner.status == RUNNING))
    assert row.parent_id == me.id

    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()

    def noticed():
        return (Runner.get_by_id(row.id).status == TIMEOUT
                and Run.get_by_id(run_id).status == TIMEOUT)
    wait_for(noticed, timeout=START_TIMEOUT, interval=0.02, message="the death to be noticed")
    elapsed = time.monotonic() - killed_at
    assert elapsed <= 2 * CHECK_INTERVAL + MACHINE_SLACK, \
        "noticed %.1fs after the kill\n%s" % (elapsed, overseers.log())
    row = Runner.get_by_id(row.id)
    assert row.slot is None and row.finished_on is not None
    run = Run.get_by_id(run_id)
    assert run.error_code == "RunnerDied"

    def replaced():
        pids = live_pids(proc.pid)
        rows = sorted(r.pid for r in runner_rows(me.id))
        return len(pids) == 2 and victim not in pids and pids == rows
    wait_for(replaced, timeout=START_TIMEOUT, message="a replacement runner")

    wait_for(lambda: Task.get_by_id(task_id).finished_on is not None, timeout=START_TIMEOUT,
             message="the task to end")
    assert [(r.status, r.attempt) for r in runs_of(task_id)] == [(TIMEOUT, 1), (SUCCESS, 2)]
    assert Task.get_by_id(task_id).last_status == SUCCESS
    assert [t for t, _, _ in read_records(log)] == [task_id]

    # Reaped: no zombie child left behind.
    wait_for(lambda: zombies_of(proc.pid) == [], timeout=EXIT_TIMEOUT,
             message="no zombie children")
    assert victim not in [k.pid for k in children_of(proc.pid, zombies=True)]
    assert proc.poll() is None, overseers.log()
    queue.close()


# -- 3. rule 7: PID reuse -------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_row_whose_pid_is_alive_but_another_process_is_marked_timeout(database_sp, overseers,
                                                                       tmp_path):
    queue = database_sp.queue()
    proc = overseers.start(overseers.config(limit=1))
    wait_up(overseers, proc, 1)

    # Two rows naming this (alive) test process: one with its real create_time, one with
    # the create_time of an earlier process that held the same PID.
    now, pid = utcnow(), os.getpid()
    fields = dict(host=hostname(), boot_id=boot_id(), pid=pid, kind=RUNNER, started_on=now,
                  heartbeat_on=now, status=RUNNING)
    task_id = queue.add_task("sample_handlers.Record", data={"log": str(tmp_path / "r")},
                             scheduled_on=utc(now + timedelta(days=1)))
    # In one transaction with a run the reused row was executing, which must end `timeout`
    # with it (the check must not see the row without its run).
    with queue.store.db.atomic():
        reused = Runner.create(pid_create_time=create_time(pid) - 3600, **fields)
        genuine = Runner.create(pid_create_time=create_time(pid), **fields)
        lost_run = Run.create(task_id=task_id, created_on=now, updated_on=now, started_on=now,
                              attempt=1, active_task_id=task_id, scheduled_on=now,
                              status=RUNNING, runner_id=reused.id)
    inserted = time.monotonic()

    wait_for(lambda: Runner.get_by_id(reused.id).status == TIMEOUT
             and Run.get_by_id(lost_run.id).status == TIMEOUT, timeout=START_TIMEOUT,
             interval=0.05, message="the overseer's check to mark the reused PID's row")
    elapsed = time.monotonic() - inserted
    assert elapsed <= 2 * CHECK_INTERVAL + MACHINE_SLACK, "noticed after %.1fs" % elapsed
    assert "pid %d" % pid in Runner.get_by_id(reused.id).exit_reason
    run = Run.get_by_id(lost_run.id)
    assert (run.status, run.error_code) == (TIMEOUT, "RunnerDied")
    # The same PID with the right create_time is alive: left alone.
    assert Runner.get_by_id(genuine.id).status == RUNNING
    assert psutil.pid_exists(pid)
    assert proc.poll() is None, overseers.log()
    queue.close()


def waiting_on_a_lock(database):
    """Backend pids of the test database waiting for a lock."""
    with database.admin.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s "
                    "AND wait_event_type = 'Lock'", (database.name,))
        return [row[0] for row in cur.fetchall()]


@pytest.mark.timeout(180)
def test_overseer_killed_while_marking_a_dead_runner_leaves_no_run_behind(pg_overseers,
                                                                          tmp_path):
    import psycopg
    group = pg_overseers
    database = group.database
    queue = database.queue()
    proc = group.start(group.config(limit=1))
    wait_up(group, proc, 1)

    # A runner row (this test process, alive) with a run.
    now, pid = utcnow(), os.getpid()
    task_id = queue.add_task("sample_handlers.Record", data={"log": str(tmp_path / "r")},
                             scheduled_on=utc(now + timedelta(days=1)))
    with queue.store.db.atomic():
        ghost = Runner.create(host=hostname(), boot_id=boot_id(), pid=pid, kind=RUNNER,
                              pid_create_time=create_time(pid), started_on=now,
                              heartbeat_on=now, status=RUNNING)
        run = Run.create(task_id=task_id, created_on=now, updated_on=now, started_on=now,
                         attempt=1, active_task_id=task_id, scheduled_on=now, status=RUNNING,
                         runner_id=ghost.id)

    # Hold the run's row lock, then make the row look dead (its PID now someone else's):
    # the overseer's check marks the runner and blocks ending its run.
    blocker = psycopg.connect(database.url)
    try:
        blocker.execute("SELECT id FROM task_runs WHERE id = %s FOR UPDATE", (run.id,))
        Runner.update(pid_create_time=create_time(pid) - 3600).where(
            Runner.id == ghost.id).execute()
        [stuck] = wait_for(lambda: waiting_on_a_lock(database), timeout=START_TIMEOUT,
                           message="the overseer's check to wait for the run's lock")
        # The overseer dies right there.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=EXIT_TIMEOUT)
    finally:
        blocker.rollback()
        blocker.close()
    with database.admin.cursor() as cur:
        def backend_gone():
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (stuck,))
            return cur.fetchone()[0] == 0
        wait_for(backend_gone, timeout=EXIT_TIMEOUT, message="the dead overseer's backend to end")
    assert Run.get_by_id(run.id).status == RUNNING  # its end was rolled back with the overseer

    # A new overseer must not leave that run `running` for a day.
    second = group.start(group.config(limit=1))
    wait_up(group, second, 1)
    wait_for(lambda: Run.get_by_id(run.id).status == TIMEOUT,
             timeout=2 * CHECK_INTERVAL + MACHINE_SLACK,
             message="the run of the dead runner to end `timeout`")
    queue.close()


# -- 4. TERM: graceful stop -----------------------------------------------------------------

@pytest.mark.timeout(180)
def test_term_lets_runs_in_flight_finish_and_exits_0_leaving_no_process(database_sp, overseers,
                                                                        tmp_path):
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    task_ids = queue.add_tasks([{"handler": "sample_handlers.Started",
                                 "data": {"log": log, "sleep": 1.5}} for _ in range(3)])
    # Due, but after the three (lower priority): it must not be started once TERM is sent.
    waiting = queue.add_task("sample_handlers.Record", data={"log": log}, priority=-1)
    proc = overseers.start(overseers.config(limit=3, graceful_timeout=30))
    me = wait_up(overseers, proc, 3)
    started = wait_started(log, 3)
    runners = live_pids(proc.pid)
    assert sorted(pid for _, _, pid in started) == runners

    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert overseers.wait(proc, timeout=30 + MACHINE_SLACK) == 0, overseers.log()
    elapsed = time.monotonic() - sent
    assert elapsed < 30, "took %.1fs (graceful_timeout 30)" % elapsed

    # The runs in flight finished; nothing new was started.
    assert [Task.get_by_id(t).last_status for t in task_ids] == [SUCCESS] * 3
    assert sorted(t for t, _, _ in read_records(log)) == sorted(task_ids)
    assert Task.get_by_id(waiting).last_status == SCHEDULED
    assert all(is_gone(pid) for pid in runners)
    assert group_members(proc.pid) == []
    assert sorted((r.kind, r.status) for r in Runner.select().where(
        Runner.parent_id == me.id)) == [(MAINTAINER, SUCCESS)] + [(RUNNER, SUCCESS)] * 3
    assert Runner.get_by_id(me.id).status == SUCCESS
    queue.close()


@pytest.mark.timeout(120)
def test_term_kills_a_handler_that_ignores_term_after_graceful_timeout(database_sp, overseers,
                                                                       tmp_path):
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.IgnoreTerm", data={"log": log, "sleep": 60})
    proc = overseers.start(overseers.config(limit=1, graceful_timeout=2, kill_grace=1))
    me = wait_up(overseers, proc, 1)
    [(_, run_id, handler_pid)] = wait_started(log)

    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert overseers.wait(proc) == 0, overseers.log()
    elapsed = time.monotonic() - sent
    assert 1.8 <= elapsed <= 2 + MACHINE_SLACK, \
        "exited %.1fs after TERM (graceful_timeout 2)\n%s" % (elapsed, overseers.log())

    assert is_gone(handler_pid)
    assert group_members(proc.pid) == []
    # Handed back, not failed: the stop was the operator's, not the task's fault.
    run = Run.get_by_id(run_id)
    assert (run.status, run.error_code) == (REQUEUED, "Stopped"), overseers.log()
    assert "graceful_timeout" in run.error_message, run.error_message
    task = Task.get_by_id(task_id)
    assert (task.runs_failed, task.finished_on, task.last_status) == (0, None, SCHEDULED)
    assert [r.status for r in runs_of(task_id)] == [REQUEUED, SCHEDULED]   # runs again at once
    assert Runner.get(Runner.pid == handler_pid).status == TIMEOUT
    assert Runner.get_by_id(me.id).status == SUCCESS
    queue.close()


# -- 5. kill -9 the overseer ----------------------------------------------------------------

@pytest.mark.timeout(180)
def test_runners_of_a_killed_overseer_finish_and_a_new_overseer_carries_on(database_sp,
                                                                           overseers, tmp_path):
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    # Three runs in flight (priority 1): two short ones and one whose first attempt would
    # take a minute; three more tasks wait behind them.
    short = queue.add_tasks([{"handler": "sample_handlers.Started", "priority": 1,
                              "data": {"log": log, "sleep": 1.5}} for _ in range(2)])
    slow = queue.add_task("sample_handlers.SlowFirstAttempt", priority=1,
                          data={"log": log, "sleep": 60})
    waiting = queue.add_tasks([{"handler": "sample_handlers.Started",
                                "data": {"log": log, "sleep": 0.2}} for _ in range(3)])
    config = overseers.config(limit=3)
    first = overseers.start(config)
    first_row = wait_up(overseers, first, 3)
    started = wait_started(log, 3)
    assert sorted(t for t, _, _ in started) == sorted(short + [slow])
    orphans = live_pids(first.pid)
    [slow_pid] = [pid for t, _, pid in started if t == slow]
    slow_row = Runner.get((Runner.pid == slow_pid) & (Runner.status == RUNNING))

    first.send_signal(signal.SIGKILL)
    assert overseers.wait(first) == -signal.SIGKILL

    # PR_SET_PDEATHSIG (or the parent check): finish the current run, claim nothing, exit.
    finishers = [pid for pid in orphans if pid != slow_pid]
    wait_for(lambda: all(is_gone(pid) for pid in finishers), timeout=EXIT_TIMEOUT,
             message="the orphaned runners to finish their run and exit")
    assert sorted(t for t, _, _ in read_records(log)) == sorted(short)
    assert [Task.get_by_id(t).last_status for t in short] == [SUCCESS] * 2
    for pid in finishers:
        row = Runner.get(Runner.pid == pid)
        assert row.status == SUCCESS, (row.pid, row.status, row.exit_reason)
    assert [Run.get(Run.task_id == t).status for t in waiting] == [SCHEDULED] * 3
    # The slow one dies too, with no overseer around to notice.
    os.kill(slow_pid, signal.SIGKILL)
    wait_for(lambda: is_gone(slow_pid), timeout=EXIT_TIMEOUT, message="the slow runner to die")
    assert Runner.get_by_id(slow_row.id).status == RUNNING
    assert Runner.get_by_id(first_row.id).status == RUNNING

    second = overseers.start(config)
    second_row = wait_up(overseers, second, 3)
    # The sweep at start: the rows of the dead overseer and of the dead runner, and its run.
    for row_id, pid in ((first_row.id, first.pid), (slow_row.id, slow_pid)):
        swept = Runner.get_by_id(row_id)
        assert swept.status == TIMEOUT and "pid %d" % pid in swept.exit_reason, \
            (swept.status, swept.exit_reason)
    assert (runs_of(slow)[0].status, runs_of(slow)[0].error_code) == (TIMEOUT, "RunnerDied")

    wait_all_final(overseers)
    all_tasks = short + [slow] + waiting
    assert [Task.get_by_id(t).last_status for t in all_tasks] == [SUCCESS] * 6
    assert sorted(t for t, _, _ in read_records(log)) == sorted(all_tasks), "lost or doubled"
    assert [(r.status, r.attempt) for r in runs_of(slow)] == [(TIMEOUT, 1), (SUCCESS, 2)]
    running = Runner.select().where(Runner.status == RUNNING)
    [maintainer] = running.where(Runner.kind == MAINTAINER)
    assert maintainer.parent_id == second_row.id      # the first one died with its overseer
    assert {r.id for r in running} == {second_row.id, maintainer.id} | {
        r.id for r in runner_rows(second_row.id)}
    queue.close()


# -- 6. HUP ---------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_hup_applies_a_new_limit_and_keeps_the_old_config_when_the_new_one_is_invalid(
        database_sp, overseers, tmp_path):
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    config = overseers.config(limit=2)
    proc = overseers.start(config)
    me = wait_up(overseers, proc, 2)
    before = live_pids(proc.pid)

    overseers.config(limit=4)  # rewrites the same file
    proc.send_signal(signal.SIGHUP)
    wait_up(overseers, proc, 4)
    # The old runners retired their rows before exiting: their processes may outlive the
    # new runners' registration by a moment on a loaded machine.
    wait_for(lambda: not set(before) & set(live_pids(proc.pid)), timeout=START_TIMEOUT,
             message="the old runners to exit")
    # A new runner that registered while an old one still held its slot was refused and is
    # started again by the overseer: four rows, each a live runner, within the deadline.
    wait_for(lambda: len(runner_rows(me.id)) == 4 and sorted(
        r.pid for r in runner_rows(me.id)) == live_pids(proc.pid), timeout=START_TIMEOUT,
        message="four runners under the new limit")
    after = live_pids(proc.pid)

    with open(config, "w") as fh:
        fh.write("[runner\nlimit = = 1\n")
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload failed" in proc.log_path.read_text(), timeout=START_TIMEOUT,
             message="the reload error in the log")
    assert proc.poll() is None, overseers.log()
    # Same four runners, and they still work.
    task_ids = queue.add_tasks([{"handler": "sample_handlers.Record",
                                 "data": {"log": log, "sleep": 0.2}} for _ in range(8)])
    wait_all_final(overseers)
    assert [Task.get_by_id(t).last_status for t in task_ids] == [SUCCESS] * 8
    assert live_pids(proc.pid) == after
    assert sorted(r.pid for r in runner_rows(me.id)) == after
    queue.close()


# -- 7. rule 8: max_runtime -----------------------------------------------------------------

@pytest.mark.timeout(180)
def test_run_past_max_runtime_is_interrupted_by_its_own_runner_which_carries_on(
        database_sp, overseers, tmp_path):
    """Rule 8 in the runner: past max_runtime the run is marked timeout and the process
    executing it interrupts the handler; the runner goes on with the next task."""
    queue = database_sp.queue()
    log = str(tmp_path / "records")
    task_id = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 30},
                             max_runtime=1, max_retries=1)
    proc = overseers.start(overseers.config(limit=1, kill_grace=2, heartbeat_interval=0.2))
    wait_up(overseers, proc, 1)
    [(_, run_id, victim)] = wait_started(log)
    wait_for(lambda: Run.get_by_id(run_id).status != RUNNING, timeout=START_TIMEOUT,
             message="the run to be timed out")
    run = Run.get_by_id(run_id)
    assert (run.status, run.error_code) == (TIMEOUT, "MaxRuntime"), overseers.log()
    task = Task.get_by_id(task_id)
    assert task.last_status == TIMEOUT and task.given_up and task.last_error_code == "MaxRuntime"
    follow = queue.add_task("sample_handlers.Record", data={"log": log + ".next"})
    wait_for(lambda: Task.get_by_id(follow).last_status == SUCCESS, timeout=START_TIMEOUT,
             message="the next task")
    assert read_records(log) == [], "the handler ran to its end"
    [(_, _, pid)] = read_records(log + ".next")
    assert pid == victim and not is_gone(victim), "the runner should have carried on"
    assert "interrupting the handler: its max_runtime" in overseers.log() or \
        "interrupting the handler: it was ended by someone else" in overseers.log()
    queue.close()


@pytest.mark.slow
def test_handlers_that_crash_their_runner_are_crashes_not_start_failures(sqlite_db, tmp_path):
    """12 tasks whose handler kills its own process (os._exit(1)): each run ends timeout
    (RunnerDied), is retried under max_retries and then given up, counted as crashes; the
    overseer never takes these for start failures and keeps serving the rest of the queue.
    (Before: "runners keep failing at start", the overseer exited 1 and nothing ran.)"""
    group = Overseers(sqlite_db, tmp_path)
    try:
        queue = sqlite_db.queue()
        crashing = queue.add_tasks([{"handler": "sample_handlers.Crash", "max_retries": 2}
                                    for _ in range(12)])
        proc = group.start(group.config(limit=2, max_start_failures=3))
        wait_up(group, proc, 2)
        wait_for(lambda: all(Task.get_by_id(t).finished_on for t in crashing),
                 timeout=START_TIMEOUT, message="every crashing task to be given up")
        for task_id in crashing:
            task = Task.get_by_id(task_id)
            assert (task.last_status, task.last_error_code, task.runs_failed, task.crash_count) \
                == (TIMEOUT, "RunnerDied", 2, 2), task_id
            assert "died" in task.last_error_message   # "exited with exit code 1" or "pid N is gone"
        fine = queue.add_task("sample_handlers.Record", data={"log": str(tmp_path / "r")})
        wait_for(lambda: Task.get_by_id(fine).last_status == SUCCESS, timeout=START_TIMEOUT,
                 message="the host to go on serving the queue")
        assert proc.poll() is None, group.log()
        assert "failed at start" not in group.log()
        queue.close()
    finally:
        group.kill_all()


# A runner's registration fails (a runtime error of SQLite's, not a constraint): from then
# on every new runner fails at start, the ones registered before go on.
BREAK_REGISTRATION = ("CREATE TRIGGER break_registration BEFORE INSERT ON task_runners "
                      "WHEN NEW.kind = 'runner' BEGIN SELECT abs(-9223372036854775808); END")


@pytest.mark.timeout(120)
def test_giving_up_on_start_failures_stops_gracefully_and_a_busy_runner_finishes_its_run(
        sqlite_db, tmp_path):
    """One runner busy with a run, the others failing at start: after max_start_failures
    the overseer stops as on TERM — the busy runner finishes its run and exits, nothing is
    KILLed — and exits 1. (Before: the busy runner was KILLed at once, logged as
    graceful_timeout, and its run handed back unfinished.)"""
    group = Overseers(sqlite_db, tmp_path)
    try:
        queue = sqlite_db.queue()
        log = str(tmp_path / "records")
        busy = queue.add_task("sample_handlers.Started", data={"log": log, "sleep": 5})
        proc = group.start(group.config(limit=2, max_start_failures=3, check_interval=0.5,
                                        graceful_timeout=30))
        me = wait_up(group, proc, 2)
        [(_, run_id, busy_pid)] = wait_started(log)
        [idle_pid] = [pid for pid in live_pids(proc.pid) if pid != busy_pid]
        queue.store.db.execute_sql(BREAK_REGISTRATION)
        os.kill(idle_pid, signal.SIGKILL)         # registered: a crash; its successors fail
        assert group.wait(proc) == Overseer.EXIT_START_FAILED, group.log()
        text = proc.log_path.read_text()
        assert text.count("failed at start") == 3 and "killing runner" not in text, text
        assert read_records(log) == [(busy, run_id, busy_pid)], text
        assert Run.get_by_id(run_id).status == SUCCESS
        assert Runner.get(Runner.pid == busy_pid).status == SUCCESS
        assert Runner.get_by_id(me.id).exit_reason.startswith("runners keep failing at start")
        assert group_members(proc.pid) == []
        queue.close()
    finally:
        group.kill_all()


@pytest.mark.timeout(120)
def test_kill_9_of_registered_runners_is_not_a_failure_at_start(database_sp, overseers,
                                                                tmp_path):
    queue = database_sp.queue()
    proc = overseers.start(overseers.config(limit=1, max_start_failures=3))
    me = wait_up(overseers, proc, 1)
    killed = []
    for _ in range(3):
        # Registered (wait_up matched its row), so it did start; then someone kills it.
        [pid] = live_pids(proc.pid)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

        def replaced():
            if proc.poll() is not None:
                raise AssertionError("overseer exited %s\n%s" % (proc.returncode,
                                                                 overseers.log(proc)))
            pids = live_pids(proc.pid)
            rows = sorted(r.pid for r in runner_rows(me.id))
            return len(pids) == 1 and pids[0] not in killed and pids == rows
        wait_for(replaced, timeout=START_TIMEOUT, message="a replacement runner")
    assert "failed at start" not in proc.log_path.read_text(), overseers.log(proc)
    queue.close()


# -- 10. no connection crosses fork ---------------------------------------------------------

def pg_ports(pid):
    """Local ports of the process's TCP connections to PostgreSQL."""
    try:
        process = psutil.Process(pid)
        # net_connections since psutil 6.0; connections, its old name, in the 5.9 floor.
        conns = getattr(process, "net_connections", None) or process.connections
        conns = conns(kind="tcp")
    except psutil.NoSuchProcess:
        return set()
    return {c.laddr.port for c in conns if c.raddr and c.raddr.port == 5432}


@pytest.mark.timeout(180)
def test_each_runner_has_its_own_postgresql_connection(pg_overseers, tmp_path):
    group = pg_overseers
    database = group.database
    direct_only(database, "server connections are shared by design (tests/test_pgbouncer.py)")
    queue = database.queue()
    log = str(tmp_path / "records")
    queue.add_tasks([{"handler": "sample_handlers.BackendPid",
                      "data": {"log": log, "sleep": 0.2}} for _ in range(12)])
    proc = group.start(group.config(limit=3))
    wait_up(group, proc, 3)
    wait_all_final(group)
    records = read_records(log)
    assert len(records) == 12

    backends = {}
    for _, _, pid, backend in records:
        backends.setdefault(pid, set()).add(backend)
    assert len(backends) >= 2, "one runner did everything: %r" % backends
    seen = [b for pids in backends.values() for b in pids]
    assert len(seen) == len(set(seen)), "runners share a backend: %r" % backends

    # No socket is held by two processes of the tree, and the overseer's backends are
    # not the runners'.
    tree = [proc.pid] + live_pids(proc.pid)
    ports = {pid: pg_ports(pid) for pid in tree}
    for pid in tree:
        for other in tree:
            if pid < other:
                assert not ports[pid] & ports[other], (pid, other, ports)

    def overseer_backends():
        # Right after forking the overseer holds no connection (it closes it before a
        # fork); it opens its own again at its next check.
        with database.admin.cursor() as cur:
            cur.execute("SELECT pid, client_port FROM pg_stat_activity WHERE datname = %s",
                        (database.name,))
            by_port = {port: backend for backend, port in cur.fetchall()}
        return {by_port[p] for p in pg_ports(proc.pid) if p in by_port}
    mine = wait_for(overseer_backends, timeout=10, message="the overseer's own connection")
    assert not mine & set(seen), (mine, backends)

    # kill -9 every runner: the overseer (and its connection) carries on.
    victims = live_pids(proc.pid)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    delayed = queue.add_task("sample_handlers.BackendPid", data={"log": log},
                             scheduled_on=utc(utcnow() + timedelta(seconds=1)))
    wait_for(lambda: Task.get_by_id(delayed).last_status == SUCCESS, timeout=START_TIMEOUT,
             interval=0.2, message="the delayed task to succeed")
    assert proc.poll() is None, group.log()
    assert all(is_gone(pid) for pid in victims)
    [(_, _, pid, backend)] = [r for r in read_records(log) if r[0] == delayed]
    assert pid not in victims and backend not in seen
    queue.close()


# -- 11. chaos ------------------------------------------------------------------------------

# Flow control (issue 27): the queue rate-limited and fair between tenants, half the tasks
# with rate keys of their own limit.
FLOW = {"queues": {"default": {"limit": 4, "rate": "100/s", "fair_by": "tenant"}},
        "rate_limits": {"k:*": "40/s"}}
FLOW_TOML = ('[queues.default]\nlimit = 4\nrate = "100/s"\nfair_by = "tenant"\n'
             '[rate_limits]\n"k:*" = "40/s"\n')


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("batch,flow", [(1, False), (16, False), (1, True)])
def test_chaos_kill_9_runners_every_quarter_second_loses_no_task(batch, flow, database_sp,
                                                                 overseers, tmp_path):
    """A random runner SIGKILLed every 0.25 s while the queue is being worked (30 kills, or
    until no task is left): nothing lost, no run executed twice, the limit never exceeded;
    with batched acknowledgements too (a run then holds its runner's batch), and with rate
    limits and fairness configured (`flow`). The tasks are added with the overseer's retries
    (a task keeps the max_retries it was added with): with the default 5, a task claimed
    into five victims' batches was given up."""
    queue = database_sp.queue(task={"max_retries": 50, "retry_backoff": 0},
                              **(FLOW if flow else {}))
    log = str(tmp_path / "records")
    task_ids = queue.add_tasks([{"handler": "sample_handlers.Record",
                                 "data": {"log": log, "sleep": 0.02},
                                 **({"tenant": "t%d" % (i % 3),
                                     "rate_key": "k:%d" % (i % 2) if i % 4 else None}
                                    if flow else {})} for i in range(1000)])
    config = overseers.config(limit=4, max_retries=50, batch=batch,
                              extra=FLOW_TOML if flow else "")
    # One overseer that must not exit, a runner killed every 0.25 s; the limit never exceeded.
    kills, _ = overseers.chaos(config, up=4, most=30, limit=4, runner_gap=(0.25, 0.25),
                               overseer_gap=None)
    [proc] = overseers.started
    assert kills >= 15, "the queue was drained before the chaos had a chance"

    wait_all_final(overseers, timeout=300)
    assert proc.poll() is None, overseers.log()

    tasks = list(own_tasks(Task.id, Task.last_status))
    assert len(tasks) == 1000
    assert {t.last_status for t in tasks} == {SUCCESS}, \
        [(t.id, t.last_status) for t in tasks if t.last_status != SUCCESS][:10]
    records = read_records(log)
    recorded_runs = [run for _, run, _ in records]
    assert len(recorded_runs) == len(set(recorded_runs)), "a run was executed twice"
    assert {t for t, _, _ in records} == set(task_ids), "a task never ran"
    success = [r.task_id for r in Run.select(Run.task_id).where(
        (Run.status == SUCCESS) & Run.task_id.in_(own_tasks(Task.id)))]
    assert sorted(success) == sorted(task_ids), "a task has no or two successful runs"
    assert Run.select().where(Run.status.in_([SCHEDULED, RUNNING])).count() == 0
    queue.close()
