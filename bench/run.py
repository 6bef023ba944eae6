#!/usr/bin/env python3
"""taskrunner's benchmark suite.

    python bench/run.py [--quick] [--db sqlite|postgresql|mysql|all] [--json FILE]
                        [--workers W] [--only SCENARIO,...]

Scenarios (the JSON's keys): throughput, enqueue, latency, scale, detection, rss, floor,
peers; plus meta (date, machine, versions, settings) and targets (met / missed). Absolute
numbers depend on the machine and its load: compare the ratios, which are measured inside
one invocation with the compared runs alternating.

Exit 0 when every scenario ran (targets missed or not), 1 when one failed; a watchdog
(--max-seconds) ends a run that would hang, and every child process is killed on exit.
"""
import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, scenarios  # noqa: E402
from bench.common import BACKENDS, print_table  # noqa: E402

SCENARIOS = ("throughput", "enqueue", "latency", "scale", "detection")   # rss, floor and peers
                                                                          # come with these


# -- tables ------------------------------------------------------------------------------

def _mmm(summary):
    return "%s (%s–%s)" % (common.fmt(summary["median"]), common.fmt(summary["min"]),
                           common.fmt(summary["max"]))


def show_throughput(results):
    rows = []
    for backend, r in results.items():
        if "error" in r:
            rows.append([backend, "error: " + r["error"]] + [""] * 3)
            continue
        t = r["taskrunner"]
        rows.append([backend, "taskrunner", _mmm(t["jobs_per_s"]), _mmm(t["steady_jobs_per_s"]),
                     "%d × %d runs, W=%d" % (r["rounds"], r["n"], r["workers"])])
    print_table("throughput: no-op tasks drained by an overseer with W runners (jobs/s, median (min–max) of rounds)",
                ["db", "system", "launch→last finish", "steady (p10–p90)", "runs"], rows)


def show_floor(results):
    rows = [[b, _mmm(r["floor"]["jobs_per_s"]), _mmm(r["floor"]["steady_jobs_per_s"]),
             "%.0f %%" % (100 * r["floor"]["ratio"]["jobs_per_s"]),
             "%.0f %%" % (100 * r["floor"]["ratio"]["steady_jobs_per_s"]),
             "%.2f ×" % r["floor"]["over_peer"] if "over_peer" in r["floor"] else "-"]
            for b, r in results.items() if "floor" in r]
    print_table("floor: raw SQL claim+finish, same schema, rows, durability, W processes",
                ["db", "floor jobs/s", "floor steady", "taskrunner/floor", "steady ratio",
                 "floor/peer (bounds taskrunner/peer)"], rows)
    show_ceiling(results)


def show_ceiling(results):
    rows = []
    for b, r in results.items():
        if "ceiling" in r:
            c = r["ceiling"]
            rows.append([b, _mmm(c["jobs_per_s"]), "%.0f %%" % (100 * c["ratio"]["jobs_per_s"]),
                         "%.2f ×" % c["over_peer"] if "over_peer" in c else "-"])
    if rows:
        print_table("ceiling: one row taken off a one-table queue per commit, W processes "
                    "(no queue committing once per job can beat it)",
                    ["db", "ceiling jobs/s", "taskrunner/ceiling", "ceiling/peer"], rows)


def show_peers(results):
    rows = []
    for backend, r in results.items():
        for peer in ("huey", "procrastinate"):
            if peer in r:
                p = r[peer]
                rows.append([backend, peer, _mmm(p["jobs_per_s"]), _mmm(p["steady_jobs_per_s"]),
                             "%.2f ×" % p["ratio"]["jobs_per_s"], "%.2f ×" % p["ratio"]["steady_jobs_per_s"]])
        for peer, why in r.get("skipped", {}).items():
            rows.append([backend, peer, "skipped: " + why, "", "", ""])
    print_table("peers: same N, same no-op, same W, alternating with taskrunner",
                ["db", "peer", "peer jobs/s", "peer steady", "taskrunner/peer", "steady ratio"], rows)


def show_enqueue(results):
    rows = [[b, _mmm(r["add_task_per_s"]), _mmm(r["add_tasks_per_s"])] for b, r in results.items()]
    print_table("enqueue (tasks/s)", ["db", "add_task, one call each", "add_tasks, one batch"], rows)


def show_latency(results):
    rows = [[b, r["p50_ms"], r["p95_ms"], r["p99_ms"], r["max_ms"], r["idle_runner_cpu_pct_max"],
             r["idle_overseer_cpu_pct"]] for b, r in results.items()]
    print_table("pickup latency after idle: queued_on → started_on (ms), 200 tasks 20 ms apart",
                ["db", "p50", "p95", "p99", "max", "idle runner CPU % (max)", "overseer CPU %"], rows)


