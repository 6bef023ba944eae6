"""The comparisons with the peers (Huey on SQLite; Procrastinate, PgQueuer and DBOS on
PostgreSQL; bench/systems.py), measured
side by side: the systems of a comparison run one after the other, round-robin, the order
rotated every round, and every ratio is the median of the per-round ratios, so a noisy
machine slows all sides alike.

- throughput: no-op tasks, for every W of the sweep and every log level: taskrunner (each
  variant), the peer, and — at the first log level, which they do not have — the raw-SQL
  floor and (SQLite) the disk's ceiling;
- work: the same with tasks that sleep (5 ms, W = 4);
- enqueue: add_task()/s and add_tasks()/s, and the latency of one add_task() beside the
  peers' single enqueue (Huey's `noop()`, Procrastinate's `defer()`, PgQueuer's
  `enqueue()`) on the same database server, each system's workers running, in alternating
  blocks of calls;
- pickup: after the workers idled 2 s, one job queued: the time until its handler runs,
  beside Huey's (SQLite) and PgQueuer's (PostgreSQL).
"""
import os
import time

from bench import common
from bench.common import (OverseerProcess, create_database, drop_url, make_queue, median,
                          percentile, query, ratio, wait_until)
from bench.waits import median_summary
from bench.systems import (CLASSIC, PEERS, Ceiling, Floor, Huey, Job, PgQueuer, Taskrunner,
                           marks_count, measure)

RATES = ("jobs_per_s", "steady_jobs_per_s")
MARK = "bench.handlers.Mark"
# pickup: the peer each backend is held to (issue 32: no worse than Huey's on SQLite and
# PgQueuer's on PostgreSQL; PgQueuer's batch size does not change how it picks one job up).
PICKUP_PEERS = ("huey", "pgqueuer batch=1")
PARTIAL = {}            # backend → the throughput cells measured so far


def rotated(items, r):
    r %= len(items)
    return items[r:] + items[:r]


