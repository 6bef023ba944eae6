"""A store: one database, and how every rule module talks to it.

The store owns the connection (opened lazily, so nothing crosses a fork), the models bound
to this database alone, write transactions retried after a deadlock or a busy database,
row locks where the database has them, wake-ups of idle runners after a commit, and the
schema check. Every module below the `TaskQueue` facade receives the store it works on.
"""
import contextlib
import logging
import os
import sqlite3
import threading
import time
from datetime import timedelta

import peewee as pw

from ..host import wakeup
from ..config import Config
from .db import ATTEMPTS, backend_of, check_connection, open_database, retry_transaction
from ..errors import SchemaBehind
from ..host.groupsync import GroupSync
from ..host.hostlock import HostLock
from .migrations import migrate, pending
from .models import bind_models, utcnow

log = logging.getLogger("taskrunner.store")


# The server's clock is read again after this many seconds, or when this host's clock moved
# by more than CLOCK_STEP against its monotonic clock (stepped by NTP, an operator, a resume).
CLOCK_CHECK = 60.0
CLOCK_STEP = 0.1

# The page size of a new SQLite database. A durable commit writes and syncs every page it
# changes, whole: a job's end-and-claim changes about 8 b-tree pages, an add_task 9, each by a
# few dozen bytes, so smaller pages write less (37 KB per job with 4,096-byte pages, 17 KB
# with 2,048) and the commit returns sooner. 1,024 saves a little more, but a row of task
# data then overflows sooner and each b-tree gets deeper.
SQLITE_PAGE_SIZE = 2048


