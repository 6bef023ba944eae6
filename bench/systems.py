"""The things whose throughput is compared: taskrunner, the raw-SQL floor, and the peers
(Huey on SQLite; Procrastinate, PgQueuer and DBOS Transact on PostgreSQL). Each drains n no-op jobs queued beforehand
with `workers` worker processes; what is timed is launch → last finish, and the steady rate
between the 10th and 90th percentile of finish times (see common.rates).

A system: ``available(backend)`` → None or why not; ``prepare(backend, job)`` → a context
with job.n jobs queued (untimed); ``run(ctx, job)`` → rates, and for taskrunner and the
peers CPU seconds (bench/cpu.py) and each worker's share of the jobs; ``teardown(ctx)``.
The floor and the ceiling drain no-ops only.
"""
import importlib.util
import os
import sqlite3
import sys
import time
from collections import Counter
from dataclasses import dataclass

from bench import common
from bench.backlog import queue_backlog
from bench.common import (BenchTimeout, OverseerProcess, create_database, drop_url, finish_times,
                          query, rates, spawn, stop, wait_until)
from bench.cpu import Meter, per_1000


@dataclass(frozen=True)
class Job:
    """What one measurement drains: n tasks, each a no-op or (task_ms > 0) a sleep of
    task_ms milliseconds, with `workers` worker processes logging at `log_level`
    (warning or info, each system's own knob), within `timeout` seconds."""
    n: int
    workers: int
    log_level: str = "warning"
    task_ms: float = 0
    timeout: float = 300


def _finish(meter, finishes, launched, shares):
    """A measurement's result: rates, CPU per 1,000 jobs, each worker's share."""
    usage = meter.finish()
    result = rates(launched, finishes)
    sampler = usage.pop("waits")
    result.update(usage)
    result.update(per_1000(usage, max(1, len(finishes))))
    # Where the workers spent their time, from the first finish to the last.
    result["waits"] = sampler.summary((finishes[0], finishes[-1]) if finishes else None)
    result["shares"] = shares_of(shares)
    return result


def shares_of(counts):
    """Each worker's fraction of the jobs, largest first; None when unknown."""
    counts = sorted((c for c in counts if c), reverse=True)
    total = sum(counts)
    return [round(c / total, 3) for c in counts] if total else None


class Taskrunner:
    """`taskrunner overseer` with [runner] limit = W and [log] level; a variant adds its
    own config options ({"runner": {"batch": 16}})."""

    def __init__(self, variant="default", sections=None):
        self.variant = variant
        self.sections = sections or {}
        self.name = "taskrunner" if variant == "default" else "taskrunner %s" % variant

    def available(self, backend):
        return None

    def prepare(self, backend, job):
        url = create_database(backend, "tput")
        handler, data = (common.NOOP, None) if not job.task_ms else (SLEEP, {"ms": job.task_ms})
        queue_backlog(url, job.n, handler, data)
        return url

    def start(self, url, job, label="throughput"):
        sections = common.merge_sections({"log": {"level": job.log_level}}, self.sections)
        return OverseerProcess(url, job.workers, label, **sections).start()

    def run(self, url, job):
        overseer = self.start(url, job)
        meter = Meter(url, [overseer.proc.pid])
        try:
            overseer.wait_done(job.n, job.timeout, tick=meter.tick)
            return _finish(meter, finish_times(url), overseer.launched,
                           [row[0] for row in query(url, "SELECT count(*) FROM task_runs WHERE "
                                                          "status = 'success' GROUP BY runner_id")])
        finally:
            meter.close()
            overseer.stop()

    def teardown(self, url):
        drop_url(url)


SLEEP = "bench.handlers.Sleep"


def _drain_with(commands, name, n, timeout):
    """Start one `python -m` process per command, wait until all have exited (drained the
    queue), and return the launch time; a failed or hung worker raises."""
    launched = time.time()
    procs = [spawn([sys.executable, "-m"] + argv, name + ".log") for argv in commands]
    try:
        wait_until(lambda: all(p.poll() is not None for p in procs), timeout,
                   "the %s workers to drain %d jobs" % (name, n), interval=0.1)
    finally:
        for proc in procs:
            stop(proc)
    if any(p.returncode for p in procs):
        raise RuntimeError("a %s worker failed (log: %s)" % (name, common.workdir()))
    return launched


class Floor:
    """bench/floor.py: W raw-SQL worker processes on taskrunner's schema and rows."""
    name = "floor"

    def prepare(self, backend, job):
        url = create_database(backend, "floor")
        queue_backlog(url, job.n)
        return url

    def run(self, url, job):
        launched = _drain_with([["bench.floor", url, str(i + 1), common.SQLITE_SYNCHRONOUS]
                                for i in range(job.workers)], "floor", job.n, job.timeout)
        finishes = finish_times(url)
        if len(finishes) != job.n:
            raise RuntimeError("floor: %d of %d runs finished" % (len(finishes), job.n))
        return rates(launched, finishes)

    def teardown(self, url):
        drop_url(url)


