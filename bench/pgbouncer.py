"""taskrunner on PostgreSQL through PgBouncer (transaction pooling) against direct connections.

Two scenarios, each on fresh databases of the PostgreSQL server the bench uses
(BENCH_POSTGRES_URL), with a PgBouncer of its own (Debian's `pgbouncer`, tests/servers.py)
on a free port:

- throughput: one overseer of --runners runners drains --tasks no-op tasks, directly and
  through a PgBouncer of --pool server connections, the two alternating for --rounds rounds
  (the machine is noisy: the ratio is taken per round, then the median);
- fleet: --hosts overseers (host ids of their own) of --per-host runners each — 400 by
  default, four times PostgreSQL's default max_connections — through a PgBouncer capped at
  --fleet-pool server connections (default_pool_size and max_db_connections); they drain
  --fleet-tasks tasks while pg_stat_activity is sampled every 20 ms. Reported: the most
  server connections seen, runs per task (exactly once), start-up and drain times.

    python bench/pgbouncer.py --json bench/results/2026-11-23-pgbouncer.json
"""
import argparse
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench import common  # noqa: E402
from bench.backlog import queue_backlog  # noqa: E402
from bench.common import (OverseerProcess, connect, create_database, finish_times,  # noqa: E402
                          median, query, rates, ratio, wait_until)
from servers import PgBouncer  # noqa: E402


def _through(bouncer, url):
    return bouncer.url(url.rsplit("/", 1)[1])


def _pooled(bouncer, url):
    return {"url": _through(bouncer, url), "pooler": "pgbouncer"}


def drain(url, runners, tasks, label, database=None):
    """One overseer of `runners` drains `tasks` queued no-op tasks on `url` (the database
    section `database` when given: through the pooler). Returns its rates."""
    queue_backlog(url, tasks)
    sections = {"database": database} if database else {}
    overseer = OverseerProcess(url, runners, label, **sections).start()
    try:
        overseer.wait_done(tasks, timeout=120 + tasks / 10)
    finally:
        overseer.stop()
    return rates(overseer.launched, finish_times(url))


def throughput(bouncer, runners, tasks, rounds):
    runs = {"direct": [], "pgbouncer": []}
    for r in range(rounds):
        order = ("direct", "pgbouncer") if r % 2 == 0 else ("pgbouncer", "direct")
        for way in order:
            url = create_database("postgresql", "pgb")
            try:
                runs[way].append(drain(url, runners, tasks, "%s-%d" % (way, r),
                                       _pooled(bouncer, url) if way == "pgbouncer" else None))
            finally:
                common.drop_url(url)
            print("  round %d %-9s %7.1f jobs/s" % (r + 1, way, runs[way][-1]["jobs_per_s"]),
                  flush=True)
    result = {"runners": runners, "tasks": tasks, "rounds": rounds, "runs": runs}
    for key in ("jobs_per_s", "steady_jobs_per_s"):
        result[key] = {way: median([m[key] for m in per]) for way, per in runs.items()}
        result[key]["pgbouncer_over_direct"] = round(median(
            [ratio(p[key], d[key]) for p, d in zip(runs["pgbouncer"], runs["direct"])]), 3)
    return result


# The application_name of the bench's own direct connections, which the sampler leaves out.
BENCH = "trbench"


class Sampler(threading.Thread):
    """The most connections to database `name` in pg_stat_activity (but the bench's own),
    every 20 ms."""

    def __init__(self, name):
        super().__init__(daemon=True)
        self.name, self.most, self.samples = name, 0, 0
        self.stopping = threading.Event()

    def run(self):
        conn = connect(common.PG_ADMIN_URL, autocommit=True)
        try:
            while not self.stopping.wait(0.02):
                count = query(common.PG_ADMIN_URL, "SELECT count(*) FROM pg_stat_activity "
                              "WHERE datname = ? AND application_name <> ?",
                              (self.name, BENCH), conn=conn)[0][0]
                self.most, self.samples = max(self.most, count), self.samples + 1
        finally:
            conn.close()


def fleet(cap, hosts, per_host, tasks):
    bouncer = PgBouncer(common.PG_ADMIN_URL, pool_size=cap, max_db_connections=cap,
                        max_client_conn=hosts * per_host * 2 + 100)
    url = create_database("postgresql", "fleet")
    direct = url + "?application_name=" + BENCH
    common.make_queue(direct).close()            # the schema, directly
    sampler = Sampler(url.rsplit("/", 1)[1])
    sampler.start()
    overseers = []
    try:
        launched = time.time()
        for host in range(hosts):
            overseers.append(OverseerProcess(
                url, per_host, "fleet-%d" % host, database=_pooled(bouncer, url),
                runner={"host_id": "bench-host-%d" % host}).start())
        sql = "SELECT count(*) FROM task_runners WHERE kind = 'runner' AND status = 'running'"
        wait_until(lambda: query(direct, sql)[0][0] >= hosts * per_host, 300,
                   "%d runners up" % (hosts * per_host), interval=0.5,
                   procs=[o.proc for o in overseers])
        up = time.time() - launched
        added = time.time()
        common.add_noop_tasks(direct, tasks)
        wait_until(lambda: query(direct, "SELECT count(*) FROM task_runs WHERE status = 'success'")
                   [0][0] >= tasks, 120 + tasks / 10, "%d runs done" % tasks, interval=0.2,
                   procs=[o.proc for o in overseers])
        done = rates(added, finish_times(direct))
        twice = query(direct, "SELECT count(*) FROM (SELECT task_id FROM task_runs GROUP BY task_id "
                           "HAVING count(*) > 1) AS t")[0][0]
        runs = query(direct, "SELECT count(*), count(DISTINCT runner_id) FROM task_runs")[0]
    finally:
        for overseer in overseers:
            overseer.stop()
        sampler.stopping.set()
        sampler.join(10)
        common.drop_url(url)
        bouncer.stop()
    return {"runners": hosts * per_host, "hosts": hosts, "server_connection_cap": cap,
            "tasks": tasks, "runs": runs[0], "tasks_run_more_than_once": twice,
            "runners_that_ran": runs[1], "most_server_connections": sampler.most,
            "samples": sampler.samples, "seconds_to_start": round(up, 1), "drain": done}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", type=int, default=32)
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=100)
    parser.add_argument("--fleet-pool", type=int, default=40)
    parser.add_argument("--fleet-tasks", type=int, default=4000)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = {"postgresql": common.server_version("postgresql"), "cpus": os.cpu_count(),
              "load_average_at_start": os.getloadavg()}
    try:
        if not args.skip_throughput:
            print("throughput: %d runners, %d tasks, direct vs PgBouncer of %d server "
                  "connections" % (args.runners, args.tasks, args.pool), flush=True)
            bouncer = PgBouncer(common.PG_ADMIN_URL, pool_size=args.pool,
                                max_db_connections=args.pool)
            try:
                report["throughput"] = throughput(bouncer, args.runners, args.tasks, args.rounds)
                report["throughput"]["server_connection_cap"] = args.pool
            finally:
                bouncer.stop()
            print(json.dumps({k: report["throughput"][k]
                              for k in ("jobs_per_s", "steady_jobs_per_s")}), flush=True)
        print("fleet: %d x %d runners through %d server connections"
              % (args.hosts, args.per_host, args.fleet_pool), flush=True)
        report["fleet"] = fleet(args.fleet_pool, args.hosts, args.per_host, args.fleet_tasks)
        print(json.dumps(report["fleet"]), flush=True)
    finally:
        common.cleanup()
    report["load_average_at_end"] = os.getloadavg()
    common.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
