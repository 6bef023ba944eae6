"""PostgreSQL server instructions per job, counted by valgrind's callgrind, for one or more
source trees: ``python -m bench.server_instructions --tree /work/base --tree .
[--tasks 2000] [--sql "DROP INDEX ..."]``.

bench/instructions.py counts a runner's own work; on PostgreSQL about half of a job's CPU
is the server's, and timing it (bench/perjob.py) swings by +-20 % on a shared machine. This
counts it: a throwaway cluster in tmpfs whose postmaster runs under callgrind (each backend
it forks writes its own count when it exits), autovacuum off. Per tree: its own database
(``init-db``, N no-op tasks from bench/backlog.py, ANALYZE), then ``taskrunner runner
--burst`` from that tree; the backends that served the runner are the ones that wrote their
count while it ran. The figure is their instructions minus those of the same run with no
task, per task: the statements the tree sends per job, as the wire protocol carries them,
with the tree's own schema. Only user space is counted (a commit's fsync is the kernel's).
``--sql`` runs a statement on every database after its backlog (to weigh an index, say).
Runs as root with Debian's PostgreSQL (``postgres`` user, /usr/lib/postgresql/N/bin) and
valgrind; about two minutes per tree at the default N.
"""
import argparse
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil

from bench import common
from bench.ab import run_in_tree
from bench.backlog import add_backlog
from bench.instructions import CONFIG

SUMMARY = re.compile(r"^(?:summary|totals): (\d+)", re.M)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bindir():
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not found:
        raise SystemExit("no PostgreSQL server binaries under /usr/lib/postgresql")
    return os.path.dirname(found[-1])


class Cluster:
    """A throwaway cluster whose postmaster and backends run under callgrind."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="trbench-pgcg-",
                                    dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        shutil.chown(self.dir, "postgres", "postgres")
        self.data, self.counts = os.path.join(self.dir, "data"), os.path.join(self.dir, "cg")
        os.mkdir(self.counts)
        shutil.chown(self.counts, "postgres", "postgres")
        self.port, bin_ = free_port(), bindir()
        subprocess.run(["runuser", "-u", "postgres", "--", os.path.join(bin_, "initdb"),
                        "-D", self.data, "-A", "trust", "-U", "postgres"],
                       check=True, capture_output=True)
        self.proc = subprocess.Popen(
            ["runuser", "-u", "postgres", "--", "valgrind", "--tool=callgrind",
             "--callgrind-out-file=" + os.path.join(self.counts, "cg.%p"),
             os.path.join(bin_, "postgres"), "-D", self.data, "-p", str(self.port),
             "-k", self.dir, "-c", "listen_addresses=127.0.0.1", "-c", "autovacuum=off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.admin = "postgresql://postgres@127.0.0.1:%d/postgres" % self.port
        deadline = time.monotonic() + 120
        while True:
            try:
                self.conn = common.connect(self.admin, autocommit=True)
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the callgrind cluster did not start")
                time.sleep(0.5)

    def database(self, name):
        self.conn.cursor().execute("CREATE DATABASE %s" % name)
        return "postgresql://postgres@127.0.0.1:%d/%s" % (self.port, name)

    def written(self):
        return set(os.listdir(self.counts))

    def backends(self):
        """PIDs of the postmaster's children (its background processes and backends)."""
        postmaster = psutil.Process(self.proc.pid).children()[0]   # runuser's child
        return {child.pid for child in postmaster.children()}

    def wait_gone(self, before, timeout=120):
        """Until every child of the postmaster but those in `before` has exited, so has
        written its count (a backend leaves pg_stat_activity before it exits)."""
        deadline = time.monotonic() + timeout
        while self.backends() - before:
            if time.monotonic() > deadline:
                raise RuntimeError("backends %s did not exit" % (self.backends() - before))
            time.sleep(0.2)

    def instructions(self, files):
        total = 0
        for name in files:
            with open(os.path.join(self.counts, name)) as fh:
                found = SUMMARY.search(fh.read())
            total += int(found.group(1)) if found else 0
        return total

    def close(self):
        self.conn.close()
        subprocess.run(["runuser", "-u", "postgres", "--", os.path.join(bindir(), "pg_ctl"),
                        "-D", self.data, "-m", "immediate", "stop"], capture_output=True)
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def served(cluster, root, count, scratch, sql=None):
    """Instructions of the backends that served `taskrunner runner --burst` of the tree at
    `root` draining `count` no-op tasks."""
    name = "srv_%d_%d" % (os.getpid(), len(os.listdir(scratch)))
    idle = cluster.backends()
    url = cluster.database(name)
    run_in_tree(root, [sys.executable, "-m", "taskrunner", "--database", url, "init-db"],
                check=True, capture_output=True)
    if count:
        add_backlog(url, count)
    with common.connect(url, autocommit=True) as conn:
        conn.cursor().execute(sql or "SELECT 1")
    cluster.wait_gone(idle)
    config = os.path.join(scratch, name + ".toml")
    with open(config, "w") as fh:
        fh.write(CONFIG)
    before = cluster.written()
    run_in_tree(root, [sys.executable, "-m", "taskrunner", "--config", config, "--database",
                       url, "--log-level", "warning", "runner", "--burst"],
                check=True, capture_output=True, timeout=3600)
    cluster.wait_gone(idle)
    return cluster.instructions(cluster.written() - before)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree's root (repeatable)")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--sql", help="a statement run on each database after its backlog")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed")
    if os.geteuid() != 0:
        parser.error("run as root (the cluster runs as the postgres user)")
    cluster, scratch = Cluster(), tempfile.mkdtemp(prefix="trbench-srv-")
    try:
        for tree in args.tree:
            root = os.path.abspath(tree)
            empty = served(cluster, root, 0, scratch, args.sql)
            full = served(cluster, root, args.tasks, scratch, args.sql)
            print("%-40s server: %.0fk instructions per job" % (
                root, (full - empty) / args.tasks / 1000), flush=True)
    finally:
        cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