class Ceiling:
    """bench/ceiling.py: W processes taking one row per commit off a one-table SQLite queue —
    the most any queue that commits once per job can do on this disk."""
    name = "ceiling"
    backends = ("sqlite",)

    def prepare(self, backend, job):
        base = os.path.join(common.workdir(), "ceiling-%d-%d" % (os.getpid(), time.monotonic_ns()))
        proc = spawn([sys.executable, "-m", "bench.ceiling", "prepare", base + ".db", str(job.n)],
                     "ceiling.log")
        wait_until(lambda: proc.poll() is not None, 300, "the ceiling's queue", procs=())
        if proc.returncode:
            raise RuntimeError("ceiling prepare failed (log: %s)" % common.workdir())
        return base

    def run(self, base, job):
        outs = ["%s.%d.finishes" % (base, i) for i in range(job.workers)]
        launched = _drain_with([["bench.ceiling", "work", base + ".db", common.SQLITE_SYNCHRONOUS,
                                 out] for out in outs], "ceiling", job.n, job.timeout)
        finishes = []
        for out in outs:
            with open(out) as fh:
                finishes.extend(float(line) for line in fh)
        if len(finishes) != job.n:
            raise RuntimeError("ceiling: %d of %d jobs finished" % (len(finishes), job.n))
        return rates(launched, sorted(finishes))

    def teardown(self, base):
        for suffix in (".db", ".db-wal", ".db-shm"):
            if os.path.exists(base + suffix):
                os.unlink(base + suffix)


