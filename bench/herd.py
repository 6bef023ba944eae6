#!/usr/bin/env python3
"""Wake-ups at scale (issue 15 "Wake-ups scale", issue 16's enqueue cost): how many idle
runners one new task wakes, how fast one is picked up, and what add_task costs the caller.

    python bench/herd.py [--before DIR] [--rounds R] [--only herd,latency,enqueue]
                         [--json FILE]

Each measurement runs one overseer (`limit` runners, poll_interval 600 s, so every look
for work in the window follows a wake-up) and adds no-op tasks one at a time from another
process, waiting after each until every runner is back in its wait. Runners count, through
a wrapper installed in the overseer before it forks, each time they enter and leave their
wait and each look for work that follows a wait (a "woken" runner). Reported per code
version: runners woken per task (runs claimed per task is 1), pickup latency (add_task
called -> the run's started_on, p50/p99) and add_task's own time (p50/p99).

`--before DIR` names another checkout (main's) measured the same way: both versions run in
alternation, R rounds each, every process of a version importing that version's package
(PYTHONPATH). Scenarios: ``herd`` 100 runners on SQLite and on PostgreSQL; ``latency`` 200
runners on PostgreSQL; ``enqueue`` 8 runners on SQLite and on PostgreSQL. PostgreSQL with
more than 100 runners uses a throwaway cluster (max_connections 450, made with
tests/servers.py's PostgresCluster); `enqueue` on PostgreSQL uses the shared server
(BENCH_POSTGRES_URL).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)       # after PYTHONPATH: the version measured comes first

from bench import common  # noqa: E402

# Run in the overseer process before it forks: counts into the file argv[1] ("e"/"l":
# a runner entered/left its wait, "w": it looked for work right after a wait).
# The runner class is found by the two methods counted, not by its name or module, which
# differ between the versions compared (taskrunner/runner.py's Worker before the runner
# became a package, runner/process.py's Worker, runner/loop.py's Runner, whose mixin Idle
# defines them): the most derived class that has both is patched.
BOOT = r"""
import importlib, os, sys
from taskrunner.cli import main
for name in ("taskrunner.runner.loop", "taskrunner.runner.process", "taskrunner.runner"):
    try:
        module = importlib.import_module(name)
        break
    except ImportError:
        continue
Runner = max((c for c in vars(module).values()
              if isinstance(c, type) and hasattr(c, "_wait") and hasattr(c, "_look")),
             key=lambda c: len(c.__mro__))
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
wait, look = Runner._wait, Runner._look
def _wait(self, timeout):
    os.write(fd, b"e")
    try:
        wait(self, timeout)
    finally:
        os.write(fd, b"l")
        self.bench_waited = True
def _look(self):
    if getattr(self, "bench_waited", False):
        self.bench_waited = False
        os.write(fd, b"w")
    return look(self)
