"""Shared fixtures: a fresh database per test on SQLite, PostgreSQL and MariaDB/MySQL, and
helpers to run real taskrunner processes.

PostgreSQL and MySQL tests need a server: by default postgresql://postgres@127.0.0.1:5432/postgres
and mysql://root@127.0.0.1:3306/test (override with TASKRUNNER_TEST_POSTGRES_URL and
TASKRUNNER_TEST_MYSQL_URL). Without the server they are skipped with the reason — except in
CI (CI=true or TASKRUNNER_REQUIRE_DATABASES=1), where an unreachable server fails them, as
a missing tool of the machine does (chromium, pgbouncer, libfaketime: .ci/run installs them).

The README's test command installs the ``test`` extra only. A test that needs more (the
``bench`` extra's peers, a Django 6 interpreter) skips saying what to install — except
where TASKRUNNER_REQUIRE_EXTRAS=1 (.ci/run's run with every extra), where it fails: CI's run
of the README command itself requires the databases but not the extras.

TASKRUNNER_TEST_PGBOUNCER=1 runs the PostgreSQL tests through PgBouncer in transaction pooling
mode (tests/servers.py, one per test process, started on first use): each test's
database URL goes through it, with ``[database] pooler = "pgbouncer"`` in the config the
fixtures build. Creating, migrating and dropping the databases stays direct.

Heavy and timing tests never overlap. The suite runs in four pytest-xdist workers on
machines of two cores; a test marked ``heavy`` (kill -9 chaos, scale and accuracy runs:
dozens of processes for a minute or more) loads the machine so much that a bound on time
measured beside it (a ``timing`` test: an idle runner's exit, an event loop's lag, a stop's
slack) fails; and two heavy tests at once on two cores each take about twice as long as
alone (the durable chaos test: 74 s beside another, 36 s alone), so running them one at a
time costs the run little and keeps them far from their deadlines. So each worker runs a
heavy test holding an exclusive flock(2) on one file of the run (next to the workers' temp
directories, so shared by them and by no other run) and a timing test holding a shared one:
heavy tests run one at a time and never beside a timing test; timing tests run beside each
other and beside everything else; unmarked tests take no lock. The lock is taken around the
whole test (``pytest_runtest_protocol``, outside pytest-timeout's timer: waiting for it is
not the test's time). Heavy tests are ordered first (one worker takes them in turn) and
timing tests last, so they seldom wait. Each locked test appends a line to ``machine.log``
beside the lock file (worker, lock, start and end times, test). Without xdist (``-n 0``)
tests run one at a time anyway, and nothing is locked. The hook is tests/machine_lock.py.

The property tests (Hypothesis) run a tenth of their examples by default, so the README's
test command stays quick; HYPOTHESIS_PROFILE=ci (.ci/run's full run) runs them all.
"""
import logging
import os
import shutil
import queue as queue_module
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timezone
from urllib.parse import urlsplit, urlunsplit

import psutil
import pytest
from hypothesis import settings

from taskrunner import Config, TaskQueue
from taskrunner.host import claimfile, wakeup
from taskrunner.store.models import MODELS, Run