def _installed(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return None if not missing else "not installed (pip install '.[bench]'): %s" % ", ".join(missing)


class Huey:
    """SqliteHuey, `huey_consumer -k process -w W` (`-q` at log level warning: its own
    default is info); finish times and worker pids from bench/huey_app.py's marks."""
    name = "huey"
    backends = ("sqlite",)

    def available(self, backend):
        if backend not in self.backends:
            return "Huey is compared on SQLite only"
        return _installed("huey")

    def _env(self, ctx):
        env = common.child_env()
        env["BENCH_HUEY_DB"], env["BENCH_MARKS"] = ctx
        env["BENCH_SQLITE_SYNCHRONOUS"] = common.SQLITE_SYNCHRONOUS
        return env

    def prepare(self, backend, job):
        base = os.path.join(common.workdir(), "huey-%d-%d" % (os.getpid(), time.monotonic_ns()))
        ctx = (base + ".db", base + ".marks")
        _run_to_end(["-c", "from bench.huey_app import enqueue; enqueue(%d, %r)"
                     % (job.n, job.task_ms)], "huey-enqueue.log", "Huey enqueue",
                    env=self._env(ctx))
        return ctx

    def start(self, ctx, job):
        quiet = ["-q"] if job.log_level == "warning" else []
        return [spawn([sys.executable, "-m", "huey.bin.huey_consumer", "bench.huey_app.huey",
                       "-k", "process", "-w", str(job.workers)] + quiet, "huey.log",
                      env=self._env(ctx))]

    def run(self, ctx, job):
        marks = ctx[1]
        launched = time.time()
        procs = self.start(ctx, job)
        meter = Meter("sqlite:///" + ctx[0], [p.pid for p in procs], children="but the first")
        try:
            wait_until(self._settled(ctx, job.n), job.timeout, "Huey to run %d tasks" % job.n,
                       interval=0.2, procs=procs, tick=meter.tick)
            with open(marks) as fh:
                lines = [line.split() for line in fh]
            result = _finish(meter, sorted(float(t) for t, _ in lines), launched,
                             Counter(pid for _, pid in lines).values())
            result["lost"] = job.n - len(lines)
            return result
        finally:
            meter.close()
            for proc in procs:
                stop(proc)

    def _settled(self, ctx, n, quiet=10.0):
        """A predicate: all n tasks done, or none left in Huey's queue and none finished for
        `quiet` s. Huey loses a task whose bookkeeping meets "database is locked" after it
        was dequeued (its consumer logs "Unhandled error during execution"; seen on a loaded
        machine): the run reports it as lost instead of waiting for it until its timeout."""
        last = {"count": -1, "since": time.monotonic()}

        def settled():
            count = marks_count(ctx[1])
            if count >= n:
                return True
            if count != last["count"]:
                last.update(count=count, since=time.monotonic())
                return False
            return time.monotonic() - last["since"] > quiet and huey_queued(ctx[0]) == 0
        return settled

    def teardown(self, ctx):
        for path in (ctx[0], ctx[0] + "-wal", ctx[0] + "-shm", ctx[1]):
            if os.path.exists(path):
                os.unlink(path)


def huey_queued(path):
    """Tasks left in Huey's queue table, or None when its database is busy."""
    try:
        conn = sqlite3.connect(path, timeout=1)
        try:
            return conn.execute("SELECT count(*) FROM task").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return None


def marks_count(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _run_to_end(args, log, what, env=None):
    """`python args...` run to its end (untimed preparation); raises when it failed."""
    proc = spawn([sys.executable] + args, log, env=env)
    wait_until(lambda: proc.poll() is not None, 300, what, procs=())
    if proc.returncode:
        raise RuntimeError("%s failed (log: %s)" % (what, common.workdir()))


class _PostgresPeer:
    """What the peers on PostgreSQL share: `start` launches W worker processes, timed until
    the count `DONE` reaches job.n, then stopped; `results(ctx)` gives the finish times and
    each worker's share of the jobs. A context is the database's URL unless `url` says."""
    backends = ("postgresql",)
    TITLE = MODULES = DONE = JOBS = None
    ONLY = ""            # why PostgreSQL only, when it needs saying

    def available(self, backend):
        if backend not in self.backends:
            return "%s is compared on PostgreSQL only%s" % (self.TITLE, self.ONLY)
        return _installed(*self.MODULES)

    def url(self, ctx):
        return ctx

    def run(self, ctx, job):
        url = self.url(ctx)
        launched = time.time()
        procs = self.start(ctx, job)
        meter = Meter(url, [p.pid for p in procs], children=False)
        try:
            wait_until(lambda: query(url, self.DONE)[0][0] >= job.n, job.timeout,
                       "%s to run %d %s" % (self.TITLE, job.n, self.JOBS), interval=0.2,
                       procs=procs, tick=meter.tick)
            finishes, shares = self.results(ctx)
            return _finish(meter, sorted(finishes), launched, shares)
        finally:
            meter.close()
            for proc in procs:
                stop(proc)

    def teardown(self, ctx):
        drop_url(self.url(ctx))


class Procrastinate(_PostgresPeer):
    """W `procrastinate worker --concurrency 1` processes (`--log-level` as the bench's:
    its own default is info), stopped once the jobs are done; finish times from its
    procrastinate_events table (type 'succeeded'), each worker's share from the jobs'
    worker_id (read before the workers stop: a stopping worker's id is cleared)."""
    name = "procrastinate"
    TITLE, MODULES, JOBS = "Procrastinate", ("procrastinate", "psycopg"), "jobs"
    DONE = "SELECT count(*) FROM procrastinate_events WHERE type = 'succeeded'"
    APP = "bench.procrastinate_app.app"

    def _env(self, url):
        env = common.child_env()
        env["BENCH_PROCRASTINATE_DSN"] = url
        return env

    def prepare(self, backend, job):
        url = create_database(backend, "procr")
        _run_to_end(["-m", "procrastinate", "--app", self.APP, "schema", "--apply"],
                    "procrastinate-schema.log", "schema --apply", env=self._env(url))
        _run_to_end(["-c", "from bench.procrastinate_app import enqueue; enqueue(%d, %r)"
                     % (job.n, job.task_ms)], "procrastinate-enqueue.log",
                    "Procrastinate enqueue", env=self._env(url))
        return url

    def start(self, url, job):
        return [spawn([sys.executable, "-m", "procrastinate", "--app", self.APP, "--log-level",
                       job.log_level, "worker", "--concurrency", "1"], "procrastinate.log",
                      env=self._env(url)) for _ in range(job.workers)]

    def results(self, url):
        shares = [row[0] for row in query(url, "SELECT count(*) FROM procrastinate_jobs WHERE "
                                               "status = 'succeeded' GROUP BY worker_id")]
        rows = query(url, "SELECT at FROM procrastinate_events WHERE type = 'succeeded'")
        return [common.to_epoch(r[0]) for r in rows], shares


class PgQueuer(_PostgresPeer):
    """W `python -m bench.pgqueuer_app work` processes (one QueueManager on one asyncpg
    connection each, PgQueuer's recommended driver), stopped once the jobs are done; with
    `batch_size` jobs per dequeue and per flush of its acknowledgement buffer (1: each ack
    flushed on its own — the durable class; 100: its fastest here — the batched class; see
    bench/pgqueuer_app.py). Finish times from its pgqueuer_log table (status 'successful'),
    each worker's share from the pid each job writes."""
    TITLE, MODULES, JOBS = "PgQueuer", ("pgqueuer", "asyncpg"), "jobs"
    DONE = "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'"

    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.name = "pgqueuer batch=%d" % batch_size

    def prepare(self, backend, job):
        url = create_database(backend, "pgq")
        marks = os.path.join(common.workdir(), "pgq-%d-%d.marks" % (os.getpid(), time.monotonic_ns()))
        _run_to_end(["-c", "from bench.pgqueuer_app import install, enqueue; install(%r); "
                     "enqueue(%r, %d, %r)" % (url, url, job.n, job.task_ms)],
                    "pgqueuer-enqueue.log", "PgQueuer install and enqueue")
        return url, marks

    def start(self, ctx, job):
        url, marks = ctx
        env = common.child_env()
        env["BENCH_LOG_LEVEL"] = job.log_level
        return [spawn([sys.executable, "-m", "bench.pgqueuer_app", "work", url,
                       str(self.batch_size), marks], "pgqueuer.log", env=env)
                for _ in range(job.workers)]

    def url(self, ctx):
        return ctx[0]

    def results(self, ctx):
        url, marks = ctx
        rows = query(url, "SELECT created FROM pgqueuer_log WHERE status = 'successful'")
        with open(marks) as fh:
            shares = Counter(line.split()[1] for line in fh).values()
        return [common.to_epoch(r[0]) for r in rows], shares

    def teardown(self, ctx):
        super().teardown(ctx)
        if os.path.exists(ctx[1]):
            os.unlink(ctx[1])


class Dbos(_PostgresPeer):
    """DBOS Transact: W `python -m bench.dbos_app work` processes, one executor id each,
    serving one queue of no-op workflows (one workflow per job), stopped once the jobs are
    done. The queue as DBOS makes it by default: no per-process limit (a process claims all
    it finds at a poll and runs them in its thread pool) and a poll every second; in a trial
    here (W = 2, 2,000 jobs) that was its fastest against worker_concurrency 16, 50 and 100
    with polls of 0.05–1 s. Finish times from its workflow_status table (updated_at of
    SUCCESS rows), shares from their executor_id."""
    name = "dbos"
    TITLE, MODULES, JOBS = "DBOS", ("dbos", "psycopg"), "workflows"
    ONLY = " (it documents SQLite for development)"
    DONE = "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'"
    CONCURRENCY = 0          # 0: DBOS's default, no worker_concurrency
    POLL_SECONDS = 1.0       # DBOS's default polling_interval_sec

    def prepare(self, backend, job):
        if job.task_ms:
            raise ValueError("the DBOS peer runs no-op workflows only")
        url = create_database(backend, "dbos")
        _run_to_end(["-c", "from bench.dbos_app import install, enqueue; install(%r); "
                     "enqueue(%r, %d)" % (url, url, job.n)], "dbos-enqueue.log",
                    "DBOS install and enqueue")
        return url

    def start(self, url, job):
        env = common.child_env()
        env.update(BENCH_LOG_LEVEL=job.log_level, BENCH_DBOS_CONCURRENCY=str(self.CONCURRENCY),
                   BENCH_DBOS_POLL=str(self.POLL_SECONDS))
        return [spawn([sys.executable, "-m", "bench.dbos_app", "work", url, "w%d" % i],
                      "dbos.log", env=env) for i in range(job.workers)]

    def results(self, url):
        shares = [row[0] for row in query(url, "SELECT count(*) FROM dbos.workflow_status "
                                               "WHERE status = 'SUCCESS' GROUP BY executor_id")]
        rows = query(url, "SELECT updated_at FROM dbos.workflow_status WHERE status = 'SUCCESS'")
        return [r[0] / 1000.0 for r in rows], shares


# The peers of the throughput comparison, and the durability class each is compared in:
# "durable" (every outcome committed before, or as soon as, the next job starts; taskrunner's
# default) or "batched" (outcomes committed in groups; taskrunner with [runner] batch).
PEERS = (Huey(), Procrastinate(), PgQueuer(1), PgQueuer(100), Dbos())
CLASSES = {"huey": "durable", "procrastinate": "durable", "pgqueuer batch=1": "durable",
           "dbos": "durable", "pgqueuer batch=100": "batched"}
# The peers whose sleeping task (work) and single enqueue (enqueue) the bench also times.
CLASSIC = ("huey", "procrastinate")


def measure(system, backend, job):
    """prepare → run → teardown, whatever happens."""
    ctx = system.prepare(backend, job)
    try:
        return system.run(ctx, job)
    finally:
        system.teardown(ctx)


__all__ = ["Job", "Taskrunner", "Floor", "Ceiling", "Huey", "Procrastinate", "PgQueuer", "Dbos",
           "PEERS", "CLASSES", "CLASSIC", "measure", "BenchTimeout"]
