"""Three hosts on this machine, one PostgreSQL reached over the network.

Each host (bench/hostnet.py, the harness bench/fleet.py uses too) is a network namespace (a
veth on a bridge), a UTS namespace (its own hostname) and a PID namespace (its own PID
numbering: the same PIDs on every host), with one overseer in it. The PostgreSQL is a
throwaway cluster listening on the bridge address only, so every host crosses its network
namespace to reach it. The third host's clock runs ten minutes ahead (libfaketime). Then
every process of the first host is killed at once.

What must hold: within heartbeat_timeout plus one check interval another host marks the
dead host's runners and their runs ``timeout`` by heartbeat age — never by a local PID — and
the tasks run again; nothing is lost, nothing runs twice except the runs in flight; the
healthy hosts, the clock-shifted one included, are never declared dead.
"""
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from conftest import (databases_required, process_env, read_records, runs_of, spawn, utc,
                      wait_for)
from test_periodic_clock import faked, fresh_database, start_leader

from bench import hostnet
from taskrunner import TaskQueue
from taskrunner.config import Config
from taskrunner.fleet import liveness
from taskrunner.fleet.liveness import default_host_id
from taskrunner.runs import lifecycle
from taskrunner.store.models import (CRASHED, MAINTAINER, OVERSEER, RUNNER, RUNNING, SCHEDULED,
                                     SUCCESS, TIMEOUT, utcnow)

HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, CHECK_INTERVAL = 0.3, 3.0, 0.5
MACHINE_SLACK = 3.0  # two shared cores: processes get scheduled late
TASKS, SLEEP = 24, 1.0

CONFIG = """\
[database]
url = "{url}"
[runner]
limit = {limit}
poll_interval = 0.2
heartbeat_interval = {heartbeat_interval}
[overseer]
check_interval = {check_interval}
heartbeat_timeout = {heartbeat_timeout}
crash_grace = 0
graceful_timeout = {graceful_timeout}
[task]
retry_backoff = 0
"""


def fleet_or_skip(hosts, tmp_path, faketime=False):
    """hostnet.Fleet of `hosts`; the test skipped, or failed where required, where hosts
    cannot be made (or, with `faketime`, without libfaketime)."""
    reason = hostnet.missing(faketime=faketime)
    if reason:
        pytest.fail(reason) if databases_required() else pytest.skip(reason)
    return hostnet.Fleet(hosts, tmp_path, env=process_env())


def fleet_config(fleet, tmp_path, limit, graceful_timeout):
    """The fleet's config (CONFIG with this file's intervals) and a queue on its database."""
    config = tmp_path / "c.toml"
    config.write_text(CONFIG.format(url=fleet.cluster.url, limit=limit,
                                    graceful_timeout=graceful_timeout,
                                    heartbeat_interval=HEARTBEAT_INTERVAL,
                                    check_interval=CHECK_INTERVAL,
                                    heartbeat_timeout=HEARTBEAT_TIMEOUT))
    return config, TaskQueue(Config.load(str(config)), migrate=True)


@pytest.fixture
def hosts(tmp_path):
    with fleet_or_skip(3, tmp_path, faketime=True) as fleet:
        config, queue = fleet_config(fleet, tmp_path, limit=2, graceful_timeout=5)
        yield queue, lambda n, clock_offset=None: fleet.start(n, config, clock_offset)
        queue.close()


