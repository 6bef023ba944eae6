"""CPU per job of two or more source trees, process by process: ``python -m bench.perjob
--tree /work/base --tree . [--db postgresql] [--workers 2]`` drains the same no-op backlog
with `taskrunner overseer` from each tree (its own ``init-db``, as bench/ab.py), the order
rotated every round, and prints per tree the median over the rounds of the CPU seconds per
1,000 jobs of each kind of process — the overseer, its runners, its maintainer, its wake-up
hub, and on PostgreSQL the server backends that served them (bench/cpu.py) — with jobs/s
(launch to last finish, common.rates) and the launch-to-first-finish time.

CPU seconds are user + system time from /proc, sampled every tick of the wait while the
processes live (a runner that exits counts with its last sample). They depend on the load
far less than wall time (shown, not to be compared on a loaded host), but not at all is too
much to claim: at a load of 10 on two cores one tree's rounds spread by +-30% (contention,
caches), so compare medians of several rounds, and settle differences under ~10% with
counts (statements, Python calls per job, EXPLAIN's buffers) instead. The overseer's
figure includes its start (imports, migrate)
and the runners' figure their start after the fork, so at a small --tasks the fixed costs
weigh more.
"""
import argparse
import collections
import os
import sys
import time

import psutil

from bench import common
from bench.ab import TaskrunnerAt
from bench.cpu import ServerCpu, tree as process_tree
from bench.systems import Job

KINDS = {"tr-maintainer": "maintainer", "tr-hub": "hub"}


def process_seconds(root_pid, seen):
    """Record in `seen` ({pid: (kind, seconds)}) the CPU of the overseer `root_pid` and of
    each of its descendants, by kind."""
    for process in process_tree(root_pid):
        try:
            times, name = process.cpu_times(), process.name()
        except psutil.NoSuchProcess:
            continue
        kind = "overseer" if process.pid == root_pid else \
            "runner" if name.startswith("tr-runner") else KINDS.get(name, "other")
        seen[process.pid] = (kind, times.user + times.system)


def measure(system, backend, job):
    """One drain of `system` (a TaskrunnerAt): {kind: CPU s per 1,000 jobs, "jobs_per_s",
    "first_s"}."""
    url = system.prepare(backend, job)
    overseer = system.start(url, job, label="perjob")
    server = ServerCpu(url) if backend == "postgresql" else None
    seen = {}

    def tick():
        process_seconds(overseer.proc.pid, seen)
        if server is not None:
            server.sample()
    try:
        overseer.wait_done(job.n, job.timeout, tick=tick)
        tick()
    finally:
        if server is not None:
            server.close()
        overseer.stop()
    finishes = common.finish_times(url)
    system.teardown(url)
    per_kind = collections.Counter()
    for kind, seconds in seen.values():
        per_kind[kind] += seconds
    if server is not None:
        per_kind["server"] = server.seconds()
    per_kind["all"] = sum(per_kind.values())
    result = {kind: round(1000 * seconds / job.n, 3) for kind, seconds in per_kind.items()}
    result["jobs_per_s"] = common.rates(overseer.launched, finishes)["jobs_per_s"]
    result["first_s"] = round(finishes[0] - overseer.launched, 3)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree's root (twice or more)")
    parser.add_argument("--db", default="sqlite", choices=("sqlite", "postgresql"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.tree]
    systems = [TaskrunnerAt(t, t) for t in trees]
    job = Job(args.tasks, args.workers)
    runs = collections.defaultdict(list)
    common.install_signal_cleanup()
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(systems)
            for system in systems[shift:] + systems[:shift]:
                runs[system.root].append(measure(system, args.db, job))
    finally:
        common.cleanup()
    report = {}
    for tree in trees:
        kinds = sorted({k for run in runs[tree] for k in run})
        report[tree] = {k: common.median([run.get(k, 0.0) for run in runs[tree]]) for k in kinds}
        print("%s (%s, W=%d, %d tasks, median of %d): %s" % (
            tree, args.db, args.workers, args.tasks, args.rounds,
            ", ".join("%s %s" % (k, report[tree][k]) for k in kinds)), flush=True)
    common.write_json(args.json, {"medians": report, "runs": runs, "load": os.getloadavg(),
                                  "at": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
