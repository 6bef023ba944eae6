"""The things whose throughput is compared: taskrunner, the raw-SQL floor, and the peers
(Huey on SQLite, Procrastinate on PostgreSQL). Each drains n no-op jobs queued beforehand
with `workers` worker processes; what is timed is launch → last finish, and the steady rate
between the 10th and 90th percentile of finish times (see common.rates).

A system: ``available(backend)`` → None or why not; ``prepare(backend, n)`` → a context with
n jobs queued (untimed); ``run(ctx, n, workers, timeout)`` → rates; ``teardown(ctx)``.
"""
import importlib.util
import os
import sys
import time

from bench import common
from bench.backlog import queue_backlog
from bench.common import (BenchTimeout, OverseerProcess, create_database, drop_url, finish_times,
                          query, rates, spawn, stop, wait_until)


class Taskrunner:
    name = "taskrunner"

    def available(self, backend):
        return None

    def prepare(self, backend, n):
        url = create_database(backend, "tput")
        queue_backlog(url, n)
        return url

    def run(self, url, n, workers, timeout):
        overseer = OverseerProcess(url, workers, "throughput").start()
        try:
            overseer.wait_done(n, timeout)
        finally:
            overseer.stop()
        return rates(overseer.launched, finish_times(url))

    def teardown(self, url):
        drop_url(url)


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


class Floor(Taskrunner):
    """bench/floor.py: W raw-SQL worker processes on taskrunner's schema and rows."""
    name = "floor"

    def run(self, url, n, workers, timeout):
        launched = _drain_with([["bench.floor", url, str(i + 1), common.SQLITE_SYNCHRONOUS]
                                for i in range(workers)], "floor", n, timeout)
        finishes = finish_times(url)
        if len(finishes) != n:
            raise RuntimeError("floor: %d of %d runs finished" % (len(finishes), n))
        return rates(launched, finishes)


class Ceiling:
    """bench/ceiling.py: W processes taking one row per commit off a one-table SQLite queue —
    the most any queue that commits once per job can do on this disk."""
    name = "ceiling"
    backends = ("sqlite",)

    def prepare(self, backend, n):
        base = os.path.join(common.workdir(), "ceiling-%d-%d" % (os.getpid(), time.monotonic_ns()))
        proc = spawn([sys.executable, "-m", "bench.ceiling", "prepare", base + ".db", str(n)],
                     "ceiling.log")
        wait_until(lambda: proc.poll() is not None, 300, "the ceiling's queue", procs=())
        if proc.returncode:
            raise RuntimeError("ceiling prepare failed (log: %s)" % common.workdir())
        return base

    def run(self, base, n, workers, timeout):
        outs = ["%s.%d.finishes" % (base, i) for i in range(workers)]
        launched = _drain_with([["bench.ceiling", "work", base + ".db", common.SQLITE_SYNCHRONOUS,
                                 out] for out in outs], "ceiling", n, timeout)
        finishes = []
        for out in outs:
            with open(out) as fh:
                finishes.extend(float(line) for line in fh)
        if len(finishes) != n:
            raise RuntimeError("ceiling: %d of %d jobs finished" % (len(finishes), n))
        return rates(launched, sorted(finishes))

    def teardown(self, base):
        for suffix in (".db", ".db-wal", ".db-shm"):
            if os.path.exists(base + suffix):
                os.unlink(base + suffix)


def _installed(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return None if not missing else "not installed (pip install '.[bench]'): %s" % ", ".join(missing)


class Huey:
    """SqliteHuey, `huey_consumer -k process -w W`, finish times from bench/huey_app.py."""
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

    def prepare(self, backend, n):
        base = os.path.join(common.workdir(), "huey-%d-%d" % (os.getpid(), time.monotonic_ns()))
        ctx = (base + ".db", base + ".marks")
        proc = spawn([sys.executable, "-c", "from bench.huey_app import enqueue; enqueue(%d)" % n],
                     "huey-enqueue.log",
                     env=self._env(ctx))
        wait_until(lambda: proc.poll() is not None, 300, "Huey enqueue", procs=())
        if proc.returncode:
            raise RuntimeError("Huey enqueue failed (log: %s)" % common.workdir())
        return ctx

    def run(self, ctx, n, workers, timeout):
        marks = ctx[1]
        launched = time.time()
        proc = spawn([sys.executable, "-m", "huey.bin.huey_consumer", "bench.huey_app.huey",
                      "-k", "process", "-w", str(workers)], "huey.log", env=self._env(ctx))
        try:
            wait_until(lambda: _lines(marks) >= n, timeout, "Huey to run %d tasks" % n,
                       interval=0.2, procs=[proc])
        finally:
            stop(proc)
        with open(marks) as fh:
            return rates(launched, sorted(float(line) for line in fh))

    def teardown(self, ctx):
        for path in (ctx[0], ctx[0] + "-wal", ctx[0] + "-shm", ctx[1]):
            if os.path.exists(path):
                os.unlink(path)


def _lines(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


class Procrastinate:
    """W `procrastinate worker --concurrency 1 --one-shot` processes; finish times from its
    procrastinate_events table (type 'succeeded')."""
    name = "procrastinate"
    backends = ("postgresql",)
    APP = "bench.procrastinate_app.app"

    def available(self, backend):
        if backend not in self.backends:
            return "Procrastinate is compared on PostgreSQL only"
        return _installed("procrastinate", "psycopg")

    def _command(self, url, args, log, timeout=300):
        env = common.child_env()
        env["BENCH_PROCRASTINATE_DSN"] = url
        proc = spawn([sys.executable] + args, log, env=env)
        if timeout is None:
            return proc
        wait_until(lambda: proc.poll() is not None, timeout, " ".join(args[-2:]))
        if proc.returncode:
            raise RuntimeError("%s failed (log: %s)" % (" ".join(args), common.workdir()))

    def prepare(self, backend, n):
        url = create_database(backend, "procr")
        self._command(url, ["-m", "procrastinate", "--app", self.APP, "schema", "--apply"],
                      "procrastinate-schema.log")
        self._command(url, ["-c", "from bench.procrastinate_app import enqueue; enqueue(%d)" % n],
                      "procrastinate-enqueue.log")
        return url

    def run(self, url, n, workers, timeout):
        sql = "SELECT count(*) FROM procrastinate_events WHERE type = 'succeeded'"
        launched = time.time()
        procs = [self._command(url, ["-m", "procrastinate", "--app", self.APP, "worker",
                                     "--concurrency", "1", "--one-shot"],
                               "procrastinate.log", timeout=None) for _ in range(workers)]
        try:
            wait_until(lambda: query(url, sql)[0][0] >= n, timeout,
                       "Procrastinate to run %d jobs" % n, interval=0.2)
        finally:
            for proc in procs:
                stop(proc)
        rows = query(url, "SELECT at FROM procrastinate_events WHERE type = 'succeeded'")
        return rates(launched, sorted(common.to_epoch(r[0]) for r in rows))

    def teardown(self, url):
        drop_url(url)


PEERS = (Huey(), Procrastinate())


def measure(system, backend, n, workers, timeout):
    """prepare → run → teardown, whatever happens."""
    ctx = system.prepare(backend, n)
    try:
        return system.run(ctx, n, workers, timeout)
    finally:
        system.teardown(ctx)


__all__ = ["Taskrunner", "Floor", "Ceiling", "Huey", "Procrastinate", "PEERS", "measure", "BenchTimeout"]
