"""Hosts on this machine, one PostgreSQL reached over the network: the harness of
tests/test_hosts.py, tests/test_fleet.py and bench/fleet.py.

Each host is a network namespace (a veth on a bridge made here), a UTS namespace (its own
hostname) and a PID namespace (its own PID numbering: the same PIDs on every host), with one
`taskrunner overseer` in it. The PostgreSQL is a throwaway cluster listening on the bridge
address only, so every host crosses its network namespace to reach it.

`Fleet` (a context manager) undoes everything it made when it is left, whatever the
reason (an exception, Ctrl-C): every host killed, the cluster dropped, the namespaces and
the bridge removed. Needs root and Debian's postgresql-common tools.
"""
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import psutil

from bench.common import wait_until

PG_VERSION = "15"
FAKETIME = next(iter(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1")), "libfaketimeMT.so.1")
TOOLS = ("unshare", "ip", "pg_createcluster", "pg_dropcluster", "pg_ctlcluster", "pg_isready")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def missing(faketime=False):
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (namespaces, a PostgreSQL cluster)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return "%s is not installed" % tool
    if faketime and not os.path.exists(FAKETIME):
        return "libfaketime is not installed (apt-get install faketime libfaketime)"
    return None


def run(*cmd):
    """Run a command to its end; its output. Interrupted (Ctrl-C, the watchdog), it is
    killed with its whole process group (pg_createcluster's initdb too)."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = process.communicate(timeout=60)
    except BaseException:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(cmd), process.returncode,
                                                 err.strip()))
    return out


def pid_namespace_members(namespace):
    """PIDs, as this machine numbers them, of the processes in PID namespace `namespace`
    (an inode number)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat("/proc/%s/ns/pid" % name).st_ino == namespace:
                    found.append(int(name))
            except OSError:
                pass
    return found


class Network:
    """A bridge at SUBNET.1 and, per host, a network namespace at SUBNET.(10 + n) joined
    to it by a veth pair."""

    def __init__(self, tag, subnet):
        self.tag, self.subnet = tag, subnet
        self.bridge = "trb" + tag
        self.address = "%s.1" % subnet
        self.namespaces = []
        run("ip", "link", "add", self.bridge, "type", "bridge")
        try:
            run("ip", "addr", "add", self.address + "/24", "dev", self.bridge)
            run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.remove()
            raise

    def add_host(self, n):
        namespace, veth = "trh%s%d" % (self.tag, n), "trv%s%d" % (self.tag, n)
        run("ip", "netns", "add", namespace)
        self.namespaces.append(namespace)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)
        run("ip", "link", "set", veth, "master", self.bridge, "up")
        run("ip", "-n", namespace, "addr", "add", "%s.%d/24" % (self.subnet, 10 + n),
            "dev", "eth0")
        run("ip", "-n", namespace, "link", "set", "eth0", "up")
        run("ip", "-n", namespace, "link", "set", "lo", "up")
        return namespace

    def remove(self):
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


def _free_port():
    """A port nothing listens on (any address), from the range the tests' clusters use."""
    while True:
        port = 20000 + int(uuid.uuid4().int % 20000)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
                return port
            except OSError:
                continue


class Cluster:
    """A throwaway PostgreSQL cluster listening on `address` only, trusting the subnet,
    with one database, `database`. `settings`: more postgresql.conf lines, as a dict."""

    def __init__(self, name, address, subnet, database="hosts", settings=None):
        self.name, self.address, self.database = name, address, database
        self.port = _free_port()
        try:
            run("pg_createcluster", PG_VERSION, name, "--port", str(self.port))
            self._start(subnet, dict({"fsync": "off", "max_connections": 60}, **(settings or {})))
        except BaseException:     # a half-made cluster too (pg_createcluster interrupted)
            self.drop()
            raise

    def _start(self, subnet, settings):
        directory = "/etc/postgresql/%s/%s" % (PG_VERSION, self.name)
        settings["listen_addresses"] = "'%s'" % self.address
        with open(directory + "/conf.d/taskrunner-hosts.conf", "w") as fh:
            fh.write("".join("%s = %s\n" % item for item in settings.items()))
        with open(directory + "/pg_hba.conf", "a") as fh:
            fh.write("host all all %s.0/24 trust\n" % subnet)
        run("pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, self.name, "start")
        wait_until(lambda: subprocess.run(
            ["pg_isready", "-q", "-h", self.address, "-p", str(self.port)],
            check=False).returncode == 0, 30, "the throwaway PostgreSQL", interval=0.2)
        self.psql("CREATE DATABASE %s" % self.database, database="postgres")
        self.url = self.url_for(self.database)

    def url_for(self, database, user="postgres"):
        return "postgresql://%s@%s:%d/%s" % (user, self.address, self.port, database)

    def psql(self, sql, database=None):
        return run("runuser", "-u", "postgres", "--", "psql", "-qAt", "-h", self.address,
                   "-p", str(self.port), "-d", database or self.database, "-c", sql)

    def postmaster(self):
        """The cluster's postmaster (psutil.Process)."""
        path = "/var/lib/postgresql/%s/%s/postmaster.pid" % (PG_VERSION, self.name)
        with open(path) as fh:
            return psutil.Process(int(fh.readline()))

    def cpu_seconds(self):
        """CPU seconds (user + system) of the whole server so far: the postmaster, its
        live children, and the children it has reaped (backends that have exited)."""
        postmaster = self.postmaster()
        times = postmaster.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in postmaster.children():
            try:
                own = child.cpu_times()
                total += own.user + own.system
            except psutil.NoSuchProcess:
                pass    # its time has moved to the postmaster's children_* meanwhile
        return total

    def drop(self):
        """Stop and remove the cluster, and what pg_dropcluster leaves: our conf.d file (so
        its directory), or a cluster whose creation was interrupted."""
        subprocess.run(["pg_dropcluster", PG_VERSION, self.name, "--stop"],
                       capture_output=True, timeout=60, check=False)
        for path in ("/etc/postgresql/%s/%s" % (PG_VERSION, self.name),
                     "/var/lib/postgresql/%s/%s" % (PG_VERSION, self.name)):
            shutil.rmtree(path, ignore_errors=True)


def faked_clock(offset):
    """The environment of a process whose wall clock is `offset` off ("+10m", libfaketime), as
    on a host whose time is wrong; its monotonic clock is not (NTP does not touch it), which
    timed waits in threads rely on."""
    return {"LD_PRELOAD": FAKETIME, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


class Host:
    """An overseer alone in its network, UTS and PID namespaces. The overseer is PID 2 there
    (after sh), its runners 3, 4, ...: the same PIDs on every host. `clock_offset`
    ("+10m"): the host's wall clock is off, through libfaketime."""

    def __init__(self, namespace, hostname, config, log_path, wakeup_dir, clock_offset=None,
                 env=None):
        self.hostname, self.log_path = hostname, str(log_path)
        preload = "".join("%s=%s " % item for item in faked_clock(clock_offset).items()) \
            if clock_offset else ""
        script = "hostname %s && %sTASKRUNNER_WAKEUP_DIR=%s %s -m taskrunner --config %s " \
            "overseer" % (hostname, preload, wakeup_dir, sys.executable, config)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", namespace, "unshare", "--uts", "--pid", "--fork",
                 "--mount-proc", "--kill-child", "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
                start_new_session=True)
        self._namespace = None

    def pid_namespace(self):
        """The PID namespace (inode) of the host's init, the child of unshare."""
        if self._namespace is None:
            def init():
                try:
                    return psutil.Process(self.process.pid).children()
                except psutil.NoSuchProcess:
                    return []
            child = wait_until(init, 10, "the init of %s" % self.hostname)[0]
            self._namespace = os.stat("/proc/%d/ns/pid" % child.pid).st_ino
        return self._namespace

    def processes(self, namespace=None):
        """PIDs, as this machine numbers them, of the processes left in the host."""
        return pid_namespace_members(namespace or self.pid_namespace())

    def alive(self):
        return self.process.poll() is None

    def memory(self):
        """{"uss", "pss", "rss"} in bytes, summed over the host's overseer and runners, and
        "alone": what the host would need on a machine of its own, the overseer's RSS plus
        its children's USS (a runner shares pages with the overseer it was forked from, and
        here the interpreter's pages are shared with every other host too)."""
        total = {"uss": 0, "pss": 0, "rss": 0, "alone": 0, "processes": 0}
        init = psutil.Process(self.process.pid).children()
        init = init[0].pid if init else None
        for pid in self.processes():
            if pid == init:
                continue    # the namespace's sh
            try:
                process = psutil.Process(pid)
                info, parent = process.memory_full_info(), process.ppid()
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            total["uss"] += info.uss
            total["pss"] += info.pss
            total["rss"] += info.rss
            total["alone"] += info.rss if parent == init else info.uss
            total["processes"] += 1
        return total

    def kill(self):
        """SIGKILL to every process of the host at once, then to unshare: the kernel kills
        every process of a PID namespace whose init dies, so nothing of it survives."""
        namespace = self.pid_namespace() if self.alive() else self._namespace
        if namespace is not None:
            for pid in self.processes(namespace):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.kill()
        self.process.wait(timeout=10)

    def terminate(self, timeout=30):
        """SIGTERM to the overseer (a graceful stop), then kill what is left."""
        if self.alive():
            for pid in self.processes():
                try:
                    if psutil.Process(pid).name() == "tr-overseer":
                        os.kill(pid, signal.SIGTERM)
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self.kill()

    def log(self):
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


class Fleet:
    """`size` host namespaces on one bridge and a throwaway cluster reached over it.
    `start(n, config)` starts host n (1-based) as "host<n>". `settings`: the cluster's
    postgresql.conf lines. Leaving the context undoes everything."""

    def __init__(self, size, workdir, settings=None, env=None):
        self.size, self.workdir, self.settings, self.env = size, str(workdir), settings, env
        self.tag = uuid.uuid4().hex[:5]
        self.subnet = "10.%d.%d" % (200 + uuid.uuid4().int % 50, uuid.uuid4().int % 250)
        self.network = self.cluster = None
        self.namespaces, self.hosts = [], {}

    def __enter__(self):
        try:
            self.network = Network(self.tag, self.subnet)
            self.namespaces = [self.network.add_host(n) for n in range(1, self.size + 1)]
            self.cluster = Cluster("trhosts" + self.tag, self.network.address, self.subnet,
                                   settings=self.settings)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, n, config, clock_offset=None):
        wakeup_dir = os.path.join(self.workdir, "wake%d" % n)
        os.makedirs(wakeup_dir, exist_ok=True)
        host = Host(self.namespaces[n - 1], "host%d" % n, config,
                    os.path.join(self.workdir, "host%d.log" % n), wakeup_dir, clock_offset,
                    env=self.env)
        self.hosts[n] = host
        return host

    def close(self):
        for host in self.hosts.values():
            try:
                if host.alive():
                    host.kill()
            except Exception as exc:  # the others must go all the same
                print("warning: could not kill %s: %s" % (host.hostname, exc), file=sys.stderr)
        if self.cluster is not None:
            self.cluster.drop()
            self.cluster = None
        if self.network is not None:
            self.network.remove()
            self.network = None