def show_rss(results):
    rows = [[b, r["overseer_rss_mb"], r["runner_rss_mb_max"], r["overseer_uss_mb"],
             max(r["runner_uss_mb"])] for b, r in results.items()]
    print_table("footprint, idle (MB)", ["db", "overseer RSS", "runner RSS (max)", "overseer USS",
                                         "runner USS (max)"], rows)


def show_scale(results):
    rows = [[b, "%d vs %d" % tuple(r["sizes"]), _mmm(r["small_runs_per_s"]), _mmm(r["large_runs_per_s"]),
             "%.0f %%" % (100 * r["ratio"]), r["build_seconds"][r["sizes"][1]]]
            for b, r in results.items()]
    print_table("scale: claim+finish throughput (runs/s) by pending backlog, %s runs per measurement"
                % next(iter(results.values()))["drained_per_measurement"],
                ["db", "pending", "small", "large", "large/small", "build large (s)"], rows)


def show_detection(results):
    rows = [[b, r["kills"], r["to_timeout_p50_s"], r["to_timeout_p99_s"], r["to_restart_p50_s"],
             r["to_restart_p99_s"]] for b, r in results.items()]
    print_table("dead-runner detection after kill -9 (s), check_interval 1 s",
                ["db", "kills", "→ timeout p50", "→ timeout p99", "→ next run started p50",
                 "→ next run p99"], rows)


SHOW = {"throughput": show_throughput, "floor": show_floor, "peers": show_peers,
        "enqueue": show_enqueue, "latency": show_latency, "rss": show_rss, "scale": show_scale,
        "detection": show_detection}


# -- targets -----------------------------------------------------------------------------

def _bounds(report, backend):
    """What bounds taskrunner / peer in this run: the raw floor / peer and (SQLite) the
    disk's ceiling / peer."""
    measured = report.get("floor", {}).get(backend, {})
    shown = ["%s %.2f ×" % (name, measured[key]["over_peer"])
             for key, name in (("floor", "raw floor"), ("ceiling", "disk"))
             if "over_peer" in measured.get(key, {})]
    return " (bounds: %s)" % ", ".join(shown) if shown else ""


def evaluate(report):
    """(target, db, measured, met) for every target that was measured."""
    out = []

    def add(name, backend, value, met, shown):
        out.append({"target": name, "db": backend, "measured": value, "shown": shown, "met": bool(met)})

    for backend, r in report.get("peers", {}).items():
        if "huey" in r:
            v = r["huey"]["ratio"]["jobs_per_s"]
            add("SQLite throughput ≥ 1.5 × Huey", backend, v, v >= 1.5,
                "%.2f ×" % v + _bounds(report, backend))
        if "procrastinate" in r:
            v = r["procrastinate"]["ratio"]["jobs_per_s"]
            add("PostgreSQL throughput ≥ 3 × Procrastinate", backend, v, v >= 3,
                "%.2f ×" % v + _bounds(report, backend))
    for backend, r in report.get("floor", {}).items():
        v = r["floor"]["ratio"]["jobs_per_s"]
        add("throughput ≥ 60 % of the raw floor", backend, v, v >= 0.6, "%.0f %%" % (100 * v))
    for backend, r in report.get("latency", {}).items():
        add("pickup p50 ≤ 10 ms", backend, r["p50_ms"], r["p50_ms"] <= 10, "%.1f ms" % r["p50_ms"])
        add("pickup p99 ≤ 50 ms", backend, r["p99_ms"], r["p99_ms"] <= 50, "%.1f ms" % r["p99_ms"])
        v = r["idle_runner_cpu_pct_max"]
        add("idle runner CPU < 1 %", backend, v, v < 1, "%.2f %%" % v)
    for backend, r in report.get("scale", {}).items():
        add("%d pending ≥ 80 %% of %d pending" % (r["sizes"][1], r["sizes"][0]), backend, r["ratio"],
            r["ratio"] >= 0.8, "%.0f %%" % (100 * r["ratio"]))
    for backend, r in report.get("detection", {}).items():
        v = r["to_restart_p99_s"]
        add("detection p99 ≤ 1.5 s (kill → next run started)", backend, v, v <= 1.5, "%.2f s" % v)
    for backend, r in report.get("rss", {}).items():
        v = r["runner_rss_mb_max"]
        add("idle runner RSS ≤ 40 MB", backend, v, v <= 40, "%.1f MB" % v)
    return out


# -- meta --------------------------------------------------------------------------------

def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def meta(args, settings, backends):
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor()) \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    servers = {}
    for backend in backends:
        try:
            servers[backend] = common.server_version(backend)
        except Exception as exc:
            servers[backend] = "unavailable: %s" % exc
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "python": platform.python_version(),
        "versions": {"taskrunner": _version("taskrunner"), "taskrunner_commit": commit,
                     "peewee": _version("peewee"), "psycopg": _version("psycopg"),
                     "pymysql": _version("PyMySQL"), "huey": _version("huey"),
                     "procrastinate": _version("procrastinate"), "servers": servers},
        "settings": {"quick": args.quick, "workers": settings.workers, "throughput_n": settings.n,
                     "rounds": settings.rounds, "single_adds": settings.single_adds,
                     "idle_seconds": settings.idle_seconds, "scale_sizes": settings.scale_sizes,
                     "scale_drain": settings.scale_drain, "kills": settings.kills,
                     "sqlite_synchronous": common.SQLITE_SYNCHRONOUS},
        # The disk's ceiling for SQLite: one-row commits/s at the bench's synchronous.
        "sqlite_commits_per_s": round(common.sqlite_commit_rate(), 1) if "sqlite" in backends else None,
    }