from sample_handlers import read_records
from machine_lock import pytest_runtest_protocol  # noqa: F401 (the hook of the machine lock)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
SERVERS = {
    "postgresql": os.environ.get("TASKRUNNER_TEST_POSTGRES_URL",
                                 "postgresql://postgres@127.0.0.1:5432/postgres"),
    "mysql": os.environ.get("TASKRUNNER_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
}
ALL_BACKENDS = ("sqlite", "postgresql", "mysql")
THROUGH_PGBOUNCER = os.environ.get("TASKRUNNER_TEST_PGBOUNCER") == "1"

# Hypothesis: "fast" by default, "ci" thorough (see `examples`). No example database: a
# failure is reported with the example that made it, and the tree stays clean.
settings.register_profile("fast", deadline=None, database=None)
settings.register_profile("ci", deadline=None, database=None, print_blob=True)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fast")
settings.load_profile(HYPOTHESIS_PROFILE)


def examples(thorough):
    """A property test's max_examples: `thorough` under the "ci" profile, a tenth of it
    (at least 10) under the default "fast" one."""
    return thorough if HYPOTHESIS_PROFILE == "ci" else max(10, thorough // 10)


def databases_required():
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or \
        os.environ.get("TASKRUNNER_REQUIRE_DATABASES") == "1"


def extras_required():
    return os.environ.get("TASKRUNNER_REQUIRE_EXTRAS") == "1"


def extra_missing(reason):
    """Skip the test for `reason` (what is missing and how to install it), or fail it where
    every extra is required (TASKRUNNER_REQUIRE_EXTRAS=1)."""
    if extras_required():
        pytest.fail(reason + " (TASKRUNNER_REQUIRE_EXTRAS=1)")
    pytest.skip(reason)


def direct_only(database, why):
    """Skip the test when `database` is reached through PgBouncer (TASKRUNNER_TEST_PGBOUNCER)
    and the test is about what only a direct session does."""
    if database.pooler:
        pytest.skip("through PgBouncer: " + why)


def _with_db(url, name):
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


# The PostgreSQL and MySQL databases the tests create are named
# trtest_<pid>_<start>_<random>: the creating process's pid and start time (whole seconds),
# so that a run interrupted before dropping them (Ctrl-C, a killed worker) is recognised by
# the next one, which drops them once their creator is gone — and only then: several runs
# may share a server.
DATABASE_PREFIX = "trtest_"
_SWEPT = set()


def new_database_name():
    me = psutil.Process()
    return "%s%d_%d_%s" % (DATABASE_PREFIX, me.pid, int(me.create_time()), uuid.uuid4().hex[:8])


def creator_gone(name):
    """Whether the process that created the database `name` has exited (False for a name
    without a creator: not ours to judge)."""
    fields = name[len(DATABASE_PREFIX):].split("_")
    if not name.startswith(DATABASE_PREFIX) or len(fields) != 3 or \
            not (fields[0].isdigit() and fields[1].isdigit()):
        return False
    try:
        return int(psutil.Process(int(fields[0])).create_time()) != int(fields[1])
    except psutil.NoSuchProcess:
        return True


def drop_leftovers(backend, admin):
    """Drop the test databases on the server whose creating process has exited; returns
    their names. A database another sweep dropped first is no error."""
    with admin.cursor() as cur:
        if backend == "postgresql":
            cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                        (DATABASE_PREFIX.replace("_", "\\_") + "%",))
        else:
            cur.execute("SHOW DATABASES LIKE %s", (DATABASE_PREFIX.replace("_", "\\_") + "%",))
        names = [row[0] for row in cur.fetchall() if creator_gone(row[0])]
        for name in names:
            if backend == "postgresql":
                cur.execute("DROP DATABASE IF EXISTS %s WITH (FORCE)" % name)
            else:
                cur.execute("DROP DATABASE IF EXISTS %s" % name)
    return names


def _admin(backend):
    """A DB-API connection to the server, or skip/fail saying why; the first one of each
    process drops what interrupted runs left on the server (drop_leftovers)."""
    connection = _connect(backend)
    if backend not in _SWEPT:
        _SWEPT.add(backend)
        drop_leftovers(backend, connection)
    return connection


def _connect(backend):
    url = SERVERS[backend]
    parts = urlsplit(url)
    try:
        if backend == "postgresql":
            import psycopg
            return psycopg.connect(host=parts.hostname, port=parts.port or 5432,
                                   user=parts.username or "postgres", password=parts.password,
                                   dbname=parts.path.lstrip("/") or "postgres", autocommit=True,
                                   connect_timeout=5)
        import pymysql
        return pymysql.connect(host=parts.hostname, port=parts.port or 3306,
                               user=parts.username or "root", password=parts.password or "",
                               autocommit=True, connect_timeout=5)
    except Exception as exc:  # any driver or network failure means "no server here"
        reason = "%s server not reachable at %s: %s" % (backend, parts.hostname, exc)
        if databases_required():
            pytest.fail(reason + " (required in CI)")
        pytest.skip(reason)


class _Pool:
    """Migrated PostgreSQL / MySQL databases made ahead of the tests that take them.

    Creating and migrating a database costs 0.3-0.6 s of server I/O (PostgreSQL copies
    template1 through the WAL; cloning another template was slower still); a thread makes
    the next few while the current test runs, so a test takes one ready-made."""

    AHEAD = 3

    def __init__(self, backend):
        self.backend = backend
        self.ready = queue_module.Queue(maxsize=self.AHEAD)
        self.stopping = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._fill, name="db-pool-" + backend, daemon=True)
        self.admin = _admin(backend)       # skips or fails here, in the test, when unreachable
        self.thread.start()

    def _fill(self):
        admin = self.admin
        while not self.stopping.is_set():
            name = new_database_name()
            try:
                with admin.cursor() as cur:
                    cur.execute("CREATE DATABASE %s" % name)
                TaskQueue(_with_db(SERVERS[self.backend], name), migrate=True).close()
            except Exception as exc:  # reported to the test that waits for a database
                self.error = exc
                return
            while not self.stopping.is_set():
                try:
                    self.ready.put(name, timeout=0.2)
                    break
                except queue_module.Full:
                    continue
            else:
                self._drop(admin, name)

    def take(self):
        while True:
            if self.error is not None:
                raise self.error
            try:
                return self.ready.get(timeout=0.5)
            except queue_module.Empty:
                if not self.thread.is_alive() and self.error is None:
                    raise RuntimeError("the %s database pool stopped" % self.backend)

    def _drop(self, admin, name):
        with admin.cursor() as cur:
            if self.backend == "postgresql":
                cur.execute("DROP DATABASE IF EXISTS %s WITH (FORCE)" % name)
            else:
                cur.execute("DROP DATABASE IF EXISTS %s" % name)

    def close(self):
        self.stopping.set()
        self.thread.join(30)
        while True:
            try:
                self._drop(self.admin, self.ready.get_nowait())
            except queue_module.Empty:
                break
        self.admin.close()