def _create_private(path):
    """Create a missing SQLite file readable by its owner only (SQLite gives its -wal and
    -shm files the database file's permissions), with SQLITE_PAGE_SIZE: set before its
    first page is written, since a database in WAL mode keeps the page size it has.
    Anything else is SQLite's to report."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return
    try:
        conn = sqlite3.connect(path)
        try:
            conn.execute("PRAGMA page_size = %d" % SQLITE_PAGE_SIZE)
            conn.execute("PRAGMA journal_mode = wal")
        finally:
            conn.close()
    except sqlite3.Error:
        pass       # another process got there first: the file keeps what it made


# Seconds a bounded store (`Store.bounded`) waits for the database in any one wait.
BRIEF = 0.5


class Store:
    """One database named by ``config.database.url``; `ephemeral` allows an in-memory
    SQLite database (which every other caller must refuse: its tasks die with the process).

    With `patience` (seconds) the store is bounded: no wait for the database — the host
    lock, a lock held by another program or transaction, a connection — lasts longer (see
    db.open_database), and a write is tried once, never again after a busy database or a
    deadlock: for a process that must not wait on the database (the overseer's loop, a
    runner that was told to stop), whose caller tries again at its own next turn."""

    def __init__(self, config: Config, ephemeral: bool = False, patience: float = None):
        self.config = config
        self.url = config.database.url
        self.backend = backend_of(self.url)
        self.is_sqlite = self.backend == "sqlite"
        self.patience = patience
        self.db = open_database(config.database, ephemeral, patience)
        self.host_lock = None
        self.group_sync = None
        if self.is_sqlite:
            _create_private(self.db.database)
            if self.db.database != ":memory:":
                # Never longer than SQLite's own lock would keep it waiting (hostlock.py).
                self.host_lock = HostLock(self.db.database, timeout=patience if patience
                                          is not None else config.database.busy_timeout)
        self.wakeup_directory = wakeup.directory(self.url, config.runner.wakeup_dir)
        self.waiters_directory = self.wakeup_directory + wakeup.ENDED
        self.origin = wakeup.origin(self.wakeup_directory)
        # PostgreSQL: NOTIFY only when some host LISTENs (not behind a pooler alone).
        self.notifies = self.backend == "postgresql" and bool(
            wakeup.listen_url(config.database) or not config.database.pooler)
        models = bind_models(self.db)
        self.models = models
        self.Task, self.Run, self.Runner, self.PeriodicTask = models[:4]
        self.Queue, self.RunnerQueue, self.Lease = models.Queue, models.RunnerQueue, models.Lease
        self.Step, self.Event = models.Step, models.Event
        self.RateBucket, self.RateLimit, self.Tenant = (models.RateBucket, models.RateLimit,
                                                        models.Tenant)
        self.Dependency, self.Workflow = models.Dependency, models.Workflow
        self.Rerun = models.Rerun
        # Queue names known to have their task_queues row (rows are never deleted).
        self.known_queues = set()
        # Flow control (runs/flow.py): rate keys and (queue, tenant) pairs known to have
        # their rows, and whether any key has a rate limit (re-read with the claim order:
        # while none has, claims read no bucket).
        self.known_rate_keys, self.known_tenants, self.flow_keys = set(), set(), False
        self._returning = None
        self._clock = None        # (offset, wall - monotonic, monotonic) when measured
        # Per thread (a runner's heartbeat thread writes too): how deep in write() it is,
        # and whether the outermost write's transaction made a run claimable.
        self._writes = threading.local()

    # -- connection and schema ------------------------------------------------------------

    def connect(self):
        """Connect now; DatabaseUnavailable with the password masked if that fails."""
        check_connection(self.db, self.url)

    def migrate(self):
        """Apply pending migrations under the migration lock; returns their names."""
        self.connect()
        return migrate(self.db, self.backend)

    def require_schema(self):
        """Refuse to work on a schema older than this code (an application opening a queue
        does not run DDL unless asked)."""
        self.connect()
        missing = pending(self.db)
        if missing and missing[0].startswith("0001_"):
            raise SchemaBehind("the database has no taskrunner schema yet: run `taskrunner "
                               "init-db`, or open the queue with migrate=True")
        if missing:
            raise SchemaBehind(
                "the database schema is behind this taskrunner (%d migration(s) pending, first "
                "%s): run `taskrunner init-db`, or open the queue with migrate=True"
                % (len(missing), missing[0]))

    def close(self):
        if not self.db.is_closed():
            self.db.close()

    def bounded(self, patience=BRIEF):
        """A new store on the same database and config that waits at most `patience`
        seconds in any one wait (see `Store`); the caller closes it."""
        return Store(self.config, patience=patience)

    def writable_since(self, reachable_since=None):
        """Since when everyone could write here, as far as this process can tell: the later
        of the server's last start and `reachable_since` (when the caller got the database
        back after losing it), as naive UTC on this host's clock; None when neither applies
        (SQLite has no server to restart). A heartbeat or progress that is older was
        missed during an outage, through no fault of its writer: liveness counts
        heartbeat_timeout and run_timeout from here, so that no runner is declared dead,
        and no run timed out, because the database was down."""
        started = None
        if self.backend == "postgresql":
            uptime = self.db.execute_sql(
                "SELECT EXTRACT(EPOCH FROM now() - pg_postmaster_start_time())").fetchone()[0]
        elif self.backend == "mysql":
            uptime = self.db.execute_sql("SHOW GLOBAL STATUS LIKE 'Uptime'").fetchone()[1]
        else:
            uptime = None
        if uptime is not None:
            # The server's uptime, not its clock: only this host's clock is compared.
            started = utcnow() - timedelta(seconds=float(uptime))
        known = [t for t in (started, reachable_since) if t is not None]
        return max(known) if known else None

    def commit_count(self):
        """SQLite: a number that changes whenever another connection commits to the database
        (PRAGMA data_version), read without waiting for the write lock; None on the other
        backends, or when it cannot be read. A bounded writer that found the database busy
        tells by it whether the writers ahead of it make progress (worth waiting for) or one
        holds the lock and commits nothing."""
        if not self.is_sqlite:
            return None
        try:
            return self.db.execute_sql("PRAGMA data_version").fetchone()[0]
        except (pw.OperationalError, pw.InterfaceError):
            return None

    # -- transactions -----------------------------------------------------------------------

    def write(self, fn):
        """Run ``fn()`` in a write transaction, again after a deadlock or a busy database
        (the outermost transaction: inside another, ``fn()`` runs in a savepoint, once);
        after the outermost one commits (and, with `use_group_sync`, is durable), wake idle
        runners for the runs ``fn`` made claimable (`wake_after_commit`)."""
        state = self._writes
        depth = getattr(state, "depth", 0)
        state.depth = depth + 1

        def attempt():
            if depth == 0:
                state.news, state.committed = [], []
            return fn()
        # SQLite: the host's writers take turns on the host lock, outermost writes only (a
        # transaction opened outside the store already holds SQLite's lock, and commits it).
        own = depth == 0 and not self.db.in_transaction()
        lock = self.host_lock if own else None
        changes = self._changes() if own else None
        # Inside another transaction (a savepoint), tried once: a deadlock rolls back the
        # whole transaction on MariaDB/MySQL, not only the savepoint, so trying this alone
        # again would run it outside any transaction — its writes committed on their own,
        # the outer ones before it lost (an add inside a step's transaction, DurableRun.add,
        # committed without its step). The error reaches the outermost write, which runs
        # the whole transaction again.
        attempts = self._attempts() if own else 1
        try:
            result = retry_transaction(self.db, attempt, lock=lock, attempts=attempts)
        finally:
            state.depth = depth
        if own:
            self._made_durable(changes)
        if depth == 0 and getattr(state, "news", None):
            news, state.news = state.news, []
            for count, queue in news:
                self.wake_local(count, queue)
        if depth == 0 and getattr(state, "committed", None):
            calls, state.committed = state.committed, []
            for call in calls:
                self._call_committed(call)
        return result

    def after_commit(self, call):
        """Inside a write transaction: ``call()`` once it has committed, in this process (a
        transaction tried again starts its calls afresh; one rolled back makes none).
        Outside one: now. A call that raises is logged: what committed stands. Unlike
        peewee's ``db.after_commit``, which runs inside the commit, under SQLite's host lock
        (`write`), the call runs once the lock is free: it may read, and call others' code
        (a framework's signal receivers), without holding up every writer on the host."""
        state = self._writes
        if getattr(state, "depth", 0) == 0:
            self._call_committed(call)
        else:
            state.committed.append(call)

    @staticmethod
    def _call_committed(call):
        try:
            call()
        except Exception:
            log.exception("a call after a commit raised")

    def host_turn(self):
        """Around a single write statement outside `write` (a heartbeat, progress): SQLite's
        host lock, so that it too waits its turn without sleeping in the busy handler (and,
        with `use_group_sync`, the statement is durable when the block is left)."""
        if self.host_lock is None or self.db.in_transaction():
            return contextlib.nullcontext()
        if self.group_sync is None:
            return self.host_lock
        return self._synced_turn()

    @contextlib.contextmanager
    def _synced_turn(self):
        changes = self._changes()
        with self.host_lock:
            yield
        self._made_durable(changes)

    def use_group_sync(self):
        """A runner's store in SQLite's durable mode ("full"): commit without SQLite's sync
        and share one fdatasync of the WAL with the host's other runners before acting on a
        commit (groupsync.py). Stays off for "normal" and "off", for a database not in WAL
        mode, and without the shared file (SQLite then syncs each commit, as before).
        Returns whether it is on."""
        if (self.host_lock is None or self.group_sync is not None
                or self.config.database.sqlite_synchronous != "full"
                or self.db.database.startswith("file:")):
            return self.group_sync is not None
        sync = GroupSync(self.db.database)
        if not sync.available:
            return False
        if self.db.execute_sql("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            return False
        self.db.pragma("synchronous", "normal", permanent=True)
        self.group_sync = sync
        return True

    def _changes(self):
        """Rows this connection changed since it opened (a commit that changed none wrote
        nothing to sync: an idle runner's empty claim costs no fdatasync; DDL is not
        counted, and a runner's store runs none)."""
        if self.group_sync is None:
            return None
        return self.db.connection().total_changes

    def _made_durable(self, changes_before):
        """After a commit of this store's: with group sync, return once it is durable."""
        if self.group_sync is not None and self._changes() != changes_before:
            self.group_sync.commit_done(self.db.connection())

    def wake_after_commit(self, count=None, queue=None):
        """Inside a write transaction: it makes `count` runs claimable in `queue` (None:
        unknown). PostgreSQL's NOTIFY is delivered on commit; this host's runners are woken
        after it. A transaction tried again starts its news afresh."""
        if self.notifies:
            wakeup.notify_in_transaction(self.db, count, queue, self.origin)
        state = self._writes
        if getattr(state, "depth", 0) == 0:
            return
        state.news.append((count, queue))

    def locked(self, query):
        """SELECT ... FOR UPDATE where the database has row locks; SQLite's write
        transaction already holds the only lock."""
        return query if self.is_sqlite else query.for_update()

    def statement(self, fn):
        """PostgreSQL, outside a transaction: ``fn()`` runs one statement, its own transaction
        (one round trip instead of BEGIN, the statement and COMMIT), again after a deadlock
        or a serialization failure, as `write` does. It NOTIFYs other hosts itself if it
        must (`notifies`); this host's runners are the caller's to wake."""
        return retry_transaction(self.db, fn, single_statement=True, attempts=self._attempts())

    def _attempts(self):
        return 1 if self.patience is not None else ATTEMPTS

    def write_and_wake(self, fn, wake, queue=None):
        """write(fn), waking idle runners when ``wake(result)`` says it made runs claimable
        in `queue` (None: unknown): a number of runs, or True when it cannot tell."""
        def step():
            result = fn()
            count = wake(result)
            if count is True:
                self.wake_after_commit(None, queue)
            elif count:
                self.wake_after_commit(int(count), queue)
            return result
        return self.write(step)

    def wake_local(self, count=None, queue=None):
        """Wake this host's idle runners of this database: through the hub, `count` of them
        (None: all) serving `queue`."""
        wakeup.notify(self.wakeup_directory, count, queue)

    def server_time(self, offset=0.0):
        """SQL for the database server's current UTC time plus `offset` seconds, as the naive
        UTC datetimes of the schema. Liveness writes and ages heartbeats with it, so hosts
        whose clocks disagree never compare their clocks (SQLite has one host: its clock)."""
        if self.backend == "postgresql":
            return pw.SQL("((CURRENT_TIMESTAMP AT TIME ZONE 'UTC') + %s * INTERVAL '1 second')",
                          [float(offset)])
        if self.backend == "mysql":
            return pw.SQL("(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)",
                          [int(round(offset * 1e6))])
        return pw.SQL("strftime('%Y-%m-%d %H:%M:%f', 'now', ?)", ["%+.6f seconds" % offset])

    def database_time(self, now=None, read=None):
        """This host's time `now` (naive UTC; None: now) on the database server's clock: every
        time the run lifecycle writes or compares is one (run timeouts, max_runtime, backoff,
        due times), so hosts whose clocks disagree never compare their clocks, while each
        statement still binds its times as values. SQLite has one host: its clock. `read`:
        see clock_offset."""
        now = now or utcnow()
        return now if self.is_sqlite else now + self.clock_offset(read)

    def clock_offset(self, read=None):
        """How far the database server's clock is ahead of this host's (a timedelta, zero on
        SQLite): measured again when this host's clock has been stepped since (its distance
        from the monotonic clock changed) and every CLOCK_CHECK seconds. `read(sql)`, the
        first value of a query through another connection to this database (an
        application's, which the store's own must not replace), when it is to be measured."""
        if self.is_sqlite:
            return timedelta(0)
        stepped = time.time() - time.monotonic()
        known = self._clock
        if known is None or abs(stepped - known[1]) > CLOCK_STEP \
                or time.monotonic() - known[2] > CLOCK_CHECK:
            read = read or (lambda sql: self.db.execute_sql(sql).fetchone()[0])
            known = self._clock = (self._measure_offset(read), stepped, time.monotonic())
        return known[0]

    def _measure_offset(self, read):
        """The server's clock read between two readings of this host's: an offset within
        half that round trip is no offset (the clocks agree as far as one can tell)."""
        before = utcnow()
        server = read("SELECT clock_timestamp() AT TIME ZONE 'UTC'" if self.backend ==
                      "postgresql" else "SELECT UTC_TIMESTAMP(6)")
        after = utcnow()
        half = (after - before) / 2
        offset = server - (before + half)
        return offset if abs(offset) > half else timedelta(0)

    def wake_waiters(self):
        """After a commit that ended a run or a task: wake this host's `TaskQueue.wait`
        (one stat() when nobody waits: the directory's listing is kept while unchanged)."""
        wakeup.notify_local(self.waiters_directory)

    def insert_returning(self):
        """Whether INSERT ... RETURNING works here: PostgreSQL, SQLite 3.35+, MariaDB 10.5+."""
        if self._returning is None:
            if self.backend == "postgresql":
                self._returning = True
            elif self.is_sqlite:
                self._returning = sqlite3.sqlite_version_info >= (3, 35)
            else:
                version = self.db.execute_sql("SELECT VERSION()").fetchone()[0]
                numbers = tuple(int(n) for n in version.split("-")[0].split(".")[:2])
                self._returning = "mariadb" in version.lower() and numbers >= (10, 5)
        return self._returning
