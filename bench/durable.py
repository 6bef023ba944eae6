#!/usr/bin/env python3
"""Durable execution and workflows beside DBOS Transact (issues 25 and 26, point 6).

    python bench/durable.py [--quick] [--db sqlite,postgresql] [--systems taskrunner,dbos]
                            [--only steps,sleep,chain,fan] [--workers W] [--rounds R]
                            [--json FILE]

Scenarios (each system on each database, alternating, `--rounds` times):
- steps: 1,000 tasks (quick 100) of 10 no-op steps each;
- sleep: the same with a durable sleep of 1 s between the 5th and the 6th step;
- chain: 100 no-op tasks (quick 20), each started once the one before it succeeded;
- fan: fan-out / fan-in 1 → 1,000 → 1 (quick 100).

taskrunner: `bench.handlers.TenSteps` (``run.step`` × 10, ``run.sleep`` between the 5th
and the 6th), the chain and the fan added up front with ``add_task(..., after=[ids])``;
drained by `taskrunner overseer` with W runners. DBOS (bench/dbos_app.py): a workflow of 10
``@DBOS.step``s (``DBOS.sleep``) per task, enqueued on its queue; the chain a workflow
awaiting 100 child workflows one after the other (``DBOS.start_workflow`` + ``get_result``);
the fan a workflow enqueueing 1,000 children on the queue, awaiting them all, then one
``report`` child over their results; W worker processes, an executor id each.

Measured: end-to-end seconds from the workers' launch (everything queued beforehand,
untimed) to the last task's (workflow's) finish, and what it cost the database:
- PostgreSQL: transactions committed in the system's database (pg_stat_database.xact_commit,
  after the system's processes exited, which flushes their statistics; the bench's own
  progress queries subtracted) — read-only ones included (polls, claims that found nothing)
  — and rows written (tup_inserted + tup_updated + tup_deleted);
- SQLite: write transactions committed: in WAL mode (taskrunner) the commit frames appended
  to the WAL, which a read transaction the bench holds keeps from being reset (so none is
  lost to a checkpoint; the WAL grows meanwhile, alike for both); in rollback-journal mode
  (DBOS's default on SQLite) the file change counter of the database header, which SQLite
  increments once per write transaction. Read-only transactions write nothing and are not
  counted. (A statement count would need pg_stat_statements, which this server does not
  load, or tracing inside every process: not attempted.)
Per task and per step: divided by the tasks (workflows, including a chain's or fan's
parent and children) and steps of the scenario.

The taskrunner side needs the durable-handler API for steps and sleep (``run.step``,
``run.sleep`` on the `run` handed to handlers, taskrunner.RunContext) and the workflow API
for chain and fan (``add_task(..., after=[ids])``); on a tree without them the scenario
reports "not available in this tree: ... missing" and the DBOS side still runs.
"""
import argparse
import inspect
import os
import sqlite3
import struct
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.common import (OverseerProcess, backend_of, create_database, drop_url, make_queue,  # noqa: E402
                          median, query, spawn, stop, to_epoch, wait_until)
from bench.compare import rotated  # noqa: E402
from bench.systems import _installed  # noqa: E402

SCENARIOS = ("steps", "sleep", "chain", "fan")
STEPS = 10
SLEEP_S = 1.0
SIZES = {False: {"steps": 1000, "sleep": 1000, "chain": 100, "fan": 1000},
         True: {"steps": 100, "sleep": 100, "chain": 20, "fan": 100}}
TEN_STEPS = "bench.handlers.TenSteps"


def tasks_of(system, scenario, n):
    """(tasks, steps) a scenario of size n runs: DBOS's chain has a parent workflow beside
    its n children; a fan has its root and its report (fan-in) beside the n leaves."""
    if scenario in ("steps", "sleep"):
        return n, n * STEPS
    if scenario == "chain":
        return (n + 1 if system == "dbos" else n), 0
    return n + 2, 0


# -- counting commits --------------------------------------------------------------------

def _sqlite_path(url):
    return url[len("sqlite:///"):]


