"""Three hosts on this machine, one PostgreSQL reached over the network.

Each host is a network namespace (a veth on a bridge the test makes), a UTS namespace (its
own hostname) and a PID namespace (its own PID numbering: the same PIDs on every host), with
one overseer in it. The PostgreSQL is a throwaway cluster listening on the bridge address
only, so every host crosses its network namespace to reach it. The third host's clock runs
ten minutes ahead (libfaketime). Then every process of the first host is killed at once.

What must hold: within heartbeat_timeout plus one check interval another host marks the
dead host's runners and their runs ``timeout`` by heartbeat age — never by a local PID — and
the tasks run again; nothing is lost, nothing runs twice except the runs in flight; the
healthy hosts, the clock-shifted one included, are never declared dead.
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
from conftest import databases_required, process_env, read_records, wait_for

from taskrunner import TaskQueue
from taskrunner.config import Config
from taskrunner.liveness import default_host_id
from taskrunner.models import CRASHED, OVERSEER, RUNNER, RUNNING, SUCCESS, TIMEOUT

PG_VERSION = "15"
FAKETIME = next(iter(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")), "libfaketimeMT.so.1")
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, CHECK_INTERVAL = 0.3, 3.0, 0.5
MACHINE_SLACK = 3.0  # two shared cores: processes get scheduled late
TASKS, SLEEP = 24, 1.0

CONFIG = """\
[database]
url = "{url}"
[runner]
limit = 2
poll_interval = 0.2
heartbeat_interval = {heartbeat_interval}
[overseer]
check_interval = {check_interval}
heartbeat_timeout = {heartbeat_timeout}
crash_grace = 0
graceful_timeout = 5
[task]
retry_backoff = 0
"""


def _missing():
    if os.geteuid() != 0:
        return "needs root (namespaces, a PostgreSQL cluster)"
    for tool in ("unshare", "ip", "pg_createcluster", "pg_dropcluster", "pg_ctlcluster"):
        if shutil.which(tool) is None:
            return "%s is not installed" % tool
    if not os.path.exists(FAKETIME):
        return "libfaketime is not installed (apt-get install faketime libfaketime)"
    return None


def _run(*cmd):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise AssertionError("%s exited %d: %s" % (" ".join(cmd), done.returncode,
                                                   done.stderr.strip()))
    return done.stdout


class Network:
    """A bridge at SUBNET.1 and, per host, a network namespace at SUBNET.(10 + n) joined
    to it by a veth pair."""

    def __init__(self, tag, subnet):
        self.tag, self.subnet = tag, subnet
        self.bridge = "trb" + tag
        self.address = "%s.1" % subnet
        self.namespaces = []
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", self.address + "/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def add_host(self, n):
        namespace, veth = "trh%s%d" % (self.tag, n), "trv%s%d" % (self.tag, n)
        _run("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
             "netns", namespace)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", namespace, "addr", "add", "%s.%d/24" % (self.subnet, 10 + n),
             "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        return namespace

    def remove(self):
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


class Cluster:
    """A throwaway PostgreSQL cluster listening on `address` only, trusting the subnet."""

    def __init__(self, name, address, subnet):
        self.name = name
        self.port = 20000 + int(uuid.uuid4().int % 20000)
        _run("pg_createcluster", PG_VERSION, name, "--port", str(self.port))
        try:
            self._start(address, subnet)
        except BaseException:
            self.drop()
            raise

    def _start(self, address, subnet):
        directory = "/etc/postgresql/%s/%s" % (PG_VERSION, self.name)
        with open(directory + "/conf.d/taskrunner-test.conf", "w") as fh:
            fh.write("listen_addresses = '%s'\nfsync = off\nmax_connections = 60\n" % address)
        with open(directory + "/pg_hba.conf", "a") as fh:
            fh.write("host all all %s.0/24 trust\n" % subnet)
        _run("pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, "start")
        self.url = "postgresql://postgres@%s:%d/hosts" % (address, self.port)
        wait_for(lambda: subprocess.run(
            ["pg_isready", "-q", "-h", address, "-p", str(self.port)], check=False).returncode == 0,
            timeout=30, message="the throwaway PostgreSQL")
        _run("runuser", "-u", "postgres", "--", "psql", "-q", "-h", address, "-p",
             str(self.port), "-c", "CREATE DATABASE hosts")

    def drop(self):
        subprocess.run(["pg_dropcluster", PG_VERSION, self.name, "--stop"],
                       capture_output=True, timeout=60, check=False)


class Host:
    """An overseer alone in its network, UTS and PID namespaces. The overseer is PID 2 there
    (after sh), its runners 3, 4, ...: the same PIDs on every host."""

    def __init__(self, namespace, hostname, config, log_path, wakeup_dir, clock_offset=None):
        self.hostname = hostname
        # The wall clock is off, as on a host whose time is wrong; its monotonic clock is
        # not (NTP does not touch it), which timed waits in threads rely on.
        preload = "LD_PRELOAD=%s FAKETIME=%s FAKETIME_DONT_FAKE_MONOTONIC=1 " % (
            FAKETIME, clock_offset) if clock_offset else ""
        script = "hostname %s && %sTASKRUNNER_WAKEUP_DIR=%s %s -m taskrunner --config %s " \
            "overseer" % (hostname, preload, wakeup_dir, sys.executable, config)
        self.log_path = log_path
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "unshare", "--uts", "--pid", "--fork",
             "--mount-proc", "--kill-child", "sh", "-c", script],
            stdout=subprocess.DEVNULL, stderr=open(log_path, "ab"), env=process_env(),
            start_new_session=True)

    def pid_namespace(self):
        """The PID namespace of the host's init (the child of unshare)."""
        children = _run("sh", "-c", "cat /proc/%d/task/*/children" % self.process.pid).split()
        return os.stat("/proc/%s/ns/pid" % children[0]).st_ino

    def processes(self, namespace):
        """PIDs, as this machine numbers them, of the processes left in the host."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat("/proc/%s/ns/pid" % name).st_ino == namespace:
                        found.append(int(name))
                except OSError:
                    pass
        return found

    def kill(self):
        """SIGKILL to unshare: its child, the host's init, gets SIGKILL (--kill-child), and
        the kernel kills every other process of a PID namespace whose init dies."""
        self.process.kill()
        self.process.wait(timeout=10)

    def log(self):
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


@pytest.fixture
def hosts(tmp_path):
    reason = _missing()
    if reason:
        if databases_required():
            pytest.fail(reason)
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:5]
    subnet = "10.%d.%d" % (200 + uuid.uuid4().int % 50, uuid.uuid4().int % 250)
    network = cluster = None
    started = []
    try:
        network = Network(tag, subnet)
        namespaces = [network.add_host(n) for n in (1, 2, 3)]
        cluster = Cluster("trhosts" + tag, network.address, subnet)
        config = tmp_path / "c.toml"
        config.write_text(CONFIG.format(url=cluster.url, heartbeat_interval=HEARTBEAT_INTERVAL,
                                        check_interval=CHECK_INTERVAL,
                                        heartbeat_timeout=HEARTBEAT_TIMEOUT))
        queue = TaskQueue(Config.load(str(config)), migrate=True)

        def start(n, clock_offset=None):
            wakeup_dir = tmp_path / ("wake%d" % n)
            wakeup_dir.mkdir(exist_ok=True)
            host = Host(namespaces[n - 1], "host%d" % n, config, tmp_path / ("host%d.log" % n),
                        wakeup_dir, clock_offset)
            started.append(host)
            return host
        yield queue, start
        queue.close()
    finally:
        for host in started:
            if host.process.poll() is None:
                host.kill()
        if cluster is not None:
            cluster.drop()
        if network is not None:
            network.remove()


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
    assert {r.kind for r in others} == {OVERSEER, RUNNER}

    for host in (healthy, shifted):
        host.process.send_signal(signal.SIGTERM)


def test_two_pid_namespaces_sharing_a_hostname_have_different_host_ids():
    """Containers sharing a hostname judge each other by heartbeat, not by local PIDs; the
    machine's own PID namespace keeps the plain hostname."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    code = ("import sys; from taskrunner.liveness import default_host_id; "
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
