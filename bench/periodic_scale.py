"""The periodic scheduler at scale (the throughput issue): how fast one pass submits N
periodic tasks that are all due at once, per database, and what 10,000 minutely timers cost
the maintenance leader when they run for minutes.

``pass``: N periodic tasks (``minutely``, Echo) inserted in bulk, every one due a second
ago; then one scheduler pass (`PeriodicScheduler.run_pending`, in this process) — its
submissions per second, checked afterwards: N tasks, one per periodic task, each on its
due time, every nextrun advanced, no mark left. ``--limit`` ends a pass early (the rate is
then the share it did), for a tree whose pass takes minutes (``--tree /work/main``).

``steady``: N ``minutely`` timers and one overseer (its maintainer holds the lease; two
runners execute the tasks) for ``--minutes``; the maintainer process's CPU time (psutil,
user + system) over the whole window, as a share of one core, and for every minute how
long after it the last of its due times was handled (no periodic task left due).

    python bench/periodic_scale.py pass --backend sqlite --backend postgresql --tasks 10000
    python bench/periodic_scale.py steady --backend sqlite --tasks 10000 --minutes 4 \\
        --json bench/results/2026-11-27-periodic-steady-sqlite.json
"""
import argparse
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402

TIMER = "minutely"


def add_due_periodic_tasks(queue, count, nextrun):
    """`count` periodic tasks ("minutely", Echo), validated once as add_periodic validates
    them, inserted in multi-row INSERTs with the given nextrun."""
    from taskrunner.periodic.definitions import check_periodic
    from taskrunner.store.models import utcnow
    values, _ = check_periodic(queue.config, "scale", common.NOOP, TIMER)
    now = utcnow()
    rows = [dict(values, name="scale-%05d" % n, nextrun=nextrun, created=now - timedelta(hours=1),
                 updated_on=now) for n in range(count)]
    PeriodicTask = queue.store.PeriodicTask
    with queue.store.db.atomic():
        for start in range(0, count, 500):
            PeriodicTask.insert_many(rows[start:start + 500]).execute()


def one_pass(backend, count, limit):
    """One round of ``pass``: {"seconds", "submitted", "rate", "checked"}."""
    from taskrunner.periodic.scheduler import PeriodicScheduler
    from taskrunner.store.models import utcnow
    url = common.create_database(backend, "periodic")
    queue = common.make_queue(url)
    try:
        add_due_periodic_tasks(queue, count, utcnow() - timedelta(seconds=1))
        scheduler = PeriodicScheduler(queue.store)
        server = server_process(queue)
        server_cpu = sum(server.cpu_times()[:2]) if server else 0.0
        started, cpu = time.monotonic(), time.process_time()
        result = scheduler.run_pending(
            until=None if limit is None else lambda: time.monotonic() - started >= limit)
        seconds, cpu = time.monotonic() - started, time.process_time() - cpu
        if server:
            server_cpu = sum(server.cpu_times()[:2]) - server_cpu
        submitted = len(result["submitted"])
        # CPU seconds (this process's, plus its PostgreSQL backend's) bound the rate on a
        # machine with a core to spare, whatever else it runs.
        round_ = {"seconds": round(seconds, 3), "submitted": submitted,
                  "rate": round(submitted / seconds, 1), "cpu_seconds": round(cpu, 3),
                  "server_cpu_seconds": round(server_cpu, 3),
                  "rate_per_cpu_second": round(submitted / (cpu + server_cpu), 1),
                  "load_average": os.getloadavg()[0]}
        if submitted == count:
            round_["checked"] = check_pass(queue, count)
        return round_
    finally:
        queue.close()
        common.drop_url(url)


def server_process(queue):
    """The PostgreSQL backend serving the queue's connection (same host), or None."""
    if queue.store.backend != "postgresql":
        return None
    import psutil
    return psutil.Process(queue.store.db.execute_sql("SELECT pg_backend_pid()").fetchone()[0])


def check_pass(queue, count):
    """Rule 9 after a full pass: one task per periodic task, on its due time, every
    nextrun advanced past it, no mark left."""
    import peewee as pw
    PeriodicTask, Task = queue.store.PeriodicTask, queue.store.Task
    per_task = (Task.select(Task.periodic_task_id, pw.fn.COUNT(Task.id).alias("n"))
                .group_by(Task.periodic_task_id))
    counts = [row.n for row in per_task]
    assert len(counts) == count and set(counts) == {1}, "not one task per periodic task"
    wrong = (Task.select().join(PeriodicTask, on=(Task.periodic_task_id == PeriodicTask.id))
             .where((Task.scheduled_on != PeriodicTask.last_due)
                    | (PeriodicTask.nextrun <= PeriodicTask.last_due)
                    | PeriodicTask.worker.is_null(False)).count())
    assert wrong == 0, "%d periodic tasks not advanced as their task's due time says" % wrong
    return True


