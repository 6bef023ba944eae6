#!/usr/bin/env python3
"""A fleet on one PostgreSQL: hosts as separate PID/UTS/network namespaces on this machine
(bench/hostnet.py), each running `taskrunner overseer` with R runners, against one
throwaway PostgreSQL cluster reached over a bridge (issue 15).

    python bench/fleet.py [--hosts 20] [--runners 8] [--tasks 50000] [--task-ms 5]
                          [--only idle,run,herd,pgbouncer,failover] [--json FILE]
                          [--set section.key=value ...]

Scenarios, in this order (each optional):
- idle: statements/s, transactions/s and server CPU of the idle fleet over --idle-seconds,
  the statements that make them, memory per host.
- run: --tasks tasks of --task-ms ms queued beforehand (into the paused default queue,
  then resumed): every task executed exactly once (each execution appends a line to a file,
  counted besides the runs), the per-host concurrency sampled while it runs (running runs
  grouped by the runner's host, at most R), jobs/s, server CPU seconds and statements/s,
  USS/PSS/RSS per host, and an extrapolation to --extrapolate hosts.
- herd, pgbouncer: bench/herd.py and bench/pgbouncer.py (other scenarios' own scripts), run
  with --json before the fleet is started, when present; else skipped with a note.
- failover: every runner given a long task with a short run_timeout; then the maintenance
  leader's host (the holder of the lease table's row; host1 when the schema has no lease)
  is killed, every process of it at once with SIGKILL; measured: the time until another
  host holds the lease, until the dead host's overdue runs are timed out, and until its
  runners are found dead.

Statements come from pg_stat_statements (top-level statements, BEGIN/COMMIT included) of
the fleet's database, without the bench's own monitoring queries (made as another role);
server CPU from /proc of the cluster's postmaster and its children. The cluster runs with
fsync off. Exit 0 when every scenario ran; every process is killed and the cluster
dropped at exit, on Ctrl-C and on the watchdog (--max-seconds) too.
"""
import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, fleet_watch, hostnet  # noqa: E402
from bench.fleet_watch import MIB, MONITOR  # noqa: E402
from taskrunner.handler import TaskHandler  # noqa: E402

WORK = "bench.fleet.Work"

SCENARIOS = ("idle", "run", "herd", "pgbouncer", "failover")
EXTERNAL = ("herd", "pgbouncer")     # bench/NAME.py, run before the fleet is started