def summary(values):
    return {"median": round(median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def peers_of(backend, names=None):
    """(the peers compared on this backend, {peer: why it is skipped}); only those named in
    `names` when given."""
    available, skipped = [], {}
    for peer in PEERS:
        if names is not None and peer.name not in names:
            continue
        why = peer.available(backend)
        if why is None:
            available.append(peer)
        elif backend in peer.backends:
            skipped[peer.name] = why
    return available, skipped


def taskrunners(s):
    return [Taskrunner(name, sections) for name, sections in s.variants]


def measure_rounds(backend, plan, rounds):
    """Every (job, system) of `plan` measured once per round, the order rotated every round
    → {(log level, system name): [result of each round]}."""
    runs = {(job.log_level, system.name): [] for job, system in plan}
    for r in range(rounds):
        for job, system in rotated(plan, r):
            runs[(job.log_level, system.name)].append(measure(system, backend, job))
    return runs


def cell_of(job, runs, rounds):
    """One cell of the tables from {system name: [result of each round]}."""
    peer = next((p.name for p in PEERS if p.name in runs), None)
    # The floor and the ceiling are read against the first variant of taskrunner measured
    # (``taskrunner`` itself unless --variants leaves the default out).
    ours = next((name for name in runs if name.startswith("taskrunner")), None)
    cell = {"workers": job.workers, "log_level": job.log_level, "task_ms": job.task_ms,
            "n": job.n, "rounds": rounds, "peer": peer, "systems": {}}
    for name, per_round in runs.items():
        entry = {key: summary([m[key] for m in per_round]) for key in RATES}
        if "cpu_s" in per_round[0]:
            for key in ("cpu_s_per_1000", "db_cpu_s_per_1000"):
                values = [m[key] for m in per_round if m[key] is not None]
                entry[key] = round(median(values), 3) if values else None
            entry["shares"] = [m["shares"] for m in per_round]
            entry["waits"] = median_summary([m.get("waits") for m in per_round])
        if any(m.get("lost") for m in per_round):
            entry["lost"] = sum(m.get("lost", 0) for m in per_round)
        if peer and name != peer:
            # name / peer, per round, then the median: the pairs ran side by side.
            entry["over_peer"] = _ratios(per_round, runs[peer])
        if name.startswith("taskrunner"):
            # ÷ every other system of the cell (the floor, the ceiling, each peer).
            entry["over"] = {other: _ratios(per_round, runs[other]) for other in runs
                             if not other.startswith("taskrunner")}
        if name in ("floor", "ceiling") and ours is not None:
            entry["taskrunner_over"] = _ratios(runs[ours], per_round)["jobs_per_s"]
        entry["runs"] = per_round
        cell["systems"][name] = entry
    return cell


def _ratios(these, those):
    """Median of the per-round ratios these / those, for each rate."""
    return {key: round(median([ratio(a[key], b[key]) for a, b in zip(these, those)]), 3)
            for key in RATES}


def compare(backend, systems, job, rounds):
    """Measure `systems` on `job`, alternating, `rounds` rounds: one cell of the tables."""
    runs = measure_rounds(backend, [(job, system) for system in systems], rounds)
    return cell_of(job, {name: v for (_, name), v in runs.items()}, rounds)


# -- throughput and work -----------------------------------------------------------------

def throughput(backend, s):
    """No-op tasks: for each W, every log level's taskrunner and peer (and, once, the floor
    and the ceiling) alternating in the same rounds; a cell per (W, log level), and in the
    cells after the first level each system's first level ÷ this one ("first_level_over").
    A W that fails is reported as such ("errors") and the sweep goes on."""
    peers, skipped = peers_of(backend)
    bounds = [Floor()] + ([Ceiling()] if backend in Ceiling.backends else [])
    cells, errors = [], []
    # What is done so far, for bench/run.py to keep when the run is stopped (watchdog, TERM).
    PARTIAL[backend] = {"cells": cells, "skipped": skipped, "errors": errors, "partial": True}
    for workers in s.sweep:
        jobs = [Job(n=s.n, workers=workers, log_level=level, timeout=s.timeout_for(s.n))
                for level in s.log_levels]
        plan = [(job, system) for i, job in enumerate(jobs)
                for system in taskrunners(s) + ([] if i else bounds) + peers]
        try:
            runs = measure_rounds(backend, plan, s.rounds)
        except Exception as exc:
            errors.append("W=%d: %s: %s" % (workers, type(exc).__name__, exc))
            print("   W=%d failed: %s" % (workers, errors[-1]), flush=True)
            continue
        by_level = [{name: v for (level, name), v in runs.items() if level == job.log_level}
                    for job in jobs]
        for job, level_runs in zip(jobs, by_level):
            cell = cell_of(job, level_runs, s.rounds)
            if job is not jobs[0]:
                for name, entry in cell["systems"].items():
                    entry["first_level_over"] = dict(_ratios(by_level[0][name], level_runs[name]),
                                                     level=jobs[0].log_level)
            cells.append(cell)
    if not cells:
        raise RuntimeError("; ".join(errors))
    return {"cells": cells, "skipped": skipped, "errors": errors}


def work(backend, s):
    """Tasks sleeping s.task_ms each, W = s.work_workers, at the first log level (the
    classic peers: Huey, Procrastinate)."""
    peers, skipped = peers_of(backend, CLASSIC)
    job = Job(n=s.work_n, workers=s.work_workers, log_level=s.log_levels[0], task_ms=s.task_ms,
              timeout=s.timeout_for(s.work_n) + s.work_n * s.task_ms / 1000.0)
    return {"cells": [compare(backend, taskrunners(s) + peers, job, s.rounds)], "skipped": skipped}


# -- enqueue -----------------------------------------------------------------------------

def enqueue(backend, s):
    """add_task one call at a time, add_tasks with the whole batch, alternating; then the
    latency of a single enqueue beside the peer's."""
    url = create_database(backend, "enq")
    queue = make_queue(url)
    single, bulk = [], []
    try:
        for _ in range(s.rounds):
            start = time.perf_counter()
            for _ in range(s.single_adds):
                queue.add_task(common.NOOP)
            single.append(s.single_adds / (time.perf_counter() - start))
            specs = [{"handler": common.NOOP} for _ in range(s.n)]
            start = time.perf_counter()
            queue.add_tasks(specs)
            bulk.append(s.n / (time.perf_counter() - start))
    finally:
        queue.close()
        drop_url(url)
    return {"single_calls": s.single_adds, "bulk_size": s.n,
            "add_task_per_s": summary(single), "add_tasks_per_s": summary(bulk),
            "single": single_enqueue(backend, s)}


# -- pickup ------------------------------------------------------------------------------

def pickup(backend, s, warmup=5):
    """Pickup after idle, taskrunner beside the peer it is held to (PICKUP_PEERS): each
    system's W workers idle for s.pickup_idle seconds, then one job is queued, and the time
    from the enqueue call's return to the job's handler running (its mark) is taken; every
    round, every system in rotated order (their idle periods overlap), each job's outcome
    recorded before the next system's job is queued. A negative time is a handler that ran
    before the enqueuing call returned."""
    peers, skipped = peers_of(backend, PICKUP_PEERS)
    if not peers:
        return {"skipped": skipped} if skipped else None
    systems, times = [], {}
    try:
        _start_enqueuers(systems, backend, peers, s.workers, warmup, marked=True)
        times = {e.name: [] for e in systems}
        for r in range(s.pickup_rounds):
            time.sleep(s.pickup_idle)
            for e in rotated(systems, r):
                before, done = marks_count(e.marks), e.done()
                e.call()
                returned = time.time()
                wait_until(lambda: marks_count(e.marks) > before, 60,
                           "%s to run the job queued" % e.name, interval=0.002, procs=e.procs)
                times[e.name].append(1000 * (e.last_mark() - returned))
                # Its outcome written (PgQueuer buffers its acknowledgement up to 0.1 s)
                # before the next system's job: no system's write lands in another's pickup.
                wait_until(lambda: e.done() > done, 60, "%s to record the job" % e.name,
                           interval=0.01, procs=e.procs)
    finally:
        for e in systems:
            e.stop()
    result = {"rounds": s.pickup_rounds, "idle_s": s.pickup_idle, "workers": s.workers,
              "peer": peers[0].name, "systems": {}}
    for name, values in times.items():
        result["systems"][name] = {"p50_ms": round(percentile(values, 50), 2),
                                   "p95_ms": round(percentile(values, 95), 2),
                                   "p99_ms": round(percentile(values, 99), 2),
                                   "max_ms": round(max(values), 2)}
    ours, peer = result["systems"]["taskrunner"], result["systems"][peers[0].name]
    for q in ("p50", "p99"):
        result[q + "_over_peer"] = ratio(ours[q + "_ms"], peer[q + "_ms"])
    if skipped:
        result["skipped"] = skipped
    return result


def _start_enqueuers(systems, backend, peers, workers, warmup, marked=False):
    """taskrunner's and each peer's _Enqueuer appended to `systems` (the caller stops them,
    even those started before a failure), each having run `warmup` untimed jobs."""
    for system in [Taskrunner()] + peers:
        systems.append(_Enqueuer(backend, system, workers, marked=marked))
    for e in systems:
        for _ in range(warmup):
            e.call()
    for e in systems:
        wait_until(lambda: e.done() >= warmup, 60, "%s to run %d tasks" % (e.name, warmup),
                   interval=0.1, procs=e.procs)


class _Enqueuer:
    """One system's single enqueue, with its W workers running (idle between calls, as
    beside a web application): `call()` queues one no-op, `done()` counts those run. With
    `marked`, each job appends "TIME PID" to the file `marks` when it runs (taskrunner:
    bench.handlers.Mark; Huey and PgQueuer: their no-op marks anyway)."""

    def __init__(self, backend, system, workers, marked=False):
        self.name = system.name
        self.job = Job(n=0, workers=workers)
        self.procs, self.close_call, self.marks = [], None, None
        if isinstance(system, Taskrunner):
            self.ctx = url = create_database(backend, "enq1")
            queue = make_queue(url)
            overseer = OverseerProcess(url, workers, "enqueue", log={"level": "warning"}).start()
            self.procs = [overseer.proc]
            if marked:
                self.marks = os.path.join(common.workdir(), "taskrunner-%d.marks"
                                          % time.monotonic_ns())
                self.call = lambda: queue.add_task(MARK, {"marks": self.marks})
            else:
                self.call = lambda: queue.add_task(common.NOOP)
            self.close_call = queue.close
            self.done = lambda: query(url, "SELECT count(*) FROM task_runs WHERE status = 'success'")[0][0]
            self.teardown = lambda: (overseer.stop(), drop_url(url))
            return
        self.ctx = ctx = system.prepare(backend, self.job)
        self.teardown = lambda: system.teardown(ctx)
        self.procs = system.start(ctx, self.job)
        if isinstance(system, Huey):
            from bench import huey_app
            self.call, self.close_call = huey_app.enqueuer(ctx[0])
            self.marks = ctx[1]
            self.done = lambda: marks_count(ctx[1])
        elif isinstance(system, PgQueuer):
            from bench import pgqueuer_app
            self.call, self.close_call = pgqueuer_app.enqueuer(ctx[0])
            self.marks = ctx[1]
            self.done = lambda: query(ctx[0], PgQueuer.DONE)[0][0]     # acknowledged
        else:
            from bench import procrastinate_app
            self.call, self.close_call = procrastinate_app.enqueuer(ctx)
            self.done = lambda: query(ctx, "SELECT count(*) FROM procrastinate_events "
                                           "WHERE type = 'succeeded'")[0][0]

    def last_mark(self):
        """The time of the last job marked (epoch seconds)."""
        with open(self.marks, "rb") as fh:
            return float(fh.read().splitlines()[-1].split()[0])

    def stop(self):
        try:
            if self.close_call:
                self.close_call()
            for proc in self.procs:
                common.stop(proc)
        finally:
            self.teardown()


def single_enqueue(backend, s, block=50, warmup=20):
    """Per-call latency (ms) of one enqueue, taskrunner beside the peer, in alternating
    blocks of `block` calls, s.single_adds calls each; every system's workers run (W =
    s.workers) and have run `warmup` untimed calls first. The peers: Huey, Procrastinate
    and PgQueuer (`p50_over_peer` is of the first, `over_peers` of each)."""
    peers, skipped = peers_of(backend, CLASSIC + ("pgqueuer batch=1",))
    if not peers:
        return {"skipped": skipped} if skipped else None
    systems = []
    try:
        _start_enqueuers(systems, backend, peers, s.workers, warmup)
        times = {e.name: [] for e in systems}
        for b in range(max(1, s.single_adds // block)):
            for e in rotated(systems, b):
                for _ in range(block):
                    start = time.perf_counter()
                    e.call()
                    times[e.name].append(1000 * (time.perf_counter() - start))
    finally:
        for e in systems:
            e.stop()
    result = {"calls": len(times["taskrunner"]), "block": block, "workers": s.workers,
              "peer": peers[0].name, "systems": {}}
    for name, values in times.items():
        result["systems"][name] = {"p%d_ms" % q: round(percentile(values, q), 3)
                                   for q in (50, 95, 99)}
    ours = result["systems"]["taskrunner"]
    result["over_peers"] = {peer.name: ratio(ours["p50_ms"], result["systems"][peer.name]["p50_ms"])
                            for peer in peers}
    result["p99_over_peers"] = {
        peer.name: ratio(ours["p99_ms"], result["systems"][peer.name]["p99_ms"]) for peer in peers}
    result["p50_over_peer"] = result["over_peers"][peers[0].name]
    return result

