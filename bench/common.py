"""Shared helpers of the benchmark suite: databases, child processes, waiting, timing and
statistics. Nothing here knows about a particular scenario.

Every wait has a deadline (BenchTimeout), and every child process is registered so that
`cleanup()` kills it, on success, on error and on a signal.
"""
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import string
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG_ADMIN_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MYSQL_ADMIN_URL = os.environ.get("BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/mysql")
BACKENDS = ("sqlite", "postgresql", "mysql")
NOOP = "taskrunner.handlers.Echo"   # data null: results null, nothing but the bookkeeping
# [database] sqlite_synchronous of every SQLite side (taskrunner, the floor, Huey): set by
# run.py --sqlite-synchronous; "full" (durable commits) is taskrunner's default.
SQLITE_SYNCHRONOUS = "full"
# Every taskrunner config the bench writes gets these ({section: {key: value}}), from
# run.py --taskrunner-option SECTION.KEY=VALUE; a scenario's own sections come on top.
TASKRUNNER_OPTIONS = {}
# application_name of the bench's own PostgreSQL connections: not counted as a system's
# server CPU (bench/cpu.py).
APPLICATION_NAME = "trbench"


class BenchTimeout(RuntimeError):
    pass


# -- child processes ---------------------------------------------------------------------

_children = []          # Popen and multiprocessing.Process objects, killed by cleanup()
_databases = []         # (backend, name or path) dropped by cleanup()
_workdir = None


def child_env():
    """The environment of every child: the repository importable (bench.*, taskrunner)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def workdir():
    """A private temporary directory for SQLite files, configs and logs."""
    global _workdir
    if _workdir is None:
        _workdir = tempfile.mkdtemp(prefix="trbench-")
    return _workdir


def spawn(argv, log_name, env=None):
    """Start a child in its own session (so its whole process group can be killed), output
    to a log file in the work directory."""
    log = open(os.path.join(workdir(), log_name), "ab")
    try:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env or child_env(), cwd=workdir(), start_new_session=True)
    finally:
        log.close()
    _children.append(proc)
    return proc


def track(process):
    """Register a multiprocessing.Process for cleanup."""
    _children.append(process)
    return process


def stop(proc, sig=signal.SIGTERM, grace=10.0):
    """Signal a spawned child, wait up to `grace`, then KILL its whole process group."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    if proc in _children:
        _children.remove(proc)


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def cleanup():
    """Kill every child still running and drop every database created. Idempotent."""
    global _workdir
    for child in list(_children):
        try:
            if isinstance(child, subprocess.Popen):
                _kill_group(child.pid)
                child.wait(timeout=5)
            elif child.is_alive():
                child.kill()
                child.join(5)
        except Exception:  # cleanup must go on whatever one child does
            pass
    _children.clear()
    while _databases:
        backend, name = _databases.pop()
        try:
            drop_database(backend, name)
        except Exception as exc:
            print("warning: could not drop %s database %s: %s" % (backend, name, exc), file=sys.stderr)
    if _workdir and not os.environ.get("BENCH_KEEP"):
        shutil.rmtree(_workdir, ignore_errors=True)
        _workdir = None       # the next workdir() makes a new one


# -- waiting -----------------------------------------------------------------------------

def wait_until(predicate, timeout, what, interval=0.05, procs=(), tick=None):
    """Call predicate until it returns something truthy (returned); BenchTimeout after
    `timeout` seconds. A process in `procs` that exits meanwhile is an error too. `tick`,
    when given, is called before each try (a sampler)."""
    deadline = time.monotonic() + timeout
    while True:
        if tick is not None:
            tick()
        value = predicate()
        if value:
            return value
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError("%s: process %d exited with %s while waiting for %s (log in %s)"
                                   % (proc.args[0] if isinstance(proc.args, list) else proc.args,
                                      proc.pid, proc.returncode, what, workdir()))
        if time.monotonic() > deadline:
            raise BenchTimeout("timed out after %.0fs waiting for %s" % (timeout, what))
        time.sleep(interval)


# -- databases ---------------------------------------------------------------------------