def scenario_pass(args):
    report = {}
    for backend in args.backend:
        rounds = [one_pass(backend, args.tasks, args.limit) for _ in range(args.rounds)]
        rates = [r["rate"] for r in rounds]
        report[backend] = {"rounds": rounds, "median_rate": statistics.median(rates),
                           "min_rate": min(rates), "max_rate": max(rates),
                           "median_rate_per_cpu_second": statistics.median(
                               r["rate_per_cpu_second"] for r in rounds)}
        common.print_table("one pass of %d due periodic tasks, %s" % (args.tasks, backend),
                           ["round", "seconds", "submitted", "per second", "CPU s (server)",
                            "per CPU second", "load"],
                           [[i + 1, r["seconds"], r["submitted"], r["rate"],
                             "%.2f (%.2f)" % (r["cpu_seconds"], r["server_cpu_seconds"]),
                             r["rate_per_cpu_second"], r["load_average"]]
                            for i, r in enumerate(rounds)])
    return report


def maintainer_of(overseer_pid):
    import psutil
    try:
        for child in psutil.Process(overseer_pid).children():
            if child.name() == "tr-maintainer":
                return child
    except psutil.NoSuchProcess:
        pass
    return None


def scenario_steady(args):
    import psutil
    from taskrunner.periodic.timers import parse_timer
    from taskrunner.store.models import utcnow
    report = {}
    for backend in args.backend:
        url = common.create_database(backend, "steady")
        queue = common.make_queue(url)
        first = parse_timer(TIMER).next_after(utcnow())
        add_due_periodic_tasks(queue, args.tasks, first)
        config = common.write_config(url, args.runners, "steady-%s" % backend,
                                     overseer={"check_interval": args.check_interval},
                                     log={"level": "warning"})
        proc = common.spawn([sys.executable, "-m", "taskrunner", "--config", config, "overseer"],
                            "steady-%s.log" % backend)
        try:
            maintainer = common.wait_until(lambda: maintainer_of(proc.pid), 60,
                                           "the maintainer", procs=[proc])
            # The window starts at the first due minute, so it holds whole minutes.
            common.wait_until(lambda: utcnow() >= first, 120, "the first due minute",
                              procs=[proc])
            cpu = sum(maintainer.cpu_times()[:2])
            started, minutes, pids = time.monotonic(), [], {maintainer.pid}
            end = started + args.minutes * 60
            PeriodicTask = queue.store.PeriodicTask
            minute_start, caught_up = time.monotonic(), None
            while time.monotonic() < end:
                due = PeriodicTask.select().where(PeriodicTask.nextrun <= utcnow()).count()
                now = time.monotonic()
                if due == 0 and caught_up is None:
                    caught_up = now - minute_start
                    minutes.append(round(caught_up, 2))
                elif due and caught_up is not None:
                    minute_start, caught_up = now, None
                current = maintainer_of(proc.pid)
                if current is not None and current.pid not in pids:
                    raise RuntimeError("the maintainer was replaced during the window")
                time.sleep(0.2)
            cpu = sum(maintainer.cpu_times()[:2]) - cpu
            wall = time.monotonic() - started
            tasks = queue.store.Task.select().count()
            handled = sum(r.submitted_count + r.skipped_count for r in PeriodicTask.select(
                PeriodicTask.submitted_count, PeriodicTask.skipped_count))
        finally:
            common.stop(proc)
            queue.close()
            common.drop_url(url)
        report[backend] = {"cpu_seconds": round(cpu, 2), "wall_seconds": round(wall, 1),
                           "cpu_share": round(cpu / wall, 4), "tasks_submitted": tasks,
                           "due_times_handled": handled,
                           "seconds_to_catch_up_each_minute": minutes,
                           "load_average": os.getloadavg()}
        common.print_table(
            "%d minutely timers for %.1f min, %s" % (args.tasks, wall / 60, backend),
            ["maintainer CPU s", "share of a core", "tasks", "due times handled",
             "slowest minute handled after (s)"],
            [[cpu, cpu / wall, tasks, handled, max(minutes) if minutes else "never"]])
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=("pass", "steady"))
    parser.add_argument("--backend", action="append", choices=common.BACKENDS)
    parser.add_argument("--tasks", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=float, help="pass: end a pass after this many seconds")
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--check-interval", type=float, default=1.0)
    parser.add_argument("--tree", help="import taskrunner from this tree (e.g. /work/main)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    args.backend = args.backend or ["sqlite", "postgresql"]
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    common.install_signal_cleanup()
    try:
        import taskrunner
        results = scenario_pass(args) if args.scenario == "pass" else scenario_steady(args)
        report = {"scenario": args.scenario, "tasks": args.tasks, "timer": TIMER,
                  "tree": os.path.dirname(os.path.dirname(taskrunner.__file__)),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                              "load_average": os.getloadavg()},
                  "results": results}
        common.write_json(args.json, report)
    finally:
        common.cleanup()


if __name__ == "__main__":
    main()
