"""WAL bytes and row versions per job on PostgreSQL, counted, for one or more source trees
and PgQueuer at the same batch sizes: ``python -m bench.wal --tree /work/base --tree .
[--tasks 4000] [--batch 1 --batch 100] [--pgqueuer] [--json FILE]``.

What a queue writes per job is what its server must log, replicate, vacuum and back up; it
repeats exactly between runs where a time swings by +-20 %. Everything runs on a throwaway
cluster (tests/servers.py's, as bench/server_instructions.py's): the shared server's WAL
carries every other database's writes too. The cluster has autovacuum off (vacuum's WAL is
not in the figures; the dead row versions it will have to clean are), no timed checkpoint
(checkpoint_timeout 1 day, max_wal_size 10 GB) and, as tests/servers.py makes it, fsync off
(which changes no WAL byte). Per system and batch size B: its own database, its schema
(``init-db`` of the tree; PgQueuer's install), then two phases, each begun by a
``CHECKPOINT`` and measured from ``pg_current_wal_lsn()`` before to after, once every client
backend has gone (a backend flushes its table statistics before it leaves
pg_stat_activity; ``pg_stat_clear_snapshot()`` before each read):

- add: N no-op jobs queued in bulk (taskrunner: bench/backlog.py's set-based INSERT, which
  stores what ``add_tasks()`` stores; PgQueuer: its ``enqueue`` of 5,000-job arrays), then
  ANALYZE (bench/backlog.py's, as autovacuum would; PgQueuer's tables alike);
- drain: one worker process until every job has run (taskrunner: ``taskrunner runner
  --burst`` of the tree with ``[runner] batch = B``; PgQueuer: bench/pgqueuer_app.py's worker
  with ``batch_size = B``, stopped once its log holds N successes).

Full-page images: the first change of a page after a checkpoint logs the whole page, so a
phase's WAL depends on how many pages it touches (wider rows, more pages) and on how often
the server checkpoints. Both phases start right after a checkpoint, for every side alike,
and the figures give the WAL with and without them (pg_walinspect's ``pg_get_wal_stats``
splits the records' bytes from the images'): with them is the worst case, a checkpoint
before every drain; without them is the limit of a long drain between two checkpoints.

Row versions are the tables' ``n_tup_ins + n_tup_upd + n_tup_del`` (pg_stat_user_tables,
every table of the database), with HOT updates (which write no index entry) apart. The
JSON keeps each phase's counters by table and its WAL by record type (totals, not per job),
which say where a difference comes from. Runs as
root with Debian's PostgreSQL (pg_createcluster); about a minute per side at N = 4,000.
"""
import argparse
import os
import shutil
import sys
import tempfile

from bench import common
from bench.ab import run_in_tree
from bench.backlog import add_backlog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The throwaway cluster's settings (ALTER SYSTEM; each takes a reload only).
SETTINGS = {"autovacuum": "off", "checkpoint_timeout": "1d", "max_wal_size": "10GB"}
COUNTERS = ("n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del")
OTHER_CLIENTS = ("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                 "AND pid <> pg_backend_pid()")


class Cluster:
    """tests/servers.py's throwaway cluster with SETTINGS, dropped by close()."""

    def __init__(self):
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from servers import PostgresCluster
        self.cluster = PostgresCluster()
        try:
            with common.connect(self.url("postgres"), autocommit=True) as conn:
                for name, value in SETTINGS.items():
                    conn.execute("ALTER SYSTEM SET %s = '%s'" % (name, value))
                conn.execute("SELECT pg_reload_conf()")
        except BaseException:
            self.close()
            raise

    def url(self, name):
        return "postgresql://postgres@127.0.0.1:%d/%s" % (self.cluster.port, name)

    def database(self):
        return self.cluster.new_database()

    def close(self):
        self.cluster.drop()


def _reading(conn):
    """(insert LSN, {table: counters}) once every other client backend has gone."""
    common.wait_until(lambda: conn.execute(OTHER_CLIENTS).fetchone()[0] == 0, 120,
                      "the clients' backends to exit", interval=0.05)
    conn.execute("SELECT pg_stat_clear_snapshot()")
    tables = {row[0]: row[1:] for row in conn.execute(
        "SELECT relname, %s FROM pg_stat_user_tables" % ", ".join(COUNTERS))}
    return conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0], tables