@pytest.mark.timing        # a 3 s heartbeat timeout and a bound on noticing: never beside a heavy test
@pytest.mark.timeout(120)
def test_a_dead_host_is_noticed_by_heartbeat_on_the_database_clock(hosts, tmp_path):
    queue, start = hosts
    Runner, Run, Task = queue.store.Runner, queue.store.Run, queue.store.Task
    doomed, healthy, shifted = start(1), start(2), start(3, clock_offset="+10m")

    def registered():
        rows = list(Runner.select().where((Runner.status == RUNNING) & (Runner.kind == RUNNER)))
        return len({r.host for r in rows}) == 3 and len(rows) == 6
    wait_for(registered, timeout=60, message="three hosts with two runners each")
    rows = list(Runner.select().where(Runner.status == RUNNING))
    ids = {r.host for r in rows}
    by_host = {h: [r for r in rows if r.host == h] for h in ids}
    # Each host has its own identity, and PIDs collide across hosts.
    assert {h.split("/")[0] for h in ids} == {"host1", "host2", "host3"}
    assert all("/pidns:" in h for h in ids)
    pids = [{r.pid for r in group} for group in by_host.values()]
    assert pids[0] & pids[1] & pids[2], "the hosts' PID numberings should collide"
    doomed_id = next(h for h in ids if h.startswith("host1/"))
    # The clock-shifted host wrote its heartbeats with the server's time all the same.
    heartbeats = [r.heartbeat_on for r in rows]
    assert max(heartbeats) - min(heartbeats) < timedelta(seconds=HEARTBEAT_TIMEOUT)

    log = str(tmp_path / "records")
    task_ids = [queue.add_task("sample_handlers.PausedRecord",
                                 data={"log": log, "sleep": SLEEP})
                for _ in range(TASKS)]

    def doomed_busy():
        return Run.select().join(Runner, on=(Run.runner_id == Runner.id)).where(
            (Run.status == RUNNING) & (Runner.host == doomed_id)).count() > 0
    wait_for(doomed_busy, timeout=60, message="host1 to be running tasks")
    namespace = doomed.pid_namespace()
    killed_at = time.monotonic()
    doomed.kill()
    wait_for(lambda: doomed.processes(namespace) == [], timeout=10,
             message="every process of host1 to be gone")

    def doomed_marked():
        return Runner.select().where((Runner.host == doomed_id)
                                     & (Runner.status == RUNNING)).count() == 0
    wait_for(doomed_marked, timeout=HEARTBEAT_TIMEOUT + CHECK_INTERVAL + 30,
             message="another host to mark host1's runners dead")
    noticed = time.monotonic() - killed_at
    print("host1 found dead %.1fs after the kill" % noticed)
    assert noticed <= HEARTBEAT_TIMEOUT + CHECK_INTERVAL + MACHINE_SLACK, \
        "noticed after %.1fs" % noticed

    wait_for(lambda: Task.select().where(Task.id.in_(task_ids)
                                         & (Task.last_status == SUCCESS)).count() == TASKS,
             timeout=60, message="every task to succeed")

    # The runs in flight on host1 when it died: still ``running`` under its runners until
    # another host found them dead, then ``timeout``.
    dead = list(Runner.select().where(Runner.host == doomed_id))
    crashed = list(Run.select().where(Run.runner_id.in_([r.id for r in dead])
                                      & (Run.status == TIMEOUT)))
    in_flight = {r.task_id for r in crashed}
    assert in_flight and all(r.error_code == CRASHED for r in crashed)
    assert not Run.select().where(Run.runner_id.in_([r.id for r in dead])
                                  & (Run.status == RUNNING)).exists()

    # Nothing lost, nothing run twice except the runs in flight on host1.
    records = read_records(log)
    counts = {t: sum(1 for r in records if r[0] == t) for t in task_ids}
    assert all(counts[t] >= 1 for t in task_ids), counts
    twice = {t for t, c in counts.items() if c > 1}
    assert twice <= in_flight, (in_flight, [
        (r.task_id, r.status, r.error_code, r.error_message, Runner.get_by_id(r.runner_id).host)
        for r in Run.select().where(Run.task_id.in_(list(twice)))])

    # host1's runners: dead by heartbeat age, judged from another host, never by a PID.
    assert dead and all(r.status == TIMEOUT for r in dead)
    assert all(r.exit_reason.startswith("no heartbeat from %s" % doomed_id) for r in dead), \
        [r.exit_reason for r in dead]
    # No healthy host, the one ten minutes ahead included, was ever declared dead.
    others = list(Runner.select().where(Runner.host != doomed_id))
    assert others and all(r.status == RUNNING for r in others), \
        [(r.host, r.kind, r.status, r.exit_reason) for r in others if r.status != RUNNING]
    assert healthy.process.poll() is None and shifted.process.poll() is None
    assert {r.kind for r in others} == {OVERSEER, MAINTAINER, RUNNER}

    for host in (healthy, shifted):
        host.process.send_signal(signal.SIGTERM)


