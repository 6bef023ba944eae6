#!/usr/bin/env python3
"""taskrunner's benchmark suite.

    python bench/run.py [--quick] [--db sqlite|postgresql|mysql|all|LIST] [--json FILE]
                        [--workers W[,W...]] [--log-level warning[,info]] [--tasks N]
                        [--task-ms MS] [--variants default,SECTION.KEY=VALUE[+...]]
                        [--taskrunner-option SECTION.KEY=VALUE ...] [--only SCENARIO,...]

Scenarios (the JSON's keys): throughput (with the floor, the ceiling and the peers, per W
and log level), work (tasks that sleep), enqueue, pickup (after idle, beside a peer),
latency, scale, detection, rss; plus meta
(date, machine, versions, settings) and targets (met / missed). Absolute numbers depend on
the machine and its load: compare the ratios, which are measured inside one invocation with
the compared runs alternating.

Exit 0 when every scenario ran (targets missed or not), 1 when one failed; a watchdog
(--max-seconds) ends a run that would hang, and every child process is killed on exit.
"""
import argparse
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common, compare, scenarios  # noqa: E402
from bench.common import BACKENDS, print_table  # noqa: E402
from bench.report import SHOW, evaluate  # noqa: E402

# name → function(backend, settings); rss comes with latency.
SCENARIOS = {"throughput": compare.throughput, "work": compare.work, "enqueue": compare.enqueue,
             "pickup": compare.pickup, "latency": scenarios.latency, "scale": scenarios.scale,
             "detection": scenarios.detection}
LOG_LEVELS = ("warning", "info")


# -- meta --------------------------------------------------------------------------------