def phase(conn, act, jobs):
    """Per job of what `act()` wrote, from a checkpoint to the exit of its last backend."""
    conn.execute("CHECKPOINT")
    start, before = _reading(conn)
    act()
    end, after = _reading(conn)
    wal = conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (end, start)).fetchone()[0]
    # Its first column: "resource_manager/record_type" (PostgreSQL 15), e.g. Heap/UPDATE.
    kinds = {row[0]: {"records": row[1], "record_bytes": row[3], "fpi_bytes": row[5]}
             for row in conn.execute("SELECT * FROM pg_get_wal_stats(%s::pg_lsn, %s::pg_lsn, "
                                     "true) AS w WHERE w.count > 0", (start, end))}
    records = sum(k["record_bytes"] for k in kinds.values())
    images = sum(k["fpi_bytes"] for k in kinds.values())
    tables = {name: {c: value - (before.get(name) or (0,) * 4)[i]
                     for i, (c, value) in enumerate(zip(COUNTERS, counts))}
              for name, counts in after.items()}
    changed = {name: counts for name, counts in tables.items() if any(counts.values())}
    versions = sum(t["n_tup_ins"] + t["n_tup_upd"] + t["n_tup_del"] for t in changed.values())
    return {"wal_bytes": float(wal) / jobs, "wal_bytes_without_fpi": float(wal - images) / jobs,
            "fpi_bytes": float(images) / jobs, "record_bytes": float(records) / jobs,
            "row_versions": versions / jobs,
            "hot_updates": sum(t["n_tup_hot_upd"] for t in changed.values()) / jobs,
            "tables": changed, "wal_records": kinds}


class Tree:
    """taskrunner from the source tree at `root`."""

    def __init__(self, root):
        self.root, self.name = root, "taskrunner " + root

    def install(self, url):
        self._taskrunner(url, "init-db")

    def add(self, url, jobs):
        add_backlog(url, jobs)

    def drain(self, url, jobs, batch, scratch):
        config = os.path.join(scratch, "batch%d.toml" % batch)
        with open(config, "w") as fh:
            fh.write("[runner]\nbatch = %d\n" % batch)
        self._taskrunner(url, "--config", config, "--log-level", "warning", "runner", "--burst")
        done = common.query(url, "SELECT count(*) FROM task_runs WHERE status = 'success'")[0][0]
        if done != jobs:
            raise RuntimeError("%s ran %d of %d jobs" % (self.name, done, jobs))

    def _taskrunner(self, url, *argv):
        command = [sys.executable, "-m", "taskrunner", "--database", url] + list(argv)
        done = run_in_tree(self.root, command, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(command), done.returncode,
                                                       done.stderr[-2000:]))


class PgQueuer:
    """bench/pgqueuer_app.py: its install, its enqueue, one worker."""
    name = "pgqueuer"

    def install(self, url):
        from bench import pgqueuer_app
        pgqueuer_app.install(url)

    def add(self, url, jobs):
        from bench import pgqueuer_app
        pgqueuer_app.enqueue(url, jobs)
        with common.connect(url, autocommit=True) as conn:
            conn.execute("ANALYZE")

    def drain(self, url, jobs, batch, scratch):
        from bench.systems import PgQueuer as Peer
        env = common.child_env()
        env["BENCH_LOG_LEVEL"] = "warning"
        proc = common.spawn([sys.executable, "-m", "bench.pgqueuer_app", "work", url, str(batch),
                             os.path.join(scratch, "pgq-%d.marks" % batch)], "pgqueuer.log",
                            env=env)
        try:
            common.wait_until(lambda: common.query(url, Peer.DONE)[0][0] >= jobs, 3600,
                              "PgQueuer to run %d jobs" % jobs, interval=0.2, procs=[proc])
        finally:
            common.stop(proc)