class Work(TaskHandler):
    """Sleeps data["ms"] milliseconds, then appends "task_id run_id" to the file
    data["log"] (one write with O_APPEND): executions counted outside the database."""

    def handle(self, run):
        time.sleep(run.data["ms"] / 1000.0)
        fd = os.open(run.data["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"%d %d\n" % (run.task_id, run.id))
        finally:
            os.close(fd)


# -- the fleet -----------------------------------------------------------------------------

def host_config(url, n, runners, overrides=()):
    """A host's TOML: [runner] limit, its own host_id, quiet logs; `overrides`:
    ["section.key=value" (TOML value)]."""
    sections = {
        "database": {"url": json.dumps(url)},
        "runner": {"limit": str(runners), "host_id": json.dumps("host%d" % n)},
        "overseer": {},
        "task": {"retry_backoff": "0"},
        "log": {"level": '"warning"'},
    }
    for item in overrides:
        key, value = item.split("=", 1)
        section, name = key.strip().split(".", 1)
        sections.setdefault(section, {})[name] = value.strip()
    return "".join("[%s]\n%s" % (section, "".join("%s = %s\n" % kv for kv in values.items()))
                   for section, values in sections.items())


class Fleet(hostnet.Fleet):
    """hostnet.Fleet with pg_stat_statements on, a monitoring role, and the hosts started
    from host_config()."""

    def __init__(self, hosts, runners, workdir, overrides=(), env=None):
        # On a direct connection a host holds 2 × runners + 1 (a runner's heartbeat thread
        # has its own); room for that, the bench's own and PostgreSQL's reserve.
        settings = {"max_connections": max(400, hosts * (2 * runners + 1) + 40),
                    "shared_preload_libraries": "'pg_stat_statements'",
                    "pg_stat_statements.max": 10000}
        super().__init__(hosts, workdir, settings=settings, env=env or common.child_env())
        self.runners, self.overrides = runners, list(overrides)

    def __enter__(self):
        super().__enter__()
        try:
            self.cluster.psql("CREATE EXTENSION pg_stat_statements")
            self.cluster.psql("CREATE ROLE %s LOGIN SUPERUSER" % MONITOR)
            self.hosts_url = self.cluster.url
            # The bench's own connections (tasks queued, progress, samples) use another role,
            # left out of what the fleet is measured to cost.
            self.url = self.cluster.url_for(self.cluster.database, MONITOR)
            from taskrunner import TaskQueue
            TaskQueue(self.url, migrate=True).close()
        except BaseException:
            self.close()
            raise
        return self

    def start_all(self, timeout=180):
        for n in range(1, self.size + 1):
            path = os.path.join(self.workdir, "host%d.toml" % n)
            with open(path, "w") as fh:
                fh.write(host_config(self.hosts_url, n, self.runners, self.overrides))
            self.start(n, path)
        expected = self.size * self.runners
        sql = "SELECT count(*) FROM task_runners WHERE kind = 'runner' AND status = 'running'"
        common.wait_until(lambda: common.query(self.url, sql)[0][0] >= expected, timeout,
                          "%d runners on %d hosts" % (expected, self.size), interval=0.5,
                          procs=[h.process for h in self.hosts.values()])

    def monitor(self):
        import psycopg
        return psycopg.connect(self.url, autocommit=True)

    def memory(self):
        """Per host: uss, pss, rss, alone (MiB), summed over its overseer and runners."""
        return {h.hostname: {k: (round(v / MIB, 1) if k != "processes" else v)
                             for k, v in h.memory().items()}
                for h in self.hosts.values() if h.alive()}

    def host_cpu_seconds(self):
        import psutil
        total = 0.0
        for host in self.hosts.values():
            if host.alive():
                for pid in host.processes():
                    try:
                        times = psutil.Process(pid).cpu_times()
                        total += times.user + times.system
                    except psutil.NoSuchProcess:
                        pass
        return total


def _count(url, sql, params=()):
    return common.query(url, sql, params)[0][0]


# -- scenarios -----------------------------------------------------------------------------

def idle(fleet, args):
    """The idle fleet: nothing queued, every runner waiting."""
    time.sleep(args.settle)     # start-up passes (migrations, first checks) are over
    counters = fleet_watch.Counters(fleet)
    try:
        before = counters.snapshot()
        time.sleep(args.idle_seconds)
        result = fleet_watch.Counters.since(before, counters.snapshot())
    finally:
        counters.close()
    result["memory_per_host_mib"] = _memory_summary(fleet.memory())
    result["statements_per_s_per_host"] = round(result["statements_per_s"] / fleet.size, 2)
    return result


def run(fleet, args):
    """args.tasks tasks of args.task_ms ms, queued into the paused queue, then resumed."""
    from taskrunner import TaskQueue
    log = os.path.join(fleet.workdir, "executions.log")
    queue = TaskQueue(fleet.url)
    try:
        queue.pause_queue("default")
        ids = []
        for start in range(0, args.tasks, 5000):
            ids.extend(queue.add_tasks([{"handler": WORK, "data": {"ms": args.task_ms, "log": log}}
                                        for _ in range(min(5000, args.tasks - start))]))
        counters = fleet_watch.Counters(fleet)
        sampler = fleet_watch.ConcurrencySampler(fleet)
        sampler.start()
        before, host_cpu = counters.snapshot(), fleet.host_cpu_seconds()
        started = time.time()
        queue.resume_queue("default")
        memory = mid = None
        done_sql = "SELECT count(*) FROM task_queue WHERE last_status = 'success'"
        deadline = time.monotonic() + args.run_timeout
        while True:
            done = _count(fleet.url, done_sql)
            if done >= args.tasks:
                break
            if memory is None and done >= args.tasks // 2:
                memory, mid = fleet.memory(), counters.snapshot()
            if time.monotonic() > deadline:
                raise common.BenchTimeout("%d of %d tasks done after %ds"
                                          % (done, args.tasks, args.run_timeout))
            time.sleep(0.5)
        after, host_cpu = counters.snapshot(), fleet.host_cpu_seconds() - host_cpu
        sampler.stop()
        counters.close()
    finally:
        queue.close()
    last = common.to_epoch(common.query(fleet.url, "SELECT max(finished_on) FROM task_runs")[0][0])
    elapsed = last - started
    result = fleet_watch.Counters.since(before, after)
    result["connections"] = (mid or after)["connections"]
    executions = collections.Counter()
    with open(log) as fh:
        for line in fh:
            executions[int(line.split()[0])] += 1
    runs = dict(common.query(fleet.url, "SELECT task_id, count(*) FROM task_runs GROUP BY task_id"))
    overlapping = fleet_watch.most_overlapping(fleet.url)
    result.update({
        "tasks": args.tasks, "task_ms": args.task_ms, "elapsed_s": round(elapsed, 2),
        "jobs_per_s": round(args.tasks / elapsed, 1),
        "executed_once": sum(1 for t in ids if executions[t] == 1),
        "executed_twice_or_more": sum(1 for t in ids if executions[t] > 1),
        "never_executed": sum(1 for t in ids if executions[t] == 0),
        "tasks_with_more_than_one_run": sum(1 for t in ids if runs.get(t, 0) > 1),
        "exactly_once": all(executions[t] == 1 and runs.get(t) == 1 for t in ids),
        "per_host_most_running": dict(sorted(sampler.most.items())),
        "per_host_limit": fleet.runners,
        "per_host_most_overlapping_runs": overlapping,
        "limit_held": bool(sampler.samples and sampler.error is None and overlapping) and all(
            n <= fleet.runners for n in list(sampler.most.values()) + list(overlapping.values())),
        "most_running_in_all": sampler.most_total, "concurrency_samples": sampler.samples,
        "sampler_error": sampler.error,
        "statements_per_job": round(result["statements"] / args.tasks, 2),
        "db_cpu_ms_per_job": round(1000 * result["db_cpu_s"] / args.tasks, 3),
        "hosts_cpu_s": round(host_cpu, 1),
        "hosts_cpu_ms_per_job": round(1000 * host_cpu / args.tasks, 3),
        "memory_per_host_mib": _memory_summary(memory or fleet.memory()),
    })
    result["db_backend_uss_mib"] = fleet_watch.backend_uss(fleet)
    return result


def _memory_summary(memory):
    hosts = list(memory.values())
    summary = {k: round(sum(h[k] for h in hosts) / len(hosts), 1)
               for k in ("uss", "pss", "rss", "alone")}
    summary["processes_per_host"] = hosts[0]["processes"]
    summary["alone_max"] = max(h["alone"] for h in hosts)
    return summary


def extrapolate(report, hosts, runners, to_hosts):
    """What `to_hosts` hosts of `runners` runners would need, from the measured figures:
    connections and idle statements grow with the hosts; memory per host does not; the
    database's CPU per job does not, so its cores bound the fleet's throughput."""
    out = {"hosts": to_hosts, "runners_per_host": runners, "runners": to_hosts * runners}
    run_r, idle_r = report.get("run"), report.get("idle")
    source = run_r if run_r and "error" not in run_r else idle_r
    if source and "error" not in source:
        per_host = source["connections"] / hosts
        out["connections_per_host"] = round(per_host, 2)
        out["connections"] = round(per_host * to_hosts)
        mem = source["memory_per_host_mib"]
        out["memory_per_host_mib"] = {"alone": mem["alone"], "uss": mem["uss"]}
        out["memory_all_hosts_gib"] = round(mem["alone"] * to_hosts / 1024, 1)
    if run_r and "error" not in run_r:
        if run_r.get("db_backend_uss_mib"):
            out["db_backend_memory_gib"] = round(
                run_r["db_backend_uss_mib"] * out["connections"] / 1024, 2)
        cpu = run_r["db_cpu_ms_per_job"]
        out["statements_per_job"] = run_r["statements_per_job"]
        out["jobs_per_s_per_db_core"] = round(1000 / cpu) if cpu else None
        # every runner busy with tasks of this length, if the database kept up:
        demand = to_hosts * runners * 1000.0 / run_r["task_ms"]
        out["jobs_per_s_if_all_busy"] = round(demand)
        out["db_cores_if_all_busy"] = round(demand * cpu / 1000, 1)
        out["statements_per_s_if_all_busy"] = round(demand * run_r["statements_per_job"])
    if idle_r and "error" not in idle_r:
        out["idle_statements_per_s"] = round(idle_r["statements_per_s_per_host"] * to_hosts)
        out["idle_db_cpu_share"] = round(idle_r["db_cpu_share"] * to_hosts / hosts, 2)
    return out


def failover(fleet, args):
    """Kill the maintenance leader's whole host; time the takeover."""
    from taskrunner import TaskQueue
    table, leader = fleet_watch.find_leader(fleet)
    doomed = leader or 1
    result = {"lease_table": table or "no lease", "leader": "host%d" % leader if leader else None,
              "killed": "host%d" % doomed, "run_timeout_s": args.failover_run_timeout}
    log = os.path.join(fleet.workdir, "failover.log")
    with TaskQueue(fleet.url) as queue:
        queue.add_tasks([{"handler": WORK, "data": {"ms": 600000, "log": log},
                          "run_timeout": args.failover_run_timeout, "max_retries": 1}
                         for _ in range(fleet.size * fleet.runners)])
    running_sql = ("SELECT x.id FROM task_runs x JOIN task_runners r "
                   "ON r.id = x.runner_id WHERE x.status = 'running' AND r.host = ?")
    host_like = "host%d" % doomed
    # Every runner of the doomed host busy (or, on a slow machine, as many as after 60 s).
    try:
        common.wait_until(lambda: len(common.query(fleet.url, running_sql, (host_like,)))
                          >= fleet.runners, 60, "runs on %s" % host_like, interval=0.1)
    except common.BenchTimeout:
        pass
    in_flight = common.query(fleet.url, running_sql, (host_like,))
    if not in_flight:
        raise common.BenchTimeout("no run on %s after 60s" % host_like)
    host = fleet.hosts[doomed]
    namespace = host.pid_namespace()
    killed = time.time()
    host.kill()
    common.wait_until(lambda: hostnet.pid_namespace_members(namespace) == [], 10,
                      "every process of %s gone" % host_like)
    # run_timeout counts from a run's last update (its start, or progress written by the
    # host's runner before it died): read now that nothing of the host can write.
    deadlines = {run_id: common.to_epoch(updated) + args.failover_run_timeout
                 for run_id, updated in common.query(
                     fleet.url, "SELECT id, updated_on FROM task_runs WHERE id IN (%s)"
                     % ",".join(str(int(r[0])) for r in in_flight))}
    handled, lease_at, runners_dead_at = {}, None, None
    limit = killed + args.failover_wait
    ids = ",".join(str(i) for i in deadlines)
    while time.time() < limit:
        now = time.time()
        if table and lease_at is None:
            _, holder = fleet_watch.find_leader(fleet)
            if holder is not None and holder != doomed:
                lease_at, result["new_leader"] = now, "host%d" % holder
        for run_id, status in common.query(fleet.url, "SELECT id, status FROM task_runs "
                                           "WHERE id IN (%s)" % ids):
            if status != "running" and run_id not in handled:
                handled[run_id] = now
        if runners_dead_at is None and not _count(
                fleet.url, "SELECT count(*) FROM task_runners WHERE host = ? AND status = "
                "'running'", (host_like,)):
            runners_dead_at = now
        if len(handled) == len(deadlines) and runners_dead_at and (lease_at or not table):
            break
        time.sleep(0.1)
    result.update({
        "runs_in_flight": len(deadlines),
        "lease_taken_over_s": round(lease_at - killed, 2) if lease_at else None,
        "overdue_runs_handled": len(handled),
        "overdue_handled_after_deadline_s": round(max(
            handled[r] - deadlines[r] for r in handled), 2) if handled else None,
        "overdue_handled_after_kill_s": round(max(handled.values()) - killed, 2)
        if handled else None,
        "runners_found_dead_after_kill_s": round(runners_dead_at - killed, 2)
        if runners_dead_at else None,
    })
    return result


def external(name, args):
    """bench/NAME.py, written for its own scenario: run with --json, its report kept."""
    script = os.path.join(common.ROOT, "bench", name + ".py")
    if not os.path.exists(script):
        return {"skipped": "bench/%s.py is not in this tree" % name}
    out = os.path.join(common.workdir(), name + ".json")
    done = subprocess.run([sys.executable, script, "--json", out], env=common.child_env(),
                          capture_output=True, text=True, timeout=args.external_timeout)
    if done.returncode != 0:
        raise RuntimeError("bench/%s.py exited %d: %s" % (name, done.returncode,
                                                          done.stderr.strip()[-500:]))
    with open(out) as fh:
        return json.load(fh)


# -- main ------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=20)
    p.add_argument("--runners", type=int, default=8, help="[runner] limit of each host")
    p.add_argument("--tasks", type=int, default=50000)
    p.add_argument("--task-ms", type=float, default=5.0)
    p.add_argument("--only", default=",".join(SCENARIOS),
                   help="scenarios, comma-separated, of: " + ", ".join(SCENARIOS))
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds between the runners' registration and the idle measure")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--failover-run-timeout", type=float, default=4.0,
                   help="run_timeout of the tasks in flight on the killed host")
    p.add_argument("--failover-wait", type=float, default=120.0)
    p.add_argument("--external-timeout", type=float, default=900.0)
    p.add_argument("--extrapolate", type=int, default=100, help="hosts to extrapolate to")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a line of every host's config (a TOML value), e.g. overseer.check_interval=2")
    p.add_argument("--json")
    p.add_argument("--max-seconds", type=int, default=3600, help="watchdog")
    args = p.parse_args(argv)
    args.scenarios = [s for s in args.only.split(",") if s]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error("unknown scenario(s): %s" % ", ".join(sorted(unknown)))
    for item in args.set:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            p.error("--set %r: expected SECTION.KEY=VALUE" % item)
    return args


def main(argv=None):
    args = parse_args(argv)
    reason = hostnet.missing()
    if reason:
        print("bench/fleet.py: %s" % reason, file=sys.stderr)
        return 2
    common.install_signal_cleanup()
    import signal
    signal.alarm(args.max_seconds)
    report = {"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "machine": platform.machine(), "cores": os.cpu_count(),
                       "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
                       "hosts": args.hosts, "runners_per_host": args.runners,
                       "tasks": args.tasks, "task_ms": args.task_ms, "config_overrides": args.set,
                       "commit": _commit()}}
    failed = False
    started = time.monotonic()
    def scenario(name, *arguments):
        nonlocal failed
        print("-- %s ..." % name, flush=True)
        t0 = time.monotonic()
        try:
            report[name] = (external if name in EXTERNAL else globals()[name])(*arguments)
        except Exception as exc:
            failed = True
            traceback.print_exc()
            report[name] = {"error": "%s: %s" % (type(exc).__name__, exc)}
        print(json.dumps(report[name], indent=1, default=str)[:3000], flush=True)
        print("   done in %.0fs" % (time.monotonic() - t0), flush=True)

    try:
        # Scripts of their own, with servers of their own: run while no fleet is up.
        for name in [s for s in args.scenarios if s in EXTERNAL]:
            scenario(name, name, args)
        ours = [s for s in SCENARIOS if s in args.scenarios and s not in EXTERNAL]
        if ours:
            with Fleet(args.hosts, args.runners, common.workdir(), args.set) as fleet:
                t0 = time.monotonic()
                fleet.start_all()
                report["meta"]["fleet_started_s"] = round(time.monotonic() - t0, 1)
                print("fleet: %d hosts × %d runners up in %.0fs (PostgreSQL on %s)"
                      % (args.hosts, args.runners, report["meta"]["fleet_started_s"],
                         fleet.cluster.address), flush=True)
                for name in ours:
                    scenario(name, fleet, args)
            report["extrapolated"] = extrapolate(report, args.hosts, args.runners,
                                                 args.extrapolate)
            print("-- extrapolated\n" + json.dumps(report["extrapolated"], indent=1))
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        failed = True
    except Exception:
        traceback.print_exc()
        failed = True
    finally:
        common.cleanup()
        report["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
        common.write_json(args.json, report)
    return 1 if failed else 0


def _commit():
    done = subprocess.run(["git", "-C", common.ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