def _not_from_a_pool(record):
    """The pools migrate in the background: their log lines belong to no test's output."""
    return not threading.current_thread().name.startswith("db-pool-")


logging.getLogger("peewee.migrations").addFilter(_not_from_a_pool)
_POOLS = {}
_SQLITE_TEMPLATE = []
_PGBOUNCER = []


def _pgbouncer():
    """This test process's PgBouncer (TASKRUNNER_TEST_PGBOUNCER=1), started on first use."""
    if not _PGBOUNCER:
        from servers import PgBouncer, pgbouncer_available
        if not pgbouncer_available():
            pytest.fail("TASKRUNNER_TEST_PGBOUNCER=1 but pgbouncer is not installed")
        # Small pools, as in production: many clients share a few server connections.
        _PGBOUNCER.append(PgBouncer(SERVERS["postgresql"], pool_size=8, max_user_connections=16))
    return _PGBOUNCER[0]


def _pool(backend):
    if backend not in _POOLS:
        _POOLS[backend] = _Pool(backend)
    return _POOLS[backend]


def _sqlite_template(tmp_path):
    """A migrated SQLite file, copied for each test (migrating took most of the set-up)."""
    if not _SQLITE_TEMPLATE:
        directory = tmp_path.parent / ("template-%s" % uuid.uuid4().hex[:8])
        directory.mkdir()
        path = directory / "taskrunner.db"
        TaskQueue("sqlite:///%s" % path, migrate=True).close()
        _SQLITE_TEMPLATE.append(str(path))
    return _SQLITE_TEMPLATE[0]


def pytest_collection_modifyitems(items):
    """The heavy tests first (they run one at a time, see the module's docstring: started
    first, they are done before the end), then the other long process tests, so that under
    pytest-xdist (the README's test command runs four workers) they overlap each other and
    the short tests fill the gaps, instead of one of them starting last and the run waiting
    for it alone; the timing tests last, when the heavy ones are over. Within each group the
    order stays as written. A heavy test is slow too: ``-m "not slow"`` (the README's quick
    subset) leaves out every test that takes the machine for itself."""
    for item in items:
        if item.path.name in ("test_deploy.py", "test_db_restart.py", "test_hosts.py") or \
                item.get_closest_marker("heavy"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order)


def _order(item):
    if item.get_closest_marker("heavy"):
        return 0
    if item.get_closest_marker("timing"):
        return 3
    return 1 if item.get_closest_marker("slow") else 2


@pytest.fixture(scope="session", autouse=True)
def _database_pools():
    yield
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    for bouncer in _PGBOUNCER:
        bouncer.stop()
    _PGBOUNCER.clear()


