"""PostgreSQL server instructions per job, counted by valgrind's callgrind, for one or more
source trees and PgQueuer: ``python -m bench.server_instructions --tree /work/base --tree .
[--tasks 2000] [--batch 1 --batch 100] [--pgqueuer] [--sql "DROP INDEX ..."] [--json FILE]``.

bench/instructions.py counts a runner's own work; on PostgreSQL about half of a job's CPU
is the server's, and timing it (bench/perjob.py) swings by +-20 % on a shared machine. This
counts it: a throwaway cluster (tests/servers.py's) whose postmaster runs under callgrind
(each backend it forks writes its own count when it exits), autovacuum off. Per tree: its
own database (``init-db``, N no-op tasks from bench/backlog.py, ANALYZE), then ``taskrunner runner
--burst`` from that tree; the backends that served the runner are the ones that wrote their
count while it ran. The figure is their instructions minus those of the same run with no
task, per task: the statements the tree sends per job, as the wire protocol carries them,
with the tree's own schema. Only user space is counted (a commit's fsync is the kernel's).
``--sql`` runs a statement on every database after its backlog (to weigh an index, say).
``--batch B`` (repeatable): the runner with ``[runner] batch = B``. ``--marginal``: the
figure is a drain of 2N minus a drain of N instead, per task: the cost of a job once the
connection is open and its statements are planned once for all (psycopg prepares a
statement on its 5th execution, and PostgreSQL plans each of the first 5 executions of a
prepared statement before it settles on a generic plan: about 10 claims of a batched runner
are planned, 5 of PgQueuer's, whatever N), which a drain of N from none charges to the N
jobs. With autovacuum off it is no steady state for PgQueuer: its 2N drain cost 4 times its
N drain (1,963M against 511M instructions at N = 1,000, B = 100; s22). ``--keep DIR``
copies each measured run's callgrind files into a directory of DIR of their own (named in
the output), for callgrind_annotate: where in the server the instructions go.

What moves the figure between runs of one tree: a batched runner writes its successes when
B wait or ``flush_interval`` (5 ms) after the first finished, and re-reads its claimed runs
with them, so on a loaded machine (the client slower, the server under callgrind) it sends
more statements per job — 71 and 111 statements per 1,000 jobs at B = 100 in two runs of
one tree (s22; PortalRun's calls in its backend's callgrind file), 514k and 604k per job; and the runner's second connection (its
heartbeat thread) is in the figure, not in the run with no task. bench/server_phases.py
counts the claim and the success apart, each batch exactly B, and repeats to the instruction.

``--pgqueuer`` (the bench extra): beside each B, PgQueuer's worker as the timed bench runs
it (bench/pgqueuer_app.py: one QueueManager on one asyncpg connection, ``batch_size = B``,
its continuous mode) on a database of its own (its install, N no-op jobs from its enqueue,
ANALYZE), stopped (SIGTERM) once its log holds N successes and its connection waits idle
after its last probe of the queue (``has_queued_work``), minus the same run with no job,
stopped once it first waits so. Its run ends by a signal, not by itself, so the bench
watches it on a connection of its own, whose backend's count is left out. PgQueuer's
time-driven work (its heartbeat flushes, its log aggregation every 30 s) over the longer
run is in its figure.
Runs as root with Debian's PostgreSQL (pg_createcluster) and valgrind; about two minutes
per tree at the default N.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from bench import common
from bench.ab import run_in_tree
from bench.backlog import add_backlog
from bench.instructions import CONFIG, SUMMARY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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

    def instructions(self, files, but=()):
        """The instructions of the backends whose counts are `files`, but the pids `but`."""
        total = 0
        for name in files:
            if int(name.rsplit(".", 1)[1]) in but:
                continue
            with open(os.path.join(self.counts, name)) as fh:
                found = SUMMARY.search(fh.read())
            total += int(found.group(1)) if found else 0
        return total

    def keep(self, files, into):
        os.makedirs(into, exist_ok=True)
        for name in files:
            shutil.copy(os.path.join(self.counts, name), into)

    def close(self):
        if getattr(self, "conn", None) is not None:
            self.conn.close()
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.cluster.version,
                        self.cluster.name, "stop", "-m", "immediate"], capture_output=True)
        if getattr(self, "proc", None) is not None:
            self.proc.wait(60)
        self.cluster.drop()
        shutil.rmtree(self.counts, ignore_errors=True)


def served(cluster, root, count, scratch, sql=None, batch=1, keep=None):
    """Instructions of the backends that served `taskrunner runner --burst` of the tree at
    `root` with `[runner] batch` draining `count` no-op tasks."""
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
        fh.write(CONFIG + "batch = %d\n" % batch)
    before = cluster.written()
    run_in_tree(root, [sys.executable, "-m", "taskrunner", "--config", config, "--database",
                       url, "--log-level", "warning", "runner", "--burst"],
                check=True, capture_output=True, timeout=3600)
    cluster.wait_gone(idle)
    if keep:
        cluster.keep(cluster.written() - before, keep)
    return cluster.instructions(cluster.written() - before)


def pgqueuer_served(cluster, count, scratch, batch, keep=None):
    """Instructions of the backends that served bench/pgqueuer_app.py's worker with
    `batch_size` `batch` draining `count` no-op jobs."""
    from bench import pgqueuer_app
    from pgqueuer.adapters.persistence.qb import QueryQueueBuilder
    from bench.systems import PgQueuer
    waiting = " ".join(QueryQueueBuilder().build_has_queued_work().split())
    name = "pgq_%d_%d" % (os.getpid(), time.monotonic_ns())
    idle = cluster.backends()
    url = cluster.database(name)
    pgqueuer_app.install(url)
    if count:
        pgqueuer_app.enqueue(url, count)
    with common.connect(url, autocommit=True) as conn:
        conn.cursor().execute("ANALYZE")
    cluster.wait_gone(idle)
    before = cluster.written()
    watch = common.connect(url, autocommit=True)
    cursor = watch.cursor()
    cursor.execute("SELECT pg_backend_pid()")
    watcher = cursor.fetchone()[0]

    def drained():
        cursor.execute(PgQueuer.DONE)
        if cursor.fetchone()[0] < count:
            return False
        cursor.execute("SELECT state, query FROM pg_stat_activity WHERE datname = "
                       "current_database() AND backend_type = 'client backend' AND pid <> "
                       "pg_backend_pid()")
        rows = cursor.fetchall()
        return len(rows) == 1 and rows[0][0] == "idle" and " ".join(rows[0][1].split()) == waiting
    env = common.child_env()
    env["BENCH_LOG_LEVEL"] = "warning"
    proc = common.spawn([sys.executable, "-m", "bench.pgqueuer_app", "work", url, str(batch),
                         os.path.join(scratch, name + ".marks")], "pgqueuer.log", env=env)
    try:
        common.wait_until(drained, 3600, "PgQueuer to run %d jobs" % count, interval=0.1,
                          procs=[proc])
    finally:
        common.stop(proc)
        watch.close()
    cluster.wait_gone(idle)
    if keep:
        cluster.keep(cluster.written() - before, keep)
    return cluster.instructions(cluster.written() - before, but={watcher})


def _keep(directory, name):
    """Where the callgrind files of the run `name` go (none without --keep)."""
    if not directory:
        return None
    return os.path.join(os.path.abspath(directory), name)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree's root (repeatable)")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--batch", type=int, action="append",
                        help="[runner] batch (and PgQueuer's batch_size); repeatable, default 1")
    parser.add_argument("--pgqueuer", action="store_true",
                        help="PgQueuer too (skipped, saying why, without the bench extra)")
    parser.add_argument("--sql", help="a statement run on each database after its backlog")
    parser.add_argument("--marginal", action="store_true",
                        help="per job: a drain of 2N minus one of N (steady state), not N "
                             "minus none")
    parser.add_argument("--keep", help="copy the callgrind files of each run under this "
                        "directory")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    batches = args.batch or [1]
    base = args.tasks if args.marginal else 0
    if args.tasks < 1 or min(batches) < 1:
        parser.error("--tasks and --batch must be positive")
    for tree in args.tree:
        if not os.path.isdir(os.path.join(tree, "taskrunner")):
            parser.error("--tree %s: no taskrunner package there" % tree)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed")
    if os.geteuid() != 0:
        parser.error("run as root (the cluster runs as the postgres user)")
    pgqueuer = args.pgqueuer
    if pgqueuer:
        from bench.systems import PgQueuer
        why = PgQueuer(1).available("postgresql")
        if why:
            print("pgqueuer skipped: %s" % why, file=sys.stderr)
            pgqueuer = False
    common.install_signal_cleanup()
    cluster, scratch = Cluster(), tempfile.mkdtemp(prefix="trbench-srv-")
    results = []
    try:
        version = common.query("postgresql://postgres@127.0.0.1:%d/postgres" % cluster.port,
                               "SHOW server_version")[0][0]
        for batch in batches:
            for tree in args.tree:
                root = os.path.abspath(tree)
                keep = _keep(args.keep, "%s-b%d" % (os.path.basename(root), batch))
                empty = served(cluster, root, base, scratch, args.sql, batch,
                               keep and keep + "-base")
                full = served(cluster, root, base + args.tasks, scratch, args.sql, batch, keep)
                results.append({"system": "taskrunner", "tree": root, "batch": batch,
                                "instructions_per_job": round((full - empty) / args.tasks)})
                print("%-40s batch %d, server: %.0fk instructions per job" % (
                    root, batch, (full - empty) / args.tasks / 1000), flush=True)
            if pgqueuer:
                keep = _keep(args.keep, "pgqueuer-b%d" % batch)
                empty = pgqueuer_served(cluster, base, scratch, batch, keep and keep + "-base")
                full = pgqueuer_served(cluster, base + args.tasks, scratch, batch, keep)
                peer = {"system": "pgqueuer", "batch": batch,
                        "instructions_per_job": round((full - empty) / args.tasks)}
                print("%-40s batch %d, server: %.0fk instructions per job" % (
                    "pgqueuer", batch, peer["instructions_per_job"] / 1000), flush=True)
                for r in results:
                    if r["batch"] == batch:
                        r["over_pgqueuer"] = common.ratio(r["instructions_per_job"],
                                                          peer["instructions_per_job"])
                        print("%-40s batch %d, taskrunner / pgqueuer: %.3f" % (
                            r["tree"], batch, r["over_pgqueuer"]), flush=True)
                results.append(peer)
    finally:
        cluster.close()
        common.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    common.write_json(args.json, {"machine": common.machine(), "tasks": args.tasks,
                                  "marginal": args.marginal,
                                  "postgresql": version,
                                  "pgqueuer": common.package_version("pgqueuer"),
                                  "load_average": os.getloadavg(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