# -- main --------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test: < 2 min on SQLite)")
    parser.add_argument("--db", choices=BACKENDS + ("all",), default="sqlite")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--workers", type=int, default=2, metavar="W", help="runners (default 2)")
    parser.add_argument("--sqlite-synchronous", choices=("full", "normal"), default="full",
                        help="PRAGMA synchronous of every SQLite side: taskrunner, floor, Huey "
                             "(default full, taskrunner's default: durable commits)")
    parser.add_argument("--only", metavar="LIST", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    parser.add_argument("--max-seconds", type=int, metavar="S",
                        help="watchdog: abort after S seconds (default 900 per database quick, 7200 full)")
    args = parser.parse_args(argv)
    args.scenarios = SCENARIOS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error("unknown scenario(s): %s" % ", ".join(sorted(unknown)))
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = scenarios.Settings.make(args.quick, args.workers)
    common.SQLITE_SYNCHRONOUS = args.sqlite_synchronous
    backends = BACKENDS if args.db == "all" else (args.db,)
    common.install_signal_cleanup()
    import signal
    signal.alarm(args.max_seconds or len(backends) * (900 if args.quick else 7200))
    report = {key: {} for key in ("throughput", "enqueue", "latency", "scale", "detection",
                                  "rss", "floor", "peers")}
    report["skipped_databases"] = {}
    failed = False
    started = time.monotonic()
    try:
        available = []
        for backend in backends:
            why = common.server_available(backend)
            if why:
                report["skipped_databases"][backend] = why
                print("skipping %s: %s" % (backend, why))
            else:
                available.append(backend)
        report["meta"] = meta(args, settings, available)
        m = report["meta"]
        print("taskrunner bench — %s, %s, %d cores, load %s; %s, W=%d"
              % (m["date"], m["machine"]["cpu"], os.cpu_count(), m["machine"]["load_avg_at_start"],
                 "quick" if args.quick else "full", settings.workers))
        if m["sqlite_commits_per_s"]:
            print("SQLite synchronous=%s: this disk allows %.0f one-row commits/s"
                  % (common.SQLITE_SYNCHRONOUS, m["sqlite_commits_per_s"]))
        for name in args.scenarios:
            for backend in available:
                t0 = time.monotonic()
                print("-- %s on %s ..." % (name, backend), flush=True)
                try:
                    result = getattr(scenarios, name)(backend, settings)
                except Exception as exc:
                    failed = True
                    traceback.print_exc()
                    report[name][backend] = {"error": "%s: %s" % (type(exc).__name__, exc)}
                    continue
                print("   done in %.0fs" % (time.monotonic() - t0), flush=True)
                _store(report, name, backend, result)
            _show(report, name)
        report["targets"] = evaluate(report)
        if report["targets"]:
            print_table("targets", ["target", "db", "measured", "met"],
                        [[t["target"], t["db"], t["shown"], "met" if t["met"] else "MISSED"]
                         for t in report["targets"]])
        report["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
        print("\nfinished in %.0fs" % report["meta"]["elapsed_s"])
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        failed = True
    finally:
        common.cleanup()
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2, default=str)
    return 1 if failed else 0


def _store(report, name, backend, result):
    """Split a scenario's result into the JSON's keys (throughput → floor, peers; latency → rss)."""
    if name == "throughput":
        report["floor"][backend] = {"floor": result.pop("floor")}
        if "ceiling" in result:
            report["floor"][backend]["ceiling"] = result.pop("ceiling")
        peers = {p: result.pop(p) for p in ("huey", "procrastinate") if p in result}
        peers["skipped"] = result.pop("skipped")
        if peers.keys() - {"skipped"} or peers["skipped"]:
            report["peers"][backend] = peers
        report["throughput"][backend] = result
    elif name == "latency":
        report["latency"][backend] = result["latency"]
        report["rss"][backend] = result["rss"]
    else:
        report[name][backend] = result


def _show(report, name):
    keys = {"throughput": ("throughput", "floor", "peers"), "latency": ("latency", "rss")}.get(name, (name,))
    for key in keys:
        ok = {b: r for b, r in report[key].items() if "error" not in r}
        for backend, r in report[key].items():
            if "error" in r:
                print("\n%s on %s FAILED: %s" % (key, backend, r["error"]))
        if ok:
            SHOW[key](ok)


if __name__ == "__main__":
    sys.exit(main())