def meta(args, settings, backends):
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    host, version = common.machine(), common.package_version
    servers = {}
    for backend in backends:
        try:
            servers[backend] = common.server_version(backend)
        except Exception as exc:
            servers[backend] = "unavailable: %s" % exc
    return {
        "date": host["date"],
        "machine": {"platform": host["platform"], "cpu": host["cpu"], "cores": host["cores"],
                    "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "python": host["python"],
        "versions": {"taskrunner": version("taskrunner"), "taskrunner_commit": commit,
                     "peewee": version("peewee"), "psycopg": version("psycopg"),
                     "pymysql": version("PyMySQL"), "huey": version("huey"),
                     "procrastinate": version("procrastinate"), "servers": servers},
        "settings": {"quick": args.quick, "workers": list(settings.sweep),
                     "log_levels": list(settings.log_levels),
                     "variants": {name: sections for name, sections in settings.variants},
                     "taskrunner_options": common.TASKRUNNER_OPTIONS, "throughput_n": settings.n,
                     "task_ms": settings.task_ms, "work_n": settings.work_n,
                     "work_workers": settings.work_workers,
                     "rounds": settings.rounds, "single_adds": settings.single_adds,
                     "idle_seconds": settings.idle_seconds,
                     "pickup_rounds": settings.pickup_rounds, "pickup_idle": settings.pickup_idle,
                     "scale_sizes": settings.scale_sizes,
                     "scale_drain": settings.scale_drain, "kills": settings.kills,
                     "sqlite_synchronous": common.SQLITE_SYNCHRONOUS},
        # The disk's ceiling for SQLite: one-row commits/s at the bench's synchronous.
        "sqlite_commits_per_s": round(common.sqlite_commit_rate(), 1) if "sqlite" in backends else None,
    }


# -- main --------------------------------------------------------------------------------

def _list(text, convert=str):
    return tuple(convert(item.strip()) for item in text.split(",") if item.strip())


def parse_variant(text):
    """"default" → no options; "runner.batch=16+runner.x=y" → (text, their sections)."""
    if text == "default":
        return text, {}
    return text, common.merge_sections(*(common.parse_option(part) for part in text.split("+")))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test: < 2 min on SQLite)")
    parser.add_argument("--db", default="sqlite", metavar="DB",
                        help="sqlite, postgresql, mysql, all, or a comma-separated list (default sqlite)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--workers", default="2", metavar="W[,W...]",
                        help="worker processes of every side; a list is a sweep of the throughput "
                             "scenario (the other scenarios use the first; default 2)")
    parser.add_argument("--log-level", default="warning", metavar="LEVEL[,LEVEL]",
                        help="log level of every side in throughput, warning and/or info (each "
                             "system's own default); work uses the first (default warning)")
    parser.add_argument("--tasks", type=int, metavar="N", help="throughput: tasks per measurement "
                        "(default 20000, quick 2000)")
    parser.add_argument("--task-ms", type=float, metavar="MS",
                        help="work: what each task sleeps (default 5)")
    parser.add_argument("--variants", default="default", metavar="LIST",
                        help="taskrunner configurations compared side by side in throughput and "
                             "work: default, or SECTION.KEY=VALUE[+SECTION.KEY=VALUE...]; e.g. "
                             "default,runner.batch=16")
    parser.add_argument("--taskrunner-option", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="into every taskrunner config the bench writes (repeatable)")
    parser.add_argument("--sqlite-synchronous", choices=("full", "normal"), default="full",
                        help="PRAGMA synchronous of every SQLite side: taskrunner, floor, Huey "
                             "(default full, taskrunner's default: durable commits)")
    parser.add_argument("--only", metavar="LIST", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    parser.add_argument("--max-seconds", type=int, metavar="S",
                        help="watchdog: abort after S seconds (default 900 per database quick, 7200 full)")
    args = parser.parse_args(argv)
    args.scenarios = tuple(SCENARIOS) if not args.only else _list(args.only)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error("unknown scenario(s): %s" % ", ".join(sorted(unknown)))
    args.backends = BACKENDS if args.db == "all" else _list(args.db)
    if not args.backends or set(args.backends) - set(BACKENDS):
        parser.error("--db: %r is not sqlite, postgresql, mysql, all or a list of them" % args.db)
    try:
        args.sweep = _list(args.workers, int)
        if not args.sweep or min(args.sweep) < 1:
            raise ValueError
    except ValueError:
        parser.error("--workers: %r is not a list of positive integers" % args.workers)
    args.log_levels = _list(args.log_level)
    if not args.log_levels or set(args.log_levels) - set(LOG_LEVELS):
        parser.error("--log-level: %r is not warning, info or both" % args.log_level)
    if args.tasks is not None and args.tasks < 10:
        parser.error("--tasks: at least 10")
    if args.task_ms is not None and args.task_ms <= 0:
        parser.error("--task-ms: a positive number of milliseconds")
    try:
        args.options = common.merge_sections(*map(common.parse_option, args.taskrunner_option))
        args.variant_list = tuple(parse_variant(v) for v in _list(args.variants))
    except ValueError as exc:
        parser.error(str(exc))
    if not args.variant_list:
        parser.error("--variants: at least one")
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = scenarios.Settings.make(args.quick, sweep=args.sweep, log_levels=args.log_levels,
                                       n=args.tasks, task_ms=args.task_ms, variants=args.variant_list)
    common.SQLITE_SYNCHRONOUS = args.sqlite_synchronous
    common.TASKRUNNER_OPTIONS = args.options
    backends = args.backends
    common.install_signal_cleanup()
    import signal
    signal.alarm(args.max_seconds or len(backends) * (900 if args.quick else 7200))
    report = {key: {} for key in tuple(SCENARIOS) + ("rss",)}
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
        print("taskrunner bench — %s, %s, %d cores, load %s; %s, W=%s, log %s, variants %s"
              % (m["date"], m["machine"]["cpu"], os.cpu_count(), m["machine"]["load_avg_at_start"],
                 "quick" if args.quick else "full", ",".join(map(str, settings.sweep)),
                 ",".join(settings.log_levels), ",".join(name for name, _ in settings.variants)))
        if m["sqlite_commits_per_s"]:
            print("SQLite synchronous=%s: this disk allows %.0f one-row commits/s"
                  % (common.SQLITE_SYNCHRONOUS, m["sqlite_commits_per_s"]))
        for name in args.scenarios:
            for backend in available:
                t0 = time.monotonic()
                print("-- %s on %s ..." % (name, backend), flush=True)
                try:
                    result = SCENARIOS[name](backend, settings)
                except Exception as exc:
                    failed = True
                    traceback.print_exc()
                    report[name][backend] = {"error": "%s: %s" % (type(exc).__name__, exc)}
                    continue
                if result.get("errors"):
                    failed = True
                print("   done in %.0fs" % (time.monotonic() - t0), flush=True)
                _store(report, name, backend, result)
            _show(report, name)
        report["targets"] = evaluate(report)
        if report["targets"]:
            print_table("targets", ["target", "db", "measured", "met"],
                        [[t["target"], t["db"], t["shown"], "met" if t["met"] else "MISSED"]
                         for t in report["targets"]])
        report["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
        report["meta"]["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        print("\nfinished in %.0fs" % report["meta"]["elapsed_s"])
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        failed = True
        # The throughput cells of the W values finished before the stop are kept.
        for backend, partial in compare.PARTIAL.items():
            if partial["cells"] and "cells" not in report["throughput"].get(backend, {}):
                report["throughput"][backend] = partial
    finally:
        common.cleanup()
        common.write_json(args.json, report)
    return 1 if failed else 0


def _store(report, name, backend, result):
    """A scenario's result under its key (latency's footprint under rss)."""
    if name == "latency":
        report["latency"][backend] = result["latency"]
        report["rss"][backend] = result["rss"]
    else:
        report[name][backend] = result


def _show(report, name):
    for key in ("latency", "rss") if name == "latency" else (name,):
        ok = {b: r for b, r in report[key].items() if "error" not in r}
        for backend, r in report[key].items():
            if "error" in r:
                print("\n%s on %s FAILED: %s" % (key, backend, r["error"]))
        if ok:
            SHOW[key](ok)


if __name__ == "__main__":
    sys.exit(main())
