#!/usr/bin/env python3
"""SQLite under contention: taskrunner's runners against Huey's workers on one file, by
worker count and log level, with each taskrunner runner's share of the runs.

    python bench/sqlite_contention.py [--workers 1,2,8] [--log-levels warning,info]
        [--n 5000] [--rounds 2] [--variant NAME=PYTHONPATH ...] [--no-huey]
        [--sleep-ms 0] [--json FILE]

Each `--variant` is a taskrunner tree (``main=/work/main``): its overseer and runners import
taskrunner from that path, so a branch and main are compared in one invocation. Without
one, the repository this file is in is the only variant. Every round runs each (workers,
log level) with every system, the order rotated each round; ratios are per round, then the
median. `--sleep-ms` gives each task that much work (Huey's task and taskrunner's
``contention_sleep.Sleep``, written to the work directory, both ``time.sleep``).

Per-runner shares: runs finished by each runner (task_runs.runner_id) over the fair share
n / W; the smallest is reported (1.0 = perfectly even).
"""
import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.common import create_database, drop_url, finish_times, median, query, rates  # noqa: E402
from bench.systems import Huey, marks_count  # noqa: E402

SLEEP_HANDLER = "contention_sleep.Sleep"
# Written to the work directory, the runners' working directory (on their sys.path with
# `python -m`): a variant's own tree may have a `bench` package without it.
SLEEP_MODULE = """import time

from taskrunner.handler import TaskHandler


class Sleep(TaskHandler):
    def handle(self, run):
        time.sleep(run.data)
"""


def _env(pythonpath, extra=None):
    env = dict(os.environ)
    # The variant's taskrunner first, then this repository (bench.*).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, common.ROOT) if p)
    env.update(extra or {})
    return env


class TaskrunnerVariant:
    def __init__(self, name, pythonpath):
        self.name, self.pythonpath = name, pythonpath

    def prepare(self, n, sleep_ms):
        url = create_database("sqlite", "cont")
        # With the variant's own schema (its migrations), in a process of its own.
        proc = common.spawn([sys.executable, "-c", "from bench.backlog import queue_backlog; "
                             "queue_backlog(%r, %d)" % (url, n)], "cont-backlog.log",
                            env=_env(self.pythonpath))
        common.wait_until(lambda: proc.poll() is not None, 300, "the backlog", procs=())
        if proc.returncode:
            raise RuntimeError("backlog failed (log: %s)" % common.workdir())
        if sleep_ms:
            with open(os.path.join(common.workdir(), "contention_sleep.py"), "w") as fh:
                fh.write(SLEEP_MODULE)
            conn = common.connect(url)
            conn.execute("UPDATE task_queue SET handler = ?, data = ?",
                         (SLEEP_HANDLER, json.dumps(sleep_ms / 1000.0)))
            conn.commit()
            conn.close()
        return url

    def run(self, url, n, workers, level, sleep_ms, timeout):
        config = common.write_config(url, workers, "cont-%s" % self.name, log={"level": level},
                                     handlers={"allow": ["taskrunner.handlers.*",
                                                         "contention_sleep.*"]})
        launched = time.time()
        proc = common.spawn([sys.executable, "-m", "taskrunner", "--config", config, "overseer"],
                            "cont-%s.log" % self.name, env=_env(self.pythonpath))
        try:
            sql = "SELECT count(*) FROM task_runs WHERE status = 'success'"
            common.wait_until(lambda: _count(url, sql) >= n, timeout,
                              "%d runs (%s)" % (n, self.name), interval=0.2, procs=[proc])
        finally:
            common.stop(proc, grace=15)
        result = rates(launched, finish_times(url))
        counts = sorted(row[0] for row in query(
            url, "SELECT count(*) FROM task_runs WHERE status = 'success' GROUP BY runner_id"))
        counts = [0] * max(0, workers - len(counts)) + counts
        result["runner_shares"] = [round(c * workers / n, 3) for c in counts]
        result["min_share"] = min(result["runner_shares"])
        return result

    def teardown(self, url):
        drop_url(url)


def _count(url, sql):
    try:
        return query(url, sql)[0][0]
    except Exception as exc:
        if "locked" in str(exc):
            return 0
        raise