Runner._wait, Runner._look = _wait, _look
sys.exit(main(["--config", sys.argv[2], "overseer"]))
"""

SCENARIOS = {
    # name: [(backend, runners, tasks)]
    "herd": [("sqlite", 100, 40), ("cluster", 100, 40)],
    "latency": [("cluster", 200, 60)],
    "enqueue": [("sqlite", 8, 200), ("postgresql", 8, 200)],
}


def _counts(path):
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return 0, 0
    return data.count(b"e") - data.count(b"l"), data.count(b"w")


def measure(url, runners, tasks, label):
    """In a child whose PYTHONPATH is the version measured: one overseer, `tasks` no-op
    tasks added one at a time; returns the figures as a dict."""
    from taskrunner import TaskQueue
    from taskrunner.config import Config
    counter = os.path.join(common.workdir(), label + ".counts")
    config = common.write_config(url, runners, label, runner={"poll_interval": 600},
                                 log={"level": "warning"})
    queue = TaskQueue(Config.from_dict({"database": {"url": url}}), migrate=True)
    env = dict(os.environ)
    overseer = common.spawn([sys.executable, "-c", BOOT, counter, config], label + ".log", env)
    try:
        settled = lambda: _counts(counter)[0] >= runners  # noqa: E731
        common.wait_until(settled, 900, "%d idle runners" % runners, interval=0.1,
                          procs=[overseer])
        woken, adds, pickups = [], [], []
        for n in range(tasks):
            before = _counts(counter)[1]
            started = time.time()
            task_id = queue.add_task(common.NOOP)
            adds.append(time.time() - started)
            row = common.wait_until(lambda: common.query(
                url, "SELECT started_on FROM task_runs WHERE task_id = ? AND started_on IS "
                "NOT NULL", (task_id,)), 60, "task %d to start" % task_id, interval=0.002,
                procs=[overseer])
            pickups.append(common.to_epoch(row[0][0]) - started)
            common.wait_until(lambda: common.query(
                url, "SELECT count(*) FROM task_runs WHERE status = 'success'")[0][0] > n,
                60, "task %d to end" % task_id, interval=0.005, procs=[overseer])
            common.wait_until(settled, 120, "the runners back in their wait", interval=0.01,
                              procs=[overseer])
            woken.append(_counts(counter)[1] - before)
        claimed = common.query(url, "SELECT count(*) FROM task_runs")[0][0]
    finally:
        common.stop(overseer, grace=30)
        queue.close()
    return {"runners": runners, "tasks": tasks, "woken_per_task": sum(woken) / tasks,
            "woken_max": max(woken), "runs_claimed_per_task": claimed / tasks,
            "pickup_p50_ms": 1000 * common.percentile(pickups, 50),
            "pickup_p99_ms": 1000 * common.percentile(pickups, 99),
            "pickup_max_ms": 1000 * max(pickups),
            "add_task_p50_ms": 1000 * common.percentile(adds, 50),
            "add_task_p99_ms": 1000 * common.percentile(adds, 99)}


def _child(args):
    common.install_signal_cleanup()
    try:
        result = measure(args.url, args.runners, args.tasks, args.label)
    finally:
        common.cleanup()
    print(json.dumps(result))


def _run_child(version_root, url, runners, tasks, label):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([version_root, ROOT])
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--url", url,
                              "--runners", str(runners), "--tasks", str(tasks), "--label", label],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=3600)
    finally:
        if child.poll() is None:       # stopped: its own cleanup stops its overseer
            child.terminate()
            child.wait(60)
    if child.returncode != 0:
        raise RuntimeError("%s (%s): %s" % (label, version_root, err[-3000:]))
    return json.loads(out.strip().splitlines()[-1])


def _cluster():
    """A throwaway PostgreSQL cluster that takes 450 connections."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from servers import PostgresCluster
    cluster = PostgresCluster()
    try:
        conf = "/etc/postgresql/%s/%s/conf.d/herd.conf" % (cluster.version, cluster.name)
        with open(conf, "w") as fh:
            fh.write("max_connections = 450\n")
        cluster.ctl("restart")
    except BaseException:
        cluster.drop()
        raise
    return cluster


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="another checkout to compare with (main's)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="herd,latency,enqueue")
    parser.add_argument("--db", help="only the scenarios' cases on this database")
    parser.add_argument("--json")
    parser.add_argument("--small", action="store_true", help="10 runners, 5 tasks (a trial)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--runners", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=int, help="tasks per case (default: the scenario's)")
    parser.add_argument("--label", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    common.install_signal_cleanup()
    versions = [("after", ROOT)] + ([("before", os.path.abspath(args.before))]
                                    if args.before else [])
    wanted = [(name, case) for name in args.only.split(",") for case in SCENARIOS[name]]
    if args.db:
        wanted = [(name, case) for name, case in wanted
                  if case[0] == args.db or (case[0] == "cluster" and args.db == "postgresql")]
    cluster = _cluster() if any(case[0] == "cluster" for _, case in wanted) else None
    results = []
    try:
        if args.small:
            wanted = [(name, (backend, 10, 5)) for name, (backend, _, _) in wanted]
        elif args.tasks:
            wanted = [(name, (backend, runners, args.tasks))
                      for name, (backend, runners, _) in wanted]
        for name, (backend, runners, tasks) in wanted:
            for round_ in range(args.rounds):
                # Alternate which version goes first, round after round.
                for version, root in (versions if round_ % 2 == 0 else versions[::-1]):
                    if backend == "cluster":
                        url = cluster.new_database()
                    else:
                        url = common.create_database(backend, "herd")
                    label = "%s-%s-%s-%d" % (name, backend, version, round_)
                    figures = _run_child(root, url, runners, tasks, label)
                    figures.update(scenario=name, backend="postgresql" if backend == "cluster"
                                   else backend, version=version, round=round_)
                    results.append(figures)
                    print(json.dumps(figures), flush=True)
                    if backend != "cluster":
                        common.drop_url(url)
    finally:
        if cluster is not None:
            cluster.drop()
        common.cleanup()
    if args.small:
        wanted = [(name, (backend, 10, 5)) for name, (backend, _, _) in wanted]
    keys = ("woken_per_task", "runs_claimed_per_task", "pickup_p50_ms", "pickup_p99_ms",
            "pickup_max_ms", "add_task_p50_ms")
    rows = []
    for name, (backend, runners, tasks) in wanted:
        for version, _ in versions:
            mine = [r for r in results if r["scenario"] == name and r["version"] == version
                    and r["runners"] == runners and r["backend"] == (
                        "postgresql" if backend == "cluster" else backend)]
            rows.append([name, mine[0]["backend"], runners, version]
                        + [common.median([r[k] for r in mine]) for k in keys])
    common.print_table("wake-ups", ["scenario", "db", "runners", "version"] + list(keys), rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bench": "herd", "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                       "note": "versions alternate within each scenario, round after round",
                       "results": results, "summary": [dict(zip(
                           ["scenario", "db", "runners", "version"] + list(keys), row))
                           for row in rows]}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