def _random_name(label):
    suffix = "".join(random.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    return "trbench_%s_%s" % (label, suffix)


def create_database(backend, label="db"):
    """A new empty database; returns its URL (dropped by cleanup(), or drop_url())."""
    name = _random_name(label)
    if backend == "sqlite":
        path = os.path.join(workdir(), name + ".db")
        _databases.append((backend, path))
        return "sqlite:///" + path
    with admin_connection(backend) as conn:
        cur = conn.cursor()
        cur.execute("CREATE DATABASE %s" % name)
    _databases.append((backend, name))
    admin = PG_ADMIN_URL if backend == "postgresql" else MYSQL_ADMIN_URL
    return admin.rsplit("/", 1)[0] + "/" + name


def drop_url(url):
    backend = backend_of(url)
    name = urlsplit(url).path[1:] if backend != "sqlite" else url[len("sqlite:///"):]
    if (backend, name) in _databases:
        _databases.remove((backend, name))
    drop_database(backend, name)


def drop_database(backend, name):
    if backend == "sqlite":
        for suffix in ("", "-wal", "-shm", "-journal"):
            try:
                os.unlink(name + suffix)
            except FileNotFoundError:
                pass
        return
    with admin_connection(backend) as conn:
        cur = conn.cursor()
        if backend == "postgresql":
            cur.execute("DROP DATABASE IF EXISTS %s WITH (FORCE)" % name)
        else:
            cur.execute("DROP DATABASE IF EXISTS %s" % name)


class admin_connection:
    """Autocommit connection to the server's admin database."""

    def __init__(self, backend):
        self.conn = connect(PG_ADMIN_URL if backend == "postgresql" else MYSQL_ADMIN_URL,
                            autocommit=True)

    def __enter__(self):
        return self.conn

    def __exit__(self, *exc):
        self.conn.close()


def backend_of(url):
    scheme = urlsplit(url).scheme
    return {"postgres": "postgresql"}.get(scheme, scheme)


def server_available(backend):
    """None when the server answers (and the driver is installed), else why not."""
    if backend == "sqlite":
        return None
    try:
        with admin_connection(backend):
            return None
    except Exception as exc:
        return "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")


def connect(url, autocommit=False):
    """A raw DB-API connection for `url` (sqlite3, psycopg or PyMySQL)."""
    backend = backend_of(url)
    if backend == "sqlite":
        conn = sqlite3.connect(url[len("sqlite:///"):], timeout=30,
                               isolation_level=None if autocommit else "")
        return conn
    if backend == "postgresql":
        import psycopg
        return psycopg.connect(url, autocommit=autocommit, application_name=APPLICATION_NAME)
    import pymysql
    parts = urlsplit(url)
    return pymysql.connect(host=parts.hostname, port=parts.port or 3306, user=parts.username,
                           password=parts.password or "", database=parts.path[1:] or None,
                           autocommit=autocommit)


def placeholder(url):
    return "?" if backend_of(url) == "sqlite" else "%s"


def query(url, sql, params=(), conn=None):
    """Run one read query on a short-lived (or the given) connection; return all rows."""
    own = conn is None
    conn = conn or connect(url, autocommit=True)
    try:
        cur = conn.cursor()
        cur.execute(sql.replace("?", placeholder(url)), params)
        rows = cur.fetchall()
        cur.close()
        return rows
    finally:
        if own:
            conn.close()


def sqlite_commit_rate(commits=100):
    """What the disk allows: commits/s of a one-row SQLite transaction (WAL, the bench's
    synchronous) — the ceiling of any SQLite queue doing one commit per job."""
    path = os.path.join(workdir(), "commit-probe.db")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=wal")
        conn.execute("PRAGMA synchronous=%s" % SQLITE_SYNCHRONOUS)
        conn.execute("CREATE TABLE t (x)")
        start = time.perf_counter()
        for i in range(commits):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t VALUES (?)", (i,))
            conn.execute("COMMIT")
        return commits / (time.perf_counter() - start)
    finally:
        conn.close()
        drop_database("sqlite", path)


def server_version(backend):
    if backend == "sqlite":
        return sqlite3.sqlite_version
    with admin_connection(backend) as conn:
        cur = conn.cursor()
        cur.execute("SELECT version()")
        return str(cur.fetchone()[0]).split(" on ")[0]


# -- taskrunner: config, backlog, overseer -----------------------------------------------

def _database_section(url):
    section = {"url": url}
    if backend_of(url) == "sqlite":
        section["sqlite_synchronous"] = SQLITE_SYNCHRONOUS
    return section


def parse_option(text):
    """"section.key=value" → {section: {key: value}}; the value read as JSON when it is
    (16, true, 0.5, "x"), else as a string. ValueError when it is not of that form."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ValueError("%r is not SECTION.KEY=VALUE" % text)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return {section: {key: value}}


def merge_sections(*layers):
    """{section: {key: value}} dicts merged key by key, later layers winning."""
    merged = {}
    for layer in layers:
        for section, values in layer.items():
            merged.setdefault(section, {}).update(values)
    return merged


def write_config(url, runners, label, **sections):
    """A taskrunner TOML config: the database, TASKRUNNER_OPTIONS, any extra sections
    given as {"task": {"retry_backoff": 0}}, and [runner] limit = runners."""
    sections = merge_sections({"database": _database_section(url)}, TASKRUNNER_OPTIONS, sections,
                              {"runner": {"limit": runners}})
    lines = []
    for section, values in sections.items():
        lines.append("[%s]" % section)
        lines.extend("%s = %s" % (key, json.dumps(value)) for key, value in values.items())
    path = os.path.join(workdir(), "%s.toml" % label)
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def make_queue(url, migrate=True):
    """A TaskQueue on `url` with the bench's database settings."""
    from taskrunner import TaskQueue
    from taskrunner.config import Config
    config = Config.from_dict({"database": _database_section(url)}, source="<bench>")
    return TaskQueue(config, migrate=migrate)