class HueyPeer(Huey):
    """bench.systems.Huey with its consumer's log level: -q (quiet) is warning."""
    name = "huey"

    def prepare(self, n, sleep_ms):
        if not sleep_ms:
            return super().prepare("sqlite", n)
        base = os.path.join(common.workdir(), "huey-%d-%d" % (os.getpid(), time.monotonic_ns()))
        ctx = (base + ".db", base + ".marks")
        proc = common.spawn([sys.executable, "-c", "from bench.contention_huey import enqueue; "
                             "enqueue(%d)" % n], "huey-enqueue.log", env=self._env(ctx))
        common.wait_until(lambda: proc.poll() is not None, 300, "Huey enqueue", procs=())
        if proc.returncode:
            raise RuntimeError("Huey enqueue failed (log: %s)" % common.workdir())
        return ctx

    def run(self, ctx, n, workers, level, sleep_ms, timeout):
        marks = ctx[1]
        env = self._env(ctx)
        env["BENCH_HUEY_SLEEP"] = str(sleep_ms / 1000.0)
        app = "bench.contention_huey.huey" if sleep_ms else "bench.huey_app.huey"
        argv = [sys.executable, "-m", "huey.bin.huey_consumer", app,
                "-k", "process", "-w", str(workers)]
        if level == "warning":
            argv.append("-q")
        elif level == "debug":
            argv.append("-v")
        launched = time.time()
        proc = common.spawn(argv, "huey.log", env=env)
        try:
            common.wait_until(lambda: marks_count(marks) >= n, timeout, "Huey to run %d tasks" % n,
                              interval=0.2, procs=[proc])
        finally:
            common.stop(proc)
        with open(marks) as fh:
            return rates(launched, sorted(float(line) for line in fh))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,8")
    parser.add_argument("--log-levels", default="warning")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PYTHONPATH")
    parser.add_argument("--no-huey", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    variants = [TaskrunnerVariant(*v.split("=", 1)) for v in args.variant] \
        or [TaskrunnerVariant("taskrunner", common.ROOT)]
    systems = variants + ([] if args.no_huey else [HueyPeer()])
    workers = [int(w) for w in args.workers.split(",")]
    levels = args.log_levels.split(",")
    common.install_signal_cleanup()
    runs = {}
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            for w in workers:
                for level in levels:
                    k = r % len(systems)
                    for system in systems[k:] + systems[:k]:
                        ctx = system.prepare(args.n, args.sleep_ms)
                        try:
                            m = system.run(ctx, args.n, w, level, args.sleep_ms,
                                           60 + args.n / 20 + args.n * args.sleep_ms / 1000 / w)
                        finally:
                            system.teardown(ctx)
                        key = "W=%d %s" % (w, level)
                        runs.setdefault(key, {}).setdefault(system.name, []).append(m)
                        print("round %d %-12s %-10s %7.1f jobs/s%s" % (
                            r + 1, key, system.name, m["jobs_per_s"],
                            "  shares %s" % m["runner_shares"] if "runner_shares" in m else ""),
                            flush=True)
    finally:
        common.cleanup()
    summary = {}
    for key, by_system in runs.items():
        entry = summary[key] = {}
        for name, ms in by_system.items():
            entry[name] = {"jobs_per_s": median([m["jobs_per_s"] for m in ms])}
            if "min_share" in ms[0]:
                entry[name]["min_share"] = min(m["min_share"] for m in ms)
        for name, ms in by_system.items():
            for other, oms in by_system.items():
                if other != name and name != "huey":
                    entry[name]["over_%s" % other] = round(median(
                        [a["jobs_per_s"] / b["jobs_per_s"] for a, b in zip(ms, oms)]), 3)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "load_avg": os.getloadavg(), "cores": os.cpu_count(),
                       "settings": {"n": args.n, "rounds": args.rounds, "workers": workers,
                                    "log_levels": levels, "sleep_ms": args.sleep_ms,
                                    "variants": {v.name: v.pythonpath for v in variants},
                                    "sqlite_synchronous": common.SQLITE_SYNCHRONOUS},
                       "elapsed_s": round(time.monotonic() - started, 1),
                       "summary": summary, "runs": runs}, fh, indent=2)


if __name__ == "__main__":
    sys.exit(main())
