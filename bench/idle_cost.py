"""What an idle fleet costs the database: statements per second from H overseers (separate
processes, each its own ``[runner] host_id``) × R runners on one PostgreSQL database, with
no task to run — this tree against another one (``--other``, e.g. main before the
maintenance lease), in one invocation, the two alternating round by round.

The server is a throwaway cluster (pg_createcluster, root) with pg_stat_statements loaded:
the figure is the growth of pg_stat_statements.calls for the fleet's database over the
window (BEGIN/COMMIT included), with pg_stat_database.xact_commit beside it, and the
statements that make up most of it.

    sudo python bench/idle_cost.py --hosts 20 --runners 8 --other /work/main \\
        --json bench/results/2026-11-23-idle-cost.json
"""
import argparse
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench import common  # noqa: E402


def make_cluster(max_connections):
    """A cluster of its own with pg_stat_statements (tests/servers.py's helper)."""
    from servers import PostgresCluster
    cluster = PostgresCluster()
    try:
        conf = "/etc/postgresql/%s/%s/conf.d/idle-cost.conf" % (cluster.version, cluster.name)
        with open(conf, "w") as fh:
            fh.write("shared_preload_libraries = 'pg_stat_statements'\n"
                     "pg_stat_statements.track = all\nmax_connections = %d\n" % max_connections)
        cluster.ctl("restart")
        admin = "postgresql://postgres@127.0.0.1:%d/postgres" % cluster.port
        execute(admin, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    except BaseException:
        cluster.drop()
        raise
    return cluster, admin


def execute(url, sql):
    conn = common.connect(url, autocommit=True)
    try:
        conn.cursor().execute(sql)
    finally:
        conn.close()


def tree_env(tree):
    env = dict(os.environ)
    env["PYTHONPATH"] = tree
    env.pop("TASKRUNNER_CONFIG", None)
    env.pop("TASKRUNNER_DATABASE_URL", None)
    return env


def counters(admin, dbname):
    """(statements, commits, {query: calls}) of database `dbname` so far."""
    rows = common.query(admin, "SELECT s.query, s.calls FROM pg_stat_statements s "
                        "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = ?", (dbname,))
    commits = common.query(admin, "SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = ?", (dbname,))[0][0]
    by_query = {}
    for text, calls in rows:
        by_query[text] = by_query.get(text, 0) + calls
    return sum(by_query.values()), commits, by_query


# What each statement is for, by a fragment of its text (first match wins).
CATEGORIES = (
    ("runner polls", '"t1"."paused", EXISTS'),
    ("heartbeats", 'UPDATE "task_runners" SET "heartbeat_on"'),
    ("lease", '"task_leases"'),
    ("overseer's slot counts", 'AND ("t1"."slot" IS NOT NULL)'),
    ("overseer's slot counts", 'FROM "task_runner_queues"'),
)
OTHER = "maintenance (PIDs, heartbeats of others, overdue/due runs, periodic)"


def category(text):
    return next((name for name, fragment in CATEGORIES if fragment in text), OTHER)


def run_fleet(label, tree, url, admin, hosts, runners, warmup, seconds):
    """Start the fleet from `tree`, wait for every runner, let it settle, measure, stop."""
    dbname = url.rsplit("/", 1)[1]
    procs = []
    started = time.monotonic()
    try:
        for h in range(hosts):
            config = common.write_config(url, runners, "%s-host-%02d" % (label, h),
                                         runner={"host_id": "%s-host-%02d" % (label, h)})
            procs.append(common.spawn([sys.executable, "-m", "taskrunner", "--config", config,
                                       "overseer"], "%s-host-%02d.log" % (label, h),
                                      env=tree_env(tree)))
        sql = ("SELECT count(*) FROM task_runners WHERE kind = 'runner' "
               "AND status = 'running'")
        common.wait_until(lambda: common.query(url, sql)[0][0] >= hosts * runners,
                          timeout=300, what="%d runners (%s)" % (hosts * runners, label),
                          interval=1.0, procs=procs)
        up = time.monotonic() - started
        time.sleep(warmup)
        s0, c0, q0 = counters(admin, dbname)
        t0 = time.monotonic()
        time.sleep(seconds)
        s1, c1, q1 = counters(admin, dbname)
        elapsed = time.monotonic() - t0
    finally:
        for proc in procs:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            common.stop(proc, signal.SIGTERM, grace=20)
    grown = sorted(((q1[q] - q0.get(q, 0), q) for q in q1), reverse=True)
    by_category = {}
    for n, q in grown:
        by_category[category(q)] = by_category.get(category(q), 0) + n
    return {"variant": label, "tree": tree, "seconds": round(elapsed, 2),
            "start_seconds": round(up, 1),
            "statements_per_s": round((s1 - s0) / elapsed, 1),
            "commits_per_s": round((c1 - c0) / elapsed, 1),
            "per_s_by_category": {name: round(n / elapsed, 1)
                                  for name, n in sorted(by_category.items())},
            "statements_per_s_by_query": [{"per_s": round(n / elapsed, 2), "query": q[:200]}
                                          for n, q in grown if n / elapsed >= 0.05]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=20)
    parser.add_argument("--runners", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=10.0, help="settling after start")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--other", required=True, help="the tree to compare with (e.g. main)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    common.install_signal_cleanup()
    trees = {"this": ROOT, "other": os.path.abspath(args.other)}
    # A runner holds two connections (its own, its heartbeat thread's), an overseer one.
    cluster, admin = make_cluster(max(200, args.hosts * (1 + 2 * args.runners) + 50))
    results = []
    try:
        urls = {}
        for label, tree in trees.items():
            urls[label] = "postgresql://postgres@127.0.0.1:%d/idle_%s" % (cluster.port, label)
            execute(admin, "CREATE DATABASE idle_%s" % label)
            subprocess.run([sys.executable, "-m", "taskrunner", "--database", urls[label],
                            "init-db"], env=tree_env(tree), check=True, cwd="/tmp",
                           capture_output=True)
        for round_ in range(args.rounds):
            order = ("other", "this") if round_ % 2 == 0 else ("this", "other")
            for label in order:
                result = run_fleet(label, trees[label], urls[label], admin, args.hosts,
                                   args.runners, args.warmup, args.seconds)
                result["round"] = round_
                results.append(result)
                print("round %d %-5s: %8.1f statements/s, %7.1f commits/s (fleet up in %.0fs)"
                      % (round_, label, result["statements_per_s"], result["commits_per_s"],
                         result["start_seconds"]), flush=True)
                for name, rate in result["per_s_by_category"].items():
                    print("    %8.1f/s %s" % (rate, name))
    finally:
        common.cleanup()
        cluster.drop()
    summary = {}
    for label in trees:
        rates = [r["statements_per_s"] for r in results if r["variant"] == label]
        categories = {name for r in results for name in r["per_s_by_category"]}
        summary[label] = {"statements_per_s_median": common.median(rates),
                          "per_s_by_category_median": {name: common.median([
                              r["per_s_by_category"].get(name, 0.0) for r in results
                              if r["variant"] == label]) for name in sorted(categories)},
                          "commits_per_s_median": common.median(
                              [r["commits_per_s"] for r in results if r["variant"] == label])}
    ratio = common.ratio(summary["other"]["statements_per_s_median"],
                         summary["this"]["statements_per_s_median"])
    print("idle fleet %d hosts x %d runners: other/this statements ratio %s"
          % (args.hosts, args.runners, ratio))
    report = {"scenario": "idle_cost", "hosts": args.hosts, "runners": args.runners,
              "seconds": args.seconds, "warmup": args.warmup, "trees": trees,
              "server": "PostgreSQL %s (throwaway cluster, pg_stat_statements)" % cluster.version,
              "summary": summary, "ratio_other_over_this": ratio, "runs": results}
    common.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
