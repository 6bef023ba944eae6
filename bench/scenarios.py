"""The settings of a run (`Settings`) and the scenarios of taskrunner alone: pickup
latency and footprint, scale, dead-runner detection (the comparisons with the floor and
the peers are in bench/compare.py). Each takes the backend and the settings and returns a
dict of results; bench/run.py prints and stores them. Comparisons alternate their runs
(round-robin, the order rotated every round) and report medians of the per-round ratios,
so a noisy machine slows all sides alike.
"""
import json
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass

import psutil

from bench import common
from bench.backlog import add_backlog, queue_backlog
from bench.common import (OverseerProcess, add_noop_tasks, create_database, drop_url, make_queue,
                          median, percentile, query, ratio, to_epoch, wait_until)
from bench.compare import rotated, summary


@dataclass(frozen=True)
class Settings:
    """Sizes of a full run; `Settings.make(quick=True)` those of --quick."""
    quick: bool = False
    sweep: tuple = (2,)              # throughput: the W (worker processes of every side) compared
    log_levels: tuple = ("warning",)  # throughput: every side's log level (work: the first)
    variants: tuple = (("default", {}),)   # taskrunner's: (name, {section: {key: value}})
    n: int = 20_000                  # throughput: tasks per measurement
    rounds: int = 3                  # throughput, work, enqueue: alternating rounds
    task_ms: float = 5               # work: what each task sleeps
    work_n: int = 2000               # work: tasks per measurement
    work_workers: int = 4            # work: W
    single_adds: int = 2000          # enqueue: add_task calls per measurement (and per system)
    idle_seconds: float = 30         # latency: runners idle before the burst
    settle_seconds: float = 6        # latency: after registration, past the first heartbeat
    pickup_rounds: int = 100         # pickup: jobs per system, each after an idle period (p99: 100)
    pickup_idle: float = 2.0         # pickup: seconds the workers idle before each job
    scale_sizes: tuple = (1000, 1_000_000)
    scale_drain: int = 500           # scale: runs per measurement (< the small backlog)
    scale_rounds: int = 4
    kills: int = 20                  # detection

    @classmethod
    def make(cls, quick, **given):
        """The sizes of a full or a quick run; `given` (sweep, n, ...) overrides them."""
        sizes = {} if not quick else dict(
            quick=True, n=2000, rounds=1, work_n=400, single_adds=300, idle_seconds=5,
            pickup_rounds=5,
            scale_sizes=(1000, 100_000), scale_drain=200, scale_rounds=2, kills=5)
        sizes.update({k: v for k, v in given.items() if v is not None})
        return cls(**sizes)

    @property
    def workers(self):
        """W of the scenarios that are not swept (latency, scale, detection, enqueue)."""
        return self.sweep[0]

    def timeout_for(self, jobs):
        """A generous bound for draining `jobs` (≥ 5 jobs/s: a shared machine can be that
        slow), never unbounded."""
        return 120 + jobs / 5


# -- 3, 6: pickup latency after idle, idle CPU, footprint --------------------------------