def add_noop_tasks(url, n, handler=NOOP, data=None, batch=5000, **options):
    """Queue n tasks through the bulk API (add_tasks), in batches; returns the ids."""
    queue = make_queue(url)
    try:
        ids = []
        for start in range(0, n, batch):
            specs = [dict(handler=handler, data=data, **options) for _ in range(min(batch, n - start))]
            ids.extend(queue.add_tasks(specs))
        return ids
    finally:
        queue.close()


class OverseerProcess:
    """`taskrunner overseer` as a subprocess with `runners` runners (a context manager)."""

    def __init__(self, url, runners, label="overseer", **sections):
        self.url = url
        self.runners = runners
        self.label = label
        self.config = write_config(url, runners, label, **sections)
        self.proc = None
        self.launched = None

    def start(self):
        self.launched = time.time()
        self.proc = spawn([sys.executable, "-m", "taskrunner", "--config", self.config, "overseer"],
                          self.label + ".log")
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.proc is not None:
            stop(self.proc, signal.SIGTERM, grace=15)

    def runner_processes(self):
        import psutil
        try:
            # The wake-up hub and the maintainer are no runners.
            return [child for child in psutil.Process(self.proc.pid).children()
                    if child.name() not in ("tr-hub", "tr-maintainer")]
        except psutil.NoSuchProcess:
            return []

    def wait_runners(self, timeout=60):
        """Until `runners` runner rows of this overseer are registered and idle or busy."""
        sql = "SELECT count(*) FROM task_runners WHERE kind = 'runner' AND status = 'running'"
        return wait_until(lambda: _count(self.url, sql) >= self.runners, timeout,
                          "%d runners of %s" % (self.runners, self.label), interval=0.1,
                          procs=[self.proc])

    def wait_done(self, n, timeout, status="success", tick=None):
        """Until n runs have ended with `status`."""
        sql = "SELECT count(*) FROM task_runs WHERE status = '%s'" % status
        return wait_until(lambda: _count(self.url, sql) >= n, timeout,
                          "%d runs %s (%s)" % (n, status, self.label), interval=0.2, procs=[self.proc],
                          tick=tick)


def _count(url, sql):
    try:
        return query(url, sql)[0][0]
    except Exception as exc:  # a table not there yet, a busy database: ask again
        if "no such table" in str(exc) or "does not exist" in str(exc) or "locked" in str(exc) \
                or "doesn't exist" in str(exc):
            return 0
        raise


def finish_times(url, status="success"):
    """Epoch seconds of every run's finished_on (taskrunner's schema), sorted."""
    rows = query(url, "SELECT finished_on FROM task_runs WHERE status = ?", (status,))
    return sorted(to_epoch(r[0]) for r in rows)


# -- time and statistics -----------------------------------------------------------------

def utcnow():
    return datetime.now(timezone.utc).replace(tzinfo=None)


def to_epoch(value):
    """Epoch seconds from a stored time: naive UTC datetime, aware datetime or SQLite text."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def percentile(values, p):
    """Linear-interpolated percentile (p in 0..100) of a non-empty sequence."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def median(values):
    return percentile(values, 50)


def rates(launched, finishes):
    """From the launch time and the sorted finish times of n jobs: jobs/s from launch to the
    last finish, and the steady rate between the 10th and 90th percentile of finishes."""
    n = len(finishes)
    if n == 0:
        return {"jobs": 0, "jobs_per_s": 0.0, "steady_jobs_per_s": 0.0, "seconds": None}
    total = finishes[-1] - launched
    lo, hi = int(n * 0.1), int(n * 0.9) - 1
    span = finishes[hi] - finishes[lo]
    steady = (hi - lo) / span if span > 0 else float("nan")
    return {"jobs": n, "seconds": round(total, 3), "jobs_per_s": round(n / total, 1),
            "steady_jobs_per_s": round(steady, 1)}


def ratio(a, b):
    return round(a / b, 3) if b else float("nan")


# -- output ------------------------------------------------------------------------------

def fmt(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return "%.3g" % value if abs(value) < 10 else "%.0f" % value if abs(value) >= 1000 \
            else "%.1f" % value
    return str(value)


def package_version(dist):
    """The installed version of distribution `dist`, or None."""
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine():
    """The machine a report was made on: platform, CPU model, cores, Python, and the time."""
    import platform
    from datetime import datetime, timezone
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), cpu)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version()}


def write_json(path, report):
    """Write a bench's report to `path` (its --json), if one was given."""
    if path:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)


def print_table(title, headers, rows, note=None):
    rows = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    print("\n== %s" % title)
    for i, row in enumerate([headers] + rows):
        # Numbers right-aligned, words left-aligned.
        print("  ".join(v.rjust(w) if i and j and v[:1].isdigit() else v.ljust(w)
                        for j, (v, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if note:
        print(note)
    sys.stdout.flush()


def install_signal_cleanup():
    """TERM/INT/HUP/ALRM end the run through an exception, so `finally` blocks and
    cleanup() run; ALRM is the global watchdog."""
    def handler(signum, frame):
        raise SystemExit("bench: stopped by %s" % signal.Signals(signum).name)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, handler)