class Database:
    """A fresh database for one test, with the current schema (`empty=True`: none);
    dropped afterwards."""

    def __init__(self, backend, tmp_path, empty=False):
        self.backend = backend
        self.pooler = ""
        if backend == "sqlite":
            path = tmp_path / "taskrunner.db"
            if not empty:
                shutil.copyfile(_sqlite_template(tmp_path), path)
            self.url = "sqlite:///%s" % path
            return
        self.admin = _admin(backend)
        if empty:
            self.name = new_database_name()
            with self.admin.cursor() as cur:
                cur.execute("CREATE DATABASE %s" % self.name)
        else:
            self.name = _pool(backend).take()
        self.url = _with_db(SERVERS[backend], self.name)
        if backend == "postgresql" and THROUGH_PGBOUNCER:
            self.url, self.pooler = _pgbouncer().url(self.name), "pgbouncer"

    def drop(self):
        # A batched runner killed with its overseer at a test's end leaves its claim file:
        # nobody marks it dead before the database goes.
        shutil.rmtree(claimfile.directory(wakeup.directory(self.url)), ignore_errors=True)
        if self.backend == "sqlite":
            return
        with self.admin.cursor() as cur:
            if self.backend == "postgresql":
                cur.execute("DROP DATABASE IF EXISTS %s WITH (FORCE)" % self.name)
            else:
                cur.execute("DROP DATABASE IF EXISTS %s" % self.name)
        self.admin.close()

    def config(self, **sections):
        data = {"database": {"url": self.url, "pooler": self.pooler}}
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return Config.from_dict(data)

    def queue(self, **sections):
        """A TaskQueue on this database (schema up to date). The module-level models are
        bound to it too, so a test can read the tables with ``Run.select()`` and the like."""
        queue = TaskQueue(self.config(**sections), migrate=True)
        queue.store.db.bind(MODELS)
        return queue

    def store_at(self, migration, **sections):
        """A connected Store on this (empty) database with the schema up to `migration`, a
        migration's file name, for a test of the migrations after it; `sections` more of
        its config."""
        from playhouse.migrations import Runner as MigrationRunner
        from taskrunner.store.bound import Store
        from taskrunner.store.migrations import DIRECTORY, HISTORY_TABLE
        store = Store(Config.from_dict(dict(sections, database={"url": self.url})))
        store.connect()
        MigrationRunner(store.db, DIRECTORY, table_name=HISTORY_TABLE).up(target=migration)
        return store

    def write_config(self, path, text=""):
        """A config file for this database with `text`'s sections. Unless `text` sets
        [rotation], the built-in rotation task's timer is yearly instead of hourly: an
        overseer's maintainer submits it at every full hour, and a test that ran across one
        found a task (and a run) it had not added (CI, the kill -9 chaos test)."""
        pooler = 'pooler = "%s"\n' % self.pooler if self.pooler else ""
        if "[rotation]" not in text:
            text += '\n[rotation]\ntimer = "yearly"\n'
        path.write_text('[database]\nurl = "%s"\n%s%s' % (self.url, pooler, text))
        return str(path)


@pytest.fixture(params=ALL_BACKENDS)
def database(request, tmp_path):
    db = Database(request.param, tmp_path)
    yield db
    db.drop()


@pytest.fixture(params=("sqlite", "postgresql"))
def database_sp(request, tmp_path):
    """SQLite and PostgreSQL only, for the slowest process tests."""
    db = Database(request.param, tmp_path)
    yield db
    db.drop()


@pytest.fixture(params=("postgresql", "mysql"))
def database_pm(request, tmp_path):
    """The two servers only, for what SQLite's single writer cannot show (deadlocks, two
    connections racing)."""
    db = Database(request.param, tmp_path)
    yield db
    db.drop()


@pytest.fixture
def sqlite_db(tmp_path):
    return Database("sqlite", tmp_path)


@pytest.fixture
def queue(database):
    q = database.queue()
    yield q
    q.close()


def process_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, REPO_DIR, env.get("PYTHONPATH", "")])
    env.pop("TASKRUNNER_CONFIG", None)
    env.pop("TASKRUNNER_DATABASE_URL", None)
    env.update(extra or {})
    return env


# Commands that become a runner or an overseer (signal handlers, registration, forks) run
# in a process of their own; every other command runs in-process through main(), which is
# the same code without the 0.3 s of interpreter start-up and imports.
PROCESS_COMMANDS = ("runner", "overseer", "task-runner:OnProcess")