def _cpu_seconds(processes):
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def latency(backend, s, count=200, spacing=0.020):
    """Runners idle for s.idle_seconds (their CPU and RSS measured), then `count` tasks
    added one at a time, `spacing` apart: queued_on → started_on percentiles."""
    url = create_database(backend, "lat")
    make_queue(url).close()                  # the schema, before the overseer starts
    overseer = OverseerProcess(url, s.workers, "latency").start()
    try:
        overseer.wait_runners()
        # Settle: past the runners' first heartbeat, which opens the heartbeat thread's
        # connection (a one-time cost, not idle cost).
        time.sleep(s.settle_seconds)
        main = psutil.Process(overseer.proc.pid)
        runners = overseer.runner_processes()
        cpu0 = [_cpu_seconds([p]) for p in runners]
        main0, t0 = _cpu_seconds([main]), time.monotonic()
        time.sleep(s.idle_seconds)
        elapsed = time.monotonic() - t0
        runner_cpu = [100 * (_cpu_seconds([p]) - c) / elapsed for p, c in zip(runners, cpu0)]
        overseer_cpu = 100 * (_cpu_seconds([main]) - main0) / elapsed
        footprint = _footprint(main, runners)

        queue = make_queue(url)
        try:
            next_at = time.monotonic()
            for _ in range(count):
                queue.add_task(common.NOOP)
                next_at += spacing
                time.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            queue.close()
        overseer.wait_done(count, 60)
    finally:
        overseer.stop()
    rows = query(url, "SELECT t.queued_on, r.started_on FROM task_queue t "
                      "JOIN task_runs r ON r.task_id = t.id")
    drop_url(url)
    waits = [1000 * (to_epoch(started) - to_epoch(queued)) for queued, started in rows]
    return {
        "latency": {"tasks": count, "spacing_ms": spacing * 1000, "idle_s": s.idle_seconds,
                    "p50_ms": round(percentile(waits, 50), 2),
                    "p95_ms": round(percentile(waits, 95), 2),
                    "p99_ms": round(percentile(waits, 99), 2),
                    "max_ms": round(max(waits), 2),
                    "idle_runner_cpu_pct": [round(c, 3) for c in runner_cpu],
                    "idle_runner_cpu_pct_max": round(max(runner_cpu), 3),
                    "idle_overseer_cpu_pct": round(overseer_cpu, 3)},
        "rss": footprint,
    }


def _footprint(main, runners):
    def mb(p):
        info = p.memory_full_info()
        return round(info.rss / 2 ** 20, 1), round(info.uss / 2 ** 20, 1)
    overseer_rss, overseer_uss = mb(main)
    runner_mb = [mb(p) for p in runners]
    return {"overseer_rss_mb": overseer_rss, "overseer_uss_mb": overseer_uss,
            "runner_rss_mb": [m[0] for m in runner_mb], "runner_uss_mb": [m[1] for m in runner_mb],
            "runner_rss_mb_max": max(m[0] for m in runner_mb)}


# -- 4: scale ----------------------------------------------------------------------------

def _drain_worker(url, count, barrier):
    """One process of the claim/finish loop as a busy runner runs it: taskrunner's own
    claim(), then end_run_and_claim() (end_run() for the last), under a runner row of its
    own (a claim requires its runner to be registered)."""
    from taskrunner.fleet.liveness import register
    from taskrunner.runs.lifecycle import claim, end_run, end_run_and_claim
    from taskrunner.store.models import SUCCESS
    queue = make_queue(url, migrate=False)
    store = queue.store
    runner_id = register(store, take_slot=False).id
    barrier.wait(60)
    done = 0
    claimed = claim(store, runner_id)
    while claimed is not None:
        json.loads(claimed.data)
        args = (claimed.run_id, claimed.task_id, SUCCESS, runner_id)
        done += 1
        if done == count:
            end_run(store, *args, periodic_task_id=claimed.periodic_task_id)
            break
        _, claimed = end_run_and_claim(store, *args, periodic_task_id=claimed.periodic_task_id)
    queue.close()
    os._exit(0 if done == count else 3)