def measure(cluster, side, jobs, batch, scratch):
    url = cluster.database()
    side.install(url)
    with common.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_walinspect")
        return {"system": side.name, "batch": batch,
                "add": phase(conn, lambda: side.add(url, jobs), jobs),
                "drain": phase(conn, lambda: side.drain(url, jobs, batch, scratch), jobs)}


def table(results):
    """Rows of the report: each result, and its drain over PgQueuer's at its batch size."""
    peers = {r["batch"]: r["drain"] for r in results if r["system"] == "pgqueuer"}
    rows = []
    for r in results:
        drain, peer = r["drain"], peers.get(r["batch"])
        rows.append([r["system"], r["batch"]] + ["%.0f" % drain[k] for k in (
            "wal_bytes", "wal_bytes_without_fpi", "fpi_bytes")]
            + ["%.2f" % drain[k] for k in ("row_versions", "hot_updates")]
            + ["%.3f" % common.ratio(drain[k], peer[k]) if peer else "-"
               for k in ("wal_bytes", "wal_bytes_without_fpi", "row_versions")]
            + ["%.0f" % r["add"]["wal_bytes"], "%.2f" % r["add"]["row_versions"]])
    return rows


HEADERS = ["system", "batch", "WAL B/job", "no-FPI B/job", "FPI B/job", "rows/job", "HOT/job",
           "WAL/pgq", "no-FPI/pgq", "rows/pgq", "add WAL B/job", "add rows/job"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree's root (repeatable)")
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--batch", type=int, action="append",
                        help="a batch size (repeatable; default 1)")
    parser.add_argument("--pgqueuer", action="store_true",
                        help="PgQueuer too (skipped, saying why, without the bench extra)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    batches = args.batch or [1]
    if args.tasks < 1 or min(batches) < 1:
        parser.error("--tasks and --batch must be positive")
    if os.geteuid() != 0:
        parser.error("run as root (the cluster is made with pg_createcluster)")
    for tree in args.tree:
        if not os.path.isdir(os.path.join(tree, "taskrunner")):
            parser.error("--tree %s: no taskrunner package there" % tree)
    sides = [Tree(os.path.abspath(tree)) for tree in args.tree]
    if args.pgqueuer:
        from bench.systems import PgQueuer as Peer
        why = Peer(1).available("postgresql")
        if why:
            print("pgqueuer skipped: %s" % why, file=sys.stderr)
        else:
            sides.append(PgQueuer())
    common.install_signal_cleanup()
    cluster, scratch = Cluster(), tempfile.mkdtemp(prefix="trbench-wal-")
    results = []
    try:
        version = common.query(cluster.url("postgres"), "SHOW server_version")[0][0]
        for batch in batches:
            for side in sides:
                results.append(measure(cluster, side, args.tasks, batch, scratch))
                drain = results[-1]["drain"]
                print("%-40s batch %d: %.0f WAL bytes, %.2f row versions per job" % (
                    side.name, batch, drain["wal_bytes"], drain["row_versions"]), flush=True)
    finally:
        cluster.close()
        common.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    common.print_table("WAL and row versions per job, PostgreSQL %s, %d jobs, one worker"
                       % (version, args.tasks), HEADERS, table(results),
                       "drain: a worker from a checkpoint until every job ran; add: the "
                       "bulk enqueue and ANALYZE; /pgq: over PgQueuer's drain at that batch")
    common.write_json(args.json, {"tasks": args.tasks, "postgresql": version,
                                  "settings": SETTINGS, "load_average": os.getloadavg(),
                                  "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