def taskrunner(*args, config=None, url=None, check=False, timeout=60, env=None,
               process=False):
    """Run the CLI to completion; returns a CompletedProcess (text). In a process of its own
    with `env`, `process=True`, or a command that starts a runner or an overseer."""
    options = (["--config", config] if config else []) + (["--database", url] if url else [])
    argv = options + list(args)
    if process or env is not None or any(arg in PROCESS_COMMANDS for arg in args):
        result = subprocess.run([sys.executable, "-m", "taskrunner"] + argv, capture_output=True,
                                text=True, timeout=timeout, env=process_env(env))
    else:
        result = _in_process(argv)
    if check and result.returncode != 0:
        raise AssertionError("taskrunner %s exited %d: %s" % (" ".join(args), result.returncode,
                                                              result.stderr))
    return result


def _in_process(argv):
    """main(argv) with stdout and stderr captured, an exit code as a process would give:
    SystemExit's code, or 1 and the traceback for an exception main() let through."""
    import contextlib
    import io
    import traceback
    from taskrunner.cli import main
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = {name: os.environ.pop(name) for name in ("TASKRUNNER_CONFIG", "TASKRUNNER_DATABASE_URL")
             if name in os.environ}
    try:
        root.handlers[:] = []          # so main()'s logging set-up takes effect, as in a process
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        root.handlers[:] = handlers    # main() set up logging on the captured stderr
        root.setLevel(level)
        os.environ.update(saved)
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())


def spawn(*args, config=None, url=None, env=None, log_path=None):
    """Start the CLI in the background (its own process group); stderr to log_path."""
    cmd = [sys.executable, "-m", "taskrunner"]
    if config:
        cmd += ["--config", config]
    if url:
        cmd += ["--database", url]
    err = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(cmd + list(args), stdout=subprocess.DEVNULL, stderr=err,
                            env=process_env(env), start_new_session=True)


def utc(naive):
    """A naive UTC datetime (what the store keeps) as the aware one the API takes."""
    return naive.replace(tzinfo=timezone.utc)


def wait_for(predicate, timeout=20.0, interval=0.05, message="condition"):
    """Poll until predicate() is truthy; fail with what was last seen."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError("timed out after %.1fs waiting for %s (last seen: %r)"
                         % (timeout, message, last))


START_TIMEOUT = 60.0   # processes up and registered, on a loaded machine


def wait_started(log, count=1, timeout=START_TIMEOUT):
    """The `.started` markers (sample_handlers) once `count` handlers have started."""
    return wait_for(lambda: len(read_records(log + ".started")) >= count and
                    read_records(log + ".started"), timeout=timeout,
                    message="%d handler(s) to start" % count)


def runs_of(task_id):
    return list(Run.select().where(Run.task_id == task_id).order_by(Run.id))


def stop_process(proc, sig=signal.SIGKILL):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Processes:
    """The processes a test started; whatever still runs at teardown is killed."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.started = []

    def spawn(self, *args, config=None, name="proc"):
        log_path = self.tmp_path / ("%s-%d.log" % (name, len(self.started)))
        proc = spawn(*args, config=config, log_path=log_path)
        proc.log_path = log_path
        self.started.append(proc)
        return proc

    def add(self, proc, log_path):
        """Track a process started elsewhere, logging to log_path."""
        proc.log_path = log_path
        self.started.append(proc)
        return proc

    def log(self, proc):
        return proc.log_path.read_text(errors="replace") if proc.log_path.exists() else ""

    def logs(self, procs=None):
        return "\n".join("--- pid %d (exit %s):\n%s" % (p.pid, p.poll(), self.log(p)[-3000:])
                         for p in (procs or self.started))

    def wait(self, proc, timeout=60.0):
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("pid %d still running after %.0fs\n%s"
                                 % (proc.pid, timeout, self.logs([proc]))) from None

    def kill_all(self):
        for proc in self.started:
            stop_process(proc)


@pytest.fixture
def procs(tmp_path):
    group = Processes(tmp_path)
    yield group
    group.kill_all()


def usage_error(result, *fragments):
    """Exit 2, exactly one non-empty line on stderr starting "taskrunner: ", no traceback,
    nothing on stdout; the line contains every fragment. Returns the line."""
    output = "stdout: %r\nstderr: %r" % (result.stdout, result.stderr)
    assert result.returncode == 2, output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("taskrunner: "), output
    assert "Traceback" not in result.stderr + result.stdout, output
    assert result.stdout.strip() == "", output
    for fragment in fragments:
        assert fragment in lines[0], output
    return lines[0]


def ok(result):
    assert result.returncode == 0, "exit %d\nstdout: %r\nstderr: %r" % (
        result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stdout