def drain(url, runs, workers, timeout=300):
    """Claim and finish `runs` runs with `workers` processes, timed from a common start
    barrier to the last process done. Returns runs/s."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(workers + 1)
    share = [runs // workers + (i < runs % workers) for i in range(workers)]
    procs = [common.track(context.Process(target=_drain_worker, args=(url, share[i], barrier)))
             for i in range(workers)]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(60)
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        elapsed = time.perf_counter() - start
        if any(proc.is_alive() for proc in procs):
            raise common.BenchTimeout("drain of %d runs did not finish in %ds" % (runs, timeout))
        if any(proc.exitcode for proc in procs):
            raise RuntimeError("a drain worker failed: exit codes %s" % [p.exitcode for p in procs])
        return runs / elapsed
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            if proc in common._children:
                common._children.remove(proc)


def scale(backend, s):
    """Claim throughput with a small vs a large backlog of pending tasks: drain the same
    number of runs from each, alternating, refilling the backlog (untimed) after each."""
    small, large = s.scale_sizes
    urls, build = {}, {}
    try:
        for size in (small, large):
            urls[size] = url = create_database(backend, "scale%d" % size)
            build[size] = round(queue_backlog(url, size), 2)
        rates = {small: [], large: []}
        for r in range(s.scale_rounds):
            for size in rotated([small, large], r):
                rates[size].append(drain(urls[size], s.scale_drain, s.workers))
                add_backlog(urls[size], s.scale_drain)
    finally:
        for url in urls.values():
            drop_url(url)
    ratios = [ratio(b, a) for a, b in zip(rates[small], rates[large])]
    return {"sizes": [small, large], "drained_per_measurement": s.scale_drain,
            "rounds": s.scale_rounds, "workers": s.workers, "build_seconds": build,
            "small_runs_per_s": summary(rates[small]), "large_runs_per_s": summary(rates[large]),
            "ratio": round(median(ratios), 3), "ratios": ratios}


# -- 5: dead-runner detection ------------------------------------------------------------

def detection(backend, s, min_age=6.0):
    """W runners busy on long Sleep tasks; kill -9 one at a time: time from the kill to its
    run marked timeout, and to the task's next run started.

    The victim is a runner alive for at least `min_age` s: the overseer counts a runner
    that dies within its first 5 s (START_WINDOW) as failing at start and delays its
    replacement, which is not what a kill of an established runner measures."""
    url = create_database(backend, "det")
    add_noop_tasks(url, s.workers, handler="taskrunner.handlers.Sleep", data={"seconds": 3600},
                   max_retries=1000)
    overseer = OverseerProcess(url, s.workers, "detection", task={"retry_backoff": 0}).start()
    busy_sql = ("SELECT r.id, r.task_id, r.attempt, w.pid, w.started_on FROM task_runs r "
                "JOIN task_runners w ON w.id = r.runner_id WHERE r.status = 'running' "
                "ORDER BY w.started_on")

    def victim():
        rows = query(url, busy_sql)
        if len(rows) == s.workers and time.time() - to_epoch(rows[0][4]) >= min_age:
            return rows[0]

    to_timeout, to_restart = [], []
    try:
        for _ in range(s.kills):
            run_id, task_id, attempt, pid, _ = wait_until(
                victim, 60, "%d busy runners, one %gs old" % (s.workers, min_age), procs=[overseer.proc])
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            ended = wait_until(lambda: query(url, "SELECT finished_on FROM task_runs WHERE id = ? "
                                                  "AND status = 'timeout'", (run_id,)),
                               30, "run %d to be marked timeout" % run_id, interval=0.01)
            started = wait_until(lambda: query(url, "SELECT started_on FROM task_runs WHERE "
                                                    "task_id = ? AND attempt = ? AND started_on "
                                                    "IS NOT NULL", (task_id, attempt + 1)),
                                 30, "the next run of task %d to start" % task_id, interval=0.01)
            to_timeout.append(to_epoch(ended[0][0]) - killed)
            to_restart.append(to_epoch(started[0][0]) - killed)
    finally:
        overseer.stop()
        drop_url(url)
    return {"kills": s.kills, "workers": s.workers, "check_interval_s": 1.0,
            "min_victim_age_s": min_age,
            "to_timeout_p50_s": round(percentile(to_timeout, 50), 3),
            "to_timeout_p99_s": round(percentile(to_timeout, 99), 3),
            "to_restart_p50_s": round(percentile(to_restart, 50), 3),
            "to_restart_p99_s": round(percentile(to_restart, 99), 3),
            "to_restart_max_s": round(max(to_restart), 3),
            "to_restart_s": [round(x, 3) for x in to_restart]}
