"""PostgreSQL server instructions per job, counted by valgrind's callgrind, for one or more
source trees: ``python -m bench.server_instructions --tree /work/base --tree .
[--tasks 2000] [--sql "DROP INDEX ..."]``.

bench/instructions.py counts a runner's own work; on PostgreSQL about half of a job's CPU
is the server's, and timing it (bench/perjob.py) swings by +-20 % on a shared machine. This
counts it: a throwaway cluster (tests/servers.py's) whose postmaster runs under callgrind
(each backend it forks writes its own count when it exits), autovacuum off. Per tree: its own database
(``init-db``, N no-op tasks from bench/backlog.py, ANALYZE), then ``taskrunner runner
--burst`` from that tree; the backends that served the runner are the ones that wrote their
count while it ran. The figure is their instructions minus those of the same run with no
task, per task: the statements the tree sends per job, as the wire protocol carries them,
with the tree's own schema. Only user space is counted (a commit's fsync is the kernel's).
``--sql`` runs a statement on every database after its backlog (to weigh an index, say).
Runs as root with Debian's PostgreSQL (pg_createcluster) and valgrind; about two minutes
per tree at the default N.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from bench import common
from bench.ab import run_in_tree
from bench.backlog import add_backlog
from bench.instructions import CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"^(?:summary|totals): (\d+)", re.M)


class Cluster:
    """tests/servers.py's throwaway cluster, its postmaster restarted under callgrind."""

    def __init__(self):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from servers import PostgresCluster
        self.cluster = cluster = PostgresCluster()
        self.counts = tempfile.mkdtemp(prefix="trbench-pgcg-")
        shutil.chown(self.counts, "postgres", "postgres")
        self.port = cluster.port
        try:
            cluster.ctl("stop")
            # As pg_ctlcluster starts it: the configuration directory names the data one.
            self.proc = subprocess.Popen(
                ["runuser", "-u", "postgres", "--", "valgrind", "--tool=callgrind",
                 "--callgrind-out-file=" + os.path.join(self.counts, "cg.%p"),
                 "/usr/lib/postgresql/%s/bin/postgres" % cluster.version,
                 "-D", "/etc/postgresql/%s/%s" % (cluster.version, cluster.name),
                 "-c", "autovacuum=off"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            common.wait_until(cluster.accepts, 120, "the callgrind cluster to start")
        except BaseException:
            self.close()
            raise
        self.conn = common.connect(
            "postgresql://postgres@127.0.0.1:%d/postgres" % self.port, autocommit=True)

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
        if getattr(self, "conn", None) is not None:
            self.conn.close()
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.cluster.version,
                        self.cluster.name, "stop", "-m", "immediate"], capture_output=True)
        if getattr(self, "proc", None) is not None:
            self.proc.wait(60)
        self.cluster.drop()
        shutil.rmtree(self.counts, ignore_errors=True)


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