def wal_commits(path):
    """Commit frames in the WAL file of `path` with the WAL's current salt (those appended
    since the WAL was last reset)."""
    try:
        with open(path + "-wal", "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return 0
    if len(data) < 32:
        return 0
    page_size = struct.unpack(">I", data[8:12])[0]
    salt = data[16:24]
    commits, offset = 0, 32
    while offset + 24 + page_size <= len(data):
        header = data[offset:offset + 24]
        if header[8:16] != salt:
            break
        if struct.unpack(">I", header[4:8])[0]:
            commits += 1
        offset += 24 + page_size
    return commits


def change_counter(path):
    """The database header's file change counter (rollback-journal mode: +1 per write
    transaction)."""
    with open(path, "rb") as fh:
        header = fh.read(28)
    return struct.unpack(">I", header[24:28])[0]


def is_wal(path):
    with open(path, "rb") as fh:
        header = fh.read(20)
    return header[18] == 2


class Commits:
    """What one measurement cost the database: start() before the launch, finish() once the
    system's processes have exited → {"commits": ..., "rows_written": ... or None, "how": ...}."""

    def __init__(self, url):
        self.url = url
        self.backend = backend_of(url)
        self.own_queries = 0
        self.pin = None

    def query(self, sql, params=()):
        """A progress query of the bench on the measured database (counted, subtracted)."""
        self.own_queries += 1
        return query(self.url, sql, params)

    def _pg(self):
        rows = query(common.PG_ADMIN_URL, "SELECT xact_commit, tup_inserted + tup_updated + "
                     "tup_deleted FROM pg_stat_database WHERE datname = ?",
                     (self.url.rsplit("/", 1)[1],))
        return rows[0]

    def start(self):
        if self.backend == "postgresql":
            self.before = self._pg()
            return
        path = _sqlite_path(self.url)
        self.wal = is_wal(path)
        if self.wal:
            # A read transaction held open: the WAL cannot be reset under it.
            self.pin = sqlite3.connect(path, isolation_level=None)
            self.pin.execute("BEGIN")
            self.pin.execute("SELECT count(*) FROM sqlite_master").fetchone()
            self.before = wal_commits(path)
        else:
            self.before = change_counter(path)

    def finish(self):
        if self.backend == "postgresql":
            # The statistics of exited backends are flushed at their exit; the collector's
            # view is read fresh by a new transaction.
            after = self._pg()
            own = self.own_queries
            return {"commits": after[0] - self.before[0] - own, "rows_written": after[1] - self.before[1],
                    "how": "pg_stat_database.xact_commit (read-only transactions included) "
                           "and tup_inserted + tup_updated + tup_deleted"}
        path = _sqlite_path(self.url)
        if self.wal:
            commits = wal_commits(path) - self.before
            self.pin.execute("COMMIT")
            self.pin.close()
            self.pin = None
            how = "WAL commit frames (write transactions)"
        else:
            commits = change_counter(path) - self.before
            how = "file change counter (rollback journal: write transactions)"
        return {"commits": commits, "rows_written": None, "how": how}

    def close(self):
        if self.pin is not None:
            self.pin.close()


# -- the systems -------------------------------------------------------------------------

class DbosSide:
    name = "dbos"
    TARGET = {"steps": "ten_steps", "sleep": "ten_steps", "chain": "chain", "fan": "fan"}

    def available(self, backend, scenario):
        return _installed("dbos", "psycopg") if backend == "postgresql" else _installed("dbos")

    def prepare(self, backend, scenario, n):
        url = create_database(backend, "dur")
        if scenario in ("steps", "sleep"):
            count, args = n, (SLEEP_S if scenario == "sleep" else 0,)
        else:
            count, args = 1, (n,)
        proc = spawn([sys.executable, "-c", "from bench.dbos_app import install, enqueue; "
                      "install(%r); enqueue(%r, %d, %r, %r)"
                      % (url, url, count, self.TARGET[scenario], args)], "dbos-durable.log")
        wait_until(lambda: proc.poll() is not None, 600, "DBOS install and enqueue", procs=())
        if proc.returncode:
            raise RuntimeError("DBOS install/enqueue failed (log: %s)" % common.workdir())
        return url, count

    def run(self, ctx, scenario, workers, timeout, commits):
        url, count = ctx
        name = self.TARGET[scenario]
        table = "dbos.workflow_status" if backend_of(url) == "postgresql" else "workflow_status"
        env = common.child_env()
        env.update(BENCH_LOG_LEVEL="warning", BENCH_DBOS_CONCURRENCY="0", BENCH_DBOS_POLL="1.0")
        launched = time.time()
        procs = [spawn([sys.executable, "-m", "bench.dbos_app", "work", url, "w%d" % i],
                       "dbos-durable.log", env=env) for i in range(workers)]
        try:
            wait_until(lambda: commits.query("SELECT count(*) FROM %s WHERE name = ? AND "
                                             "status = 'SUCCESS'" % table, (name,))[0][0] >= count,
                       timeout, "DBOS: %d %s workflows" % (count, name), interval=0.2, procs=procs)
            last = commits.query("SELECT max(updated_at) FROM %s WHERE status = 'SUCCESS'"
                                 % table)[0][0] / 1000.0
        finally:
            for proc in procs:
                stop(proc)
        return last - launched

    def teardown(self, ctx):
        drop_url(ctx[0])


def taskrunner_missing(scenario):
    """None when this tree has what `scenario` needs of taskrunner, else what is missing:
    steps and sleep need the durable-handler API on the `run` handed to handlers
    (taskrunner.RunContext: step, sleep), chain and fan add_task(after=...)."""
    from taskrunner import TaskQueue
    if scenario in ("steps", "sleep"):
        try:
            from taskrunner import RunContext as run_class
        except ImportError:
            from taskrunner.runner.current import CurrentRun as run_class
        missing = ["run.%s()" % name for name in ("step", "sleep")
                   if not callable(getattr(run_class, name, None))]
    else:
        missing = [] if "after" in inspect.signature(TaskQueue.add_task).parameters \
            else ["TaskQueue.add_task(after=...)"]
    return "not available in this tree: %s missing" % ", ".join(missing) if missing else None


class TaskrunnerSide:
    name = "taskrunner"

    def available(self, backend, scenario):
        return taskrunner_missing(scenario)

    def prepare(self, backend, scenario, n):
        url = create_database(backend, "dur")
        queue = make_queue(url)
        try:
            if scenario in ("steps", "sleep"):
                data = {"sleep": SLEEP_S if scenario == "sleep" else 0}
                for start in range(0, n, 5000):
                    queue.add_tasks([{"handler": TEN_STEPS, "data": data}
                                     for _ in range(min(5000, n - start))])
                total = n
            elif scenario == "chain":
                previous = queue.add_task(common.NOOP)
                for _ in range(n - 1):
                    previous = queue.add_task(common.NOOP, after=[previous])
                total = n
            else:
                root = queue.add_task(common.NOOP)
                leaves = [queue.add_task(common.NOOP, after=[root]) for _ in range(n)]
                queue.add_task(common.NOOP, after=leaves)
                total = n + 2
        finally:
            queue.close()
        return url, total

    def run(self, ctx, scenario, workers, timeout, commits):
        url, total = ctx
        overseer = OverseerProcess(url, workers, "durable", log={"level": "warning"}).start()
        try:
            wait_until(lambda: commits.query("SELECT count(*) FROM task_queue WHERE "
                                             "last_status = 'success'")[0][0] >= total,
                       timeout, "taskrunner: %d tasks done" % total, interval=0.2,
                       procs=[overseer.proc])
            last = to_epoch(commits.query("SELECT max(finished_on) FROM task_queue")[0][0])
        finally:
            overseer.stop()
        return last - overseer.launched

    def teardown(self, ctx):
        drop_url(ctx[0])


SYSTEMS = {"taskrunner": TaskrunnerSide(), "dbos": DbosSide()}


def measure(system, backend, scenario, n, workers, timeout):
    ctx = system.prepare(backend, scenario, n)
    commits = Commits(ctx[0])
    try:
        commits.start()
        seconds = system.run(ctx, scenario, workers, timeout, commits)
        cost = commits.finish()
    finally:
        commits.close()
        system.teardown(ctx)
    tasks, steps = tasks_of(system.name, scenario, n)
    result = {"seconds": round(seconds, 3), "tasks": tasks, "steps": steps,
              "commits": cost["commits"], "rows_written": cost["rows_written"], "how": cost["how"],
              "commits_per_task": round(cost["commits"] / tasks, 2)}
    if steps:
        result["commits_per_step"] = round(cost["commits"] / steps, 2)
    if cost["rows_written"] is not None:
        result["rows_per_task"] = round(cost["rows_written"] / tasks, 2)
    return result


def scenario_cells(backend, scenario, systems, n, workers, rounds, timeout):
    runs = {s.name: [] for s in systems}
    for r in range(rounds):
        for system in rotated(list(systems), r):
            print("   %s %s on %s, round %d ..." % (system.name, scenario, backend, r + 1), flush=True)
            runs[system.name].append(measure(system, backend, scenario, n, workers, timeout))
    cell = {"scenario": scenario, "size": n, "workers": workers, "rounds": rounds, "systems": {}}
    for name, per_round in runs.items():
        seconds = [m["seconds"] for m in per_round]
        entry = {"seconds": {"median": round(median(seconds), 3), "min": min(seconds),
                             "max": max(seconds)}, "runs": per_round}
        for key in ("commits_per_task", "commits_per_step", "rows_per_task"):
            if key in per_round[0]:
                entry[key] = round(median([m[key] for m in per_round]), 2)
        cell["systems"][name] = entry
    if {"taskrunner", "dbos"} <= set(runs):
        # DBOS's seconds ÷ taskrunner's, per round, then the median: > 1 is taskrunner ahead.
        cell["dbos_over_taskrunner"] = round(median(
            [d["seconds"] / t["seconds"] for d, t in zip(runs["dbos"], runs["taskrunner"])]), 3)
    return cell


def show(report):
    rows = []
    for backend, cells in report["results"].items():
        for cell in cells:
            if "error" in cell:
                rows.append([backend, cell["scenario"], "FAILED", cell["error"]] + [""] * 5)
                continue
            for name, e in cell["systems"].items():
                rows.append([backend, "%s (%d)" % (cell["scenario"], cell["size"]), name,
                             "%.2f (%.2f–%.2f)" % (e["seconds"]["median"], e["seconds"]["min"],
                                                   e["seconds"]["max"]),
                             e.get("commits_per_task"), e.get("commits_per_step", ""),
                             e.get("rows_per_task", ""),
                             "%.2f ×" % cell["dbos_over_taskrunner"]
                             if name == "taskrunner" and "dbos_over_taskrunner" in cell else "", ""])
        for name, why in report["skipped"].get(backend, {}).items():
            rows.append([backend, "", name, "skipped: " + why] + [""] * 5)
    common.print_table("durable execution and workflows, W = %d (seconds: median (min–max) of %d "
                       "rounds)" % (report["settings"]["workers"], report["settings"]["rounds"]),
                       ["db", "scenario (size)", "system", "end to end s", "commits / task",
                        "commits / step", "rows written / task", "DBOS s ÷ taskrunner s", ""], rows)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="bench/durable.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI)")
    parser.add_argument("--db", default="sqlite,postgresql", help="sqlite, postgresql or both")
    parser.add_argument("--systems", default="taskrunner,dbos", help="taskrunner, dbos or both")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=",".join(SCENARIOS))
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (default 1)")
    parser.add_argument("--timeout", type=float, default=300, help="per measurement (s)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.db.split(",") if b]
    args.scenarios = [s for s in args.only.split(",") if s]
    args.system_names = [s for s in args.systems.split(",") if s]
    if not args.backends or set(args.backends) - {"sqlite", "postgresql"}:
        parser.error("--db: %r is not sqlite, postgresql or both" % args.db)
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        parser.error("--only: %r is not a list of %s" % (args.only, ", ".join(SCENARIOS)))
    if not args.system_names or set(args.system_names) - set(SYSTEMS):
        parser.error("--systems: %r is not taskrunner, dbos or both" % args.systems)
    if args.workers < 1 or args.rounds < 1:
        parser.error("--workers and --rounds: at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    common.install_signal_cleanup()
    sizes = SIZES[args.quick]
    report = {"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]},
              "settings": {"quick": args.quick, "workers": args.workers, "rounds": args.rounds,
                           "sizes": sizes, "steps_per_task": STEPS, "sleep_s": SLEEP_S},
              "results": {}, "skipped": {}}
    failed = False
    try:
        for backend in args.backends:
            why = common.server_available(backend)
            if why:
                report["skipped"].setdefault(backend, {})["all"] = why
                continue
            report["results"][backend] = []
            for scenario in args.scenarios:
                systems = []
                for name in args.system_names:
                    why = SYSTEMS[name].available(backend, scenario)
                    if why:
                        print("%s %s on %s: %s" % (name, scenario, backend, why), flush=True)
                        report["skipped"].setdefault(backend, {})["%s %s" % (name, scenario)] = why
                    else:
                        systems.append(SYSTEMS[name])
                if not systems:
                    continue
                print("-- %s on %s" % (scenario, backend), flush=True)
                try:
                    report["results"][backend].append(scenario_cells(
                        backend, scenario, systems, sizes[scenario], args.workers, args.rounds,
                        args.timeout))
                except Exception as exc:
                    failed = True
                    report["results"][backend].append({"scenario": scenario,
                                                       "error": "%s: %s" % (type(exc).__name__, exc)})
        report["meta"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        show(report)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        failed = True
    finally:
        common.cleanup()
        common.write_json(args.json, report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