def test_two_pid_namespaces_sharing_a_hostname_have_different_host_ids():
    """Containers sharing a hostname judge each other by heartbeat, not by local PIDs; the
    machine's own PID namespace keeps the plain hostname."""
    reason = hostnet.missing()
    if reason:
        pytest.skip(reason)
    code = ("import sys; from taskrunner.fleet.liveness import default_host_id; "
            "print(default_host_id(), flush=True); sys.stdin.read()")
    # Both namespaces alive at once, as two containers are: the kernel reuses the inode
    # number of a namespace that has gone.
    hosts = [subprocess.Popen(["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh",
                               "-c", "hostname app && %s -c '%s'" % (sys.executable, code)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        ids = [host.stdout.readline().strip() for host in hosts]
    finally:
        for host in hosts:
            host.communicate(timeout=30)
    assert ids[0] != ids[1] and all(i.startswith("app/pidns:") for i in ids), ids
    if os.stat("/proc/self/ns/pid").st_ino == 0xEFFFFFFC:
        assert default_host_id() == os.uname().nodename


RUN_TIMEOUT = 2.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("clock_offset", ["+10m", "-10m"])
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_leader_whose_clock_is_off_judges_runs_on_the_database_clock(backend, clock_offset,
                                                                       tmp_path, procs):
    """The maintenance leader's clock is ten minutes ahead, or behind (libfaketime): it
    neither times out a fresh run nor creates a delayed task's run early, and it times out an
    overdue run (run_timeout, max_runtime) and creates a due run within their time plus one
    check interval, because it judges them on the database server's clock. (SQLite has one
    host, so one clock.)"""
    env = faked(clock_offset)
    with fresh_database(backend, tmp_path, procs) as database:
        queue = start_leader(database, tmp_path, procs, env)

        # A runner of another host (alive by its heartbeat) holds three runs.
        runner_id = liveness.register(queue.store).id
        Runner = queue.store.Runner
        Runner.update(host="elsewhere").where(Runner.id == runner_id).execute()
        fresh, overdue, too_long = (
            queue.add_task("taskrunner.handlers.Echo", run_timeout=120, max_runtime=120),
            queue.add_task("taskrunner.handlers.Echo", run_timeout=RUN_TIMEOUT),
            queue.add_task("taskrunner.handlers.Echo", run_timeout=120, max_runtime=RUN_TIMEOUT))
        claimed_at = time.monotonic()
        assert [lifecycle.claim(queue.store, runner_id).task_id for _ in range(3)] == [
            fresh, overdue, too_long]
        later, due = (queue.add_task("taskrunner.handlers.Echo",
                                     scheduled_on=utc(utcnow() + timedelta(seconds=seconds)))
                      for seconds in (300, RUN_TIMEOUT))

        def judged():
            return (runs_of(overdue)[0].status == TIMEOUT and
                    runs_of(too_long)[0].status == TIMEOUT and len(runs_of(due)) == 1)
        wait_for(judged, timeout=RUN_TIMEOUT + CHECK_INTERVAL + MACHINE_SLACK,
                 message="the overdue runs timed out and the due run created")
        print("judged %.1fs after the claims" % (time.monotonic() - claimed_at))
        [run] = runs_of(overdue)
        assert run.error_code == "RunTimeout"
        assert run.finished_on - run.started_on >= timedelta(seconds=RUN_TIMEOUT)
        [run] = runs_of(too_long)
        assert run.error_code == "MaxRuntime"
        assert run.finished_on - run.started_on >= timedelta(seconds=RUN_TIMEOUT)
        [run] = runs_of(due)
        assert run.status == SCHEDULED and run.created_on >= run.scheduled_on
        # Judged again at every check since: still too soon for these two.
        assert [r.status for r in runs_of(fresh)] == [RUNNING], \
            [(r.status, r.error_code) for r in runs_of(fresh)]
        assert runs_of(later) == []
        queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("clock_offset", ["+10m", "-10m"])
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_a_runner_whose_clock_is_off_is_judged_on_the_database_clock(backend, clock_offset,
                                                                     tmp_path, procs):
    """The runner's clock is ten minutes ahead, or behind (libfaketime); the process judging
    its run is right: the run is timed out neither before its run_timeout (its runner wrote
    its start on the database's clock, not ten minutes in the past) nor long after it (nor
    ten minutes in the future)."""
    env = faked(clock_offset)
    run_timeout = 3.0
    with fresh_database(backend, tmp_path, procs) as database:
        queue = database.queue()
        task_id = queue.add_task("sample_handlers.PausedRecord", run_timeout=run_timeout,
                                 data={"log": str(tmp_path / "records"), "sleep": 60})
        procs.add(spawn("run-event", "task-runner:OnProcess", url=database.url,
                        log_path=tmp_path / "runner.log", env=env), tmp_path / "runner.log")
        wait_for(lambda: runs_of(task_id)[0].status == RUNNING, timeout=60,
                 message="the runner to start the run")
        running_at = time.monotonic()
        timed_out = wait_for(lambda: lifecycle.timeout_overdue_runs(queue.store),
                             timeout=run_timeout + CHECK_INTERVAL + MACHINE_SLACK,
                             message="the run to be timed out")
        waited = time.monotonic() - running_at
        print("timed out %.1fs after it was seen running" % waited)
        assert [run_id for run_id, _ in timed_out] == [runs_of(task_id)[0].id]
        assert waited >= run_timeout / 2, "timed out %.1fs after it started" % waited
        queue.close()


CUT_TASKS, CUT_SLEEP = 40, 1.0


def host_processes(host):
    """{pid as the host numbers it: process name} of the host's taskrunner processes."""
    found = {}
    for pid in host.processes():
        try:
            with open("/proc/%d/status" % pid) as fh:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
        except OSError:
            continue
        if fields.get("Name", "").startswith("tr-"):
            found[int(fields["NSpid"].split()[-1])] = fields["Name"]
    return found


@pytest.mark.timeout(180)
def test_a_runner_declared_dead_while_cut_off_claims_nothing_after_the_heal(tmp_path):
    """Host 2's network is cut for longer than heartbeat_timeout: host 1 declares its runners
    (and its overseer) dead and runs their runs again. After the heal, host 2's processes,
    whose rows are dead, claim nothing more: tasks executed twice are only the runs in
    flight at the cut; and every process host 2 still has is registered again. Seen: 9
    tasks executed twice where 3 were in flight, and 0 registered runners on host 2 while
    its processes kept working."""
    with fleet_or_skip(2, tmp_path) as fleet:
        # graceful_timeout as [overseer]'s default.
        config, queue = fleet_config(fleet, tmp_path, limit=3, graceful_timeout=30)
        Runner, Run, Task = queue.store.Runner, queue.store.Run, queue.store.Task
        try:
            fleet.start(1, config)
            cut_off = fleet.start(2, config)

            def running_rows(host):
                return list(Runner.select().where((Runner.status == RUNNING)
                                                  & Runner.host.startswith(host + "/")))
            wait_for(lambda: len([r for r in running_rows("host1") + running_rows("host2")
                                  if r.kind == RUNNER]) == 6,
                     timeout=60, message="two hosts with three runners each")
            log = str(tmp_path / "records")
            task_ids = queue.add_tasks([{"handler": "sample_handlers.PausedRecord",
                                         "data": {"log": log, "sleep": CUT_SLEEP}}] * CUT_TASKS)
            host2 = {r.id for r in running_rows("host2")}

            def busy_on_host2():
                return list(Run.select().where((Run.status == RUNNING)
                                               & Run.runner_id.in_(list(host2))))
            wait_for(lambda: len(busy_on_host2()) == 3, timeout=60,
                     message="host2's three runners to be running tasks")
            veth = "trv%s2" % fleet.tag
            hostnet.run("ip", "link", "set", veth, "down")
            in_flight = {r.task_id for r in busy_on_host2()}
            try:
                wait_for(lambda: not running_rows("host2"), timeout=HEARTBEAT_TIMEOUT + 30,
                         message="host1 to declare host2's processes dead")
                time.sleep(2 * CHECK_INTERVAL)     # the cut outlasts the verdict
            finally:
                hostnet.run("ip", "link", "set", veth, "up")
            wait_for(lambda: Task.select().where(Task.id.in_(task_ids)
                                                 & (Task.last_status == SUCCESS)).count()
                     == CUT_TASKS, timeout=90, message="every task to succeed")

            # Nothing claimed by host2's runners once cut off (the database's record of it:
            # a handler interrupted early records nothing in the log): every run of theirs
            # ended before the cut, or was in flight at it.
            late = [(r.id, r.task_id, r.runner_id, r.status, r.error_code)
                    for r in Run.select().where(Run.runner_id.in_(list(host2)))
                    if r.status != SUCCESS and r.task_id not in in_flight]
            assert not late, "claimed by runners declared dead: %r" % late
            records = read_records(log)
            counts = {t: sum(1 for r in records if r[0] == t) for t in task_ids}
            twice = {t for t, c in counts.items() if c > 1}
            print("in flight at the cut: %d; executed twice: %d" % (len(in_flight), len(twice)))
            assert all(counts[t] >= 1 for t in task_ids), counts
            assert twice <= in_flight, (sorted(in_flight), [
                (r.task_id, r.status, r.error_code, r.error_message,
                 Runner.get_by_id(r.runner_id).host)
                for r in Run.select().where(Run.task_id.in_(list(twice - in_flight)))])

            def unregistered():
                """host2's processes that have no ``running`` row (the hub has none)."""
                rows = {r.pid for r in running_rows("host2")}
                return {pid: name for pid, name in host_processes(cut_off).items()
                        if name != "tr-hub" and pid not in rows}
            try:
                wait_for(lambda: not unregistered(), timeout=HEARTBEAT_TIMEOUT + 30,
                         message="every process of host2 to be registered again")
            except AssertionError:
                raise AssertionError("host2's processes without a row: %r\n%s" % (
                    unregistered(), cut_off.log()[-3000:])) from None
        finally:
            queue.close()
