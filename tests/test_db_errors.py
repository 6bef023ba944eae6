"""Database errors classified by SQLSTATE / driver error code, on real servers: a session
terminated or killed, a refused connection, a server shutting down and starting up, real
deadlocks and lock timeouts, a busy SQLite; and errors whose *message* says "deadlock" or
"server closed the connection" but whose code says otherwise. Then `run.progress()` while
the run's own connection is killed under it.

Nothing here is mocked: every error comes from a driver talking to a server (or to SQLite).
"""
import glob
import logging
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
from urllib.parse import urlsplit

import peewee as pw
import pytest

from taskrunner import Config, TaskHandler
from taskrunner.store.db import (driver_error, is_disconnect, is_transient, open_database,
                                 retry_transaction)
from taskrunner.store.models import SUCCESS

from conftest import Database, direct_only, wait_for
from servers import free_port

# The words today's text matching looked for, in messages whose codes mean something else.
TRICK = "server closed the connection deadlock database is locked lost connection"


def kind(exc):
    """(is_transient, is_disconnect)."""
    return is_transient(exc), is_disconnect(exc)


def failure(fn, *args):
    """The peewee exception fn(*args) raises (it must raise one)."""
    with pytest.raises((pw.DatabaseError, pw.InterfaceError)) as info:
        fn(*args)
    return info.value


@pytest.fixture
def pg(tmp_path):
    db = Database("postgresql", tmp_path)
    yield db
    db.drop()


@pytest.fixture
def my(tmp_path):
    db = Database("mysql", tmp_path)
    yield db
    db.drop()


@pytest.fixture
def lite(tmp_path):
    return Database("sqlite", tmp_path)


def make_pair(db):
    """Two rows to lock in opposite orders."""
    db.execute_sql("CREATE TABLE pair (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
    db.execute_sql("INSERT INTO pair (id, n) VALUES (1, 0), (2, 0)")


def deadlock(db, setup=()):
    """Two threads (two connections: peewee's are per thread) update rows 1 and 2 in
    opposite orders; returns the errors raised (the server picks one victim)."""
    barrier = threading.Barrier(2, timeout=20)
    errors = []

    def side(first, second):
        try:
            with db.atomic():
                for sql in setup:
                    db.execute_sql(sql)
                db.execute_sql("UPDATE pair SET n = n + 1 WHERE id = %d" % first)
                barrier.wait()
                db.execute_sql("UPDATE pair SET n = n + 1 WHERE id = %d" % second)
        except (pw.DatabaseError, pw.InterfaceError) as exc:
            errors.append(exc)
        finally:
            db.close()

    threads = [threading.Thread(target=side, args=order) for order in ((1, 2), (2, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    return errors


def pg_terminate(admin, pid):
    with admin.cursor() as cur:
        # With a timeout, pg_terminate_backend waits until the backend has exited (PG 14+).
        cur.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        assert cur.fetchone()[0] is True


def mysql_kill(admin, connection_id):
    with admin.cursor() as cur:
        cur.execute("KILL %d" % connection_id)

    def gone():
        with admin.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s",
                        (connection_id,))
            return cur.fetchone()[0] == 0
    wait_for(gone, timeout=10, message="connection %d to end" % connection_id)


def kill_own_connection(db, backend, admin):
    """End this thread's connection of `db` from the server's side."""
    if backend == "postgresql":
        pg_terminate(admin, db.execute_sql("SELECT pg_backend_pid()").fetchone()[0])
    else:
        mysql_kill(admin, db.execute_sql("SELECT CONNECTION_ID()").fetchone()[0])


# -- reaching the driver's error ---------------------------------------------------------------

def test_the_driver_error_is_orig_and_the_context(lite):
    queue = lite.queue()
    try:
        exc = failure(queue.store.db.execute_sql, "SELEC 1")
        assert isinstance(exc.orig, sqlite3.OperationalError)
        assert driver_error(exc) is exc.orig is exc.__context__
        assert driver_error(exc.orig) is exc.orig
        # An error peewee raises itself has no driver error: neither kind.
        with queue.store.db.atomic():
            own = failure(queue.store.db.close)
        assert driver_error(own) is None and kind(own) == (False, False)
    finally:
        queue.close()


# -- PostgreSQL ------------------------------------------------------------------------------

def test_postgresql_terminated_session_is_a_disconnect(pg):
    direct_only(pg, "a server connection the server ends is replaced unseen; the client's is not cut")
    queue = pg.queue()
    db = queue.store.db
    try:
        pg_terminate(pg.admin, db.execute_sql("SELECT pg_backend_pid()").fetchone()[0])
        exc = failure(db.execute_sql, "SELECT 1")
        assert driver_error(exc).sqlstate == "57P01"          # admin_shutdown
        assert kind(exc) == (False, True)
        # The next statement on the dead connection: the client's own error, no SQLSTATE.
        again = failure(db.execute_sql, "SELECT 1")
        assert driver_error(again).sqlstate is None
        assert kind(again) == (False, True)
        db.close()
        assert db.execute_sql("SELECT 1").fetchone()[0] == 1
    finally:
        queue.close()


def test_postgresql_session_terminated_during_a_query_is_a_disconnect(pg):
    queue = pg.queue()
    db = queue.store.db
    try:
        pid = db.execute_sql("SELECT pg_backend_pid()").fetchone()[0]
        timer = threading.Timer(0.3, pg_terminate, (pg.admin, pid))
        timer.start()
        exc = failure(db.execute_sql, "SELECT pg_sleep(10)")
        timer.join()
        assert kind(exc) == (False, True)
        db.close()
    finally:
        queue.close()


def test_postgresql_deadlock_is_transient(pg):
    queue = pg.queue()
    db = queue.store.db
    try:
        make_pair(db)
        errors = deadlock(db, setup=["SET LOCAL deadlock_timeout = '100ms'"])
        assert len(errors) == 1, errors
        assert driver_error(errors[0]).sqlstate == "40P01"
        assert kind(errors[0]) == (True, False)
    finally:
        queue.close()


def test_postgresql_lock_not_available_and_serialization_failure_are_transient(pg):
    import psycopg
    queue = pg.queue()
    db = queue.store.db
    other = psycopg.connect(pg.url)
    try:
        make_pair(db)
        other.execute("SELECT n FROM pair WHERE id = 1 FOR UPDATE")      # holds the row lock
        nowait = failure(db.execute_sql, "SELECT n FROM pair WHERE id = 1 FOR UPDATE NOWAIT")
        assert driver_error(nowait).sqlstate == "55P03"
        assert kind(nowait) == (True, False)
        other.rollback()

        def serialization_failure():
            with db.atomic():
                db.execute_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                db.execute_sql("SELECT n FROM pair WHERE id = 1")
                with other.transaction():
                    other.execute("UPDATE pair SET n = 5 WHERE id = 1")
                db.execute_sql("UPDATE pair SET n = n + 1 WHERE id = 1")
        exc = failure(serialization_failure)
        assert driver_error(exc).sqlstate == "40001"
        assert kind(exc) == (True, False)
    finally:
        other.close()
        queue.close()


def test_postgresql_errors_are_classified_by_sqlstate_not_by_message(pg):
    queue = pg.queue()
    db = queue.store.db
    try:
        division = failure(db.execute_sql, "SELECT 1/0")
        assert driver_error(division).sqlstate == "22012"
        assert kind(division) == (False, False)
        syntax = failure(db.execute_sql, "SELEC 1")
        assert kind(syntax) == (False, False)
        trick = failure(db.execute_sql, "DO $$ BEGIN RAISE EXCEPTION '%s'; END $$" % TRICK)
        assert TRICK in str(trick)                    # text matching would have said yes
        assert driver_error(trick).sqlstate == "P0001"
        assert kind(trick) == (False, False)
        # A handler can choose any SQLSTATE: the code is what counts, also both ways.
        chosen = failure(db.execute_sql, "DO $$ BEGIN RAISE EXCEPTION 'nothing to see' "
                                         "USING ERRCODE = 'deadlock_detected'; END $$")
        assert kind(chosen) == (True, False)
        assert db.execute_sql("SELECT 1").fetchone()[0] == 1   # the connection is fine
    finally:
        queue.close()


class PrivatePostgres:
    """A throw-away PostgreSQL cluster of our own (initdb in a temporary directory, its own
    port), to shut down and start up: the shared server on 5432 is never touched."""

    def __init__(self):
        initdb = shutil.which("initdb") or next(iter(sorted(
            glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)), None)
        if initdb is None:
            pytest.skip("initdb not found: no private PostgreSQL cluster to shut down")
        self.bin = os.path.dirname(os.path.realpath(initdb))
        self.user = None
        if os.geteuid() == 0:                   # postgres refuses to run as root
            import pwd
            try:
                entry = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root without a 'postgres' user to run a cluster")
            self.user = "postgres"
        self.base = tempfile.mkdtemp(prefix="taskrunner-pg-")
        if self.user:
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
        self.data = os.path.join(self.base, "data")
        self.port = free_port()
        self.url = "postgresql://postgres@127.0.0.1:%d/postgres" % self.port
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync",
                  "-E", "UTF8")

    def _run(self, program, *args, check=True):
        return subprocess.run([os.path.join(self.bin, program)] + list(args), user=self.user,
                              capture_output=True, text=True, timeout=60, check=check)

    def start(self, wait=True):
        self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.base, "log"),
                  "-w" if wait else "-W", "-o",
                  "-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off"
                  % (self.port, self.base), "start")

    def stop(self, mode, wait=True):
        self._run("pg_ctl", "-D", self.data, "-m", mode, "-w" if wait else "-W", "stop",
                  check=False)

    def destroy(self):
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def private_pg():
    pytest.importorskip("psycopg")
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


def test_postgresql_shutdown_and_start_up_are_disconnects(private_pg):
    """The restart that used to crash runners, on a cluster of our own: a new connection
    while the server shuts down (57P03, "the database system is shutting down", reported by
    libpq without SQLSTATE), the session ended by a fast shutdown (57P01), the refused
    connection while it is down, and whatever a connection meets while it starts up."""
    config = Config.from_dict({"database": {"url": private_pg.url}})
    held = open_database(config.database)
    newcomer = open_database(config.database)
    assert held.execute_sql("SELECT 1").fetchone()[0] == 1

    private_pg.stop("smart", wait=False)     # waits for `held` to leave; refuses newcomers

    def refused():
        try:
            newcomer.connect()
        except pw.OperationalError as exc:
            return exc
        newcomer.close()
        return None
    shutting_down = wait_for(refused, timeout=20, message="the smart shutdown to refuse")
    assert "shutting down" in str(shutting_down)      # the case this test is about (57P03)
    assert kind(shutting_down) == (False, True)

    private_pg.stop("fast")                  # terminates `held` (57P01) and stops
    ended = failure(held.execute_sql, "SELECT 1")
    assert kind(ended) == (False, True)
    held.close()
    down = failure(newcomer.connect)         # nothing listens: connection refused
    assert kind(down) == (False, True)

    private_pg.start(wait=False)
    seen = []
    deadline = time.monotonic() + 30
    while True:
        try:
            newcomer.connect()
            break
        except pw.OperationalError as exc:
            seen.append(exc)
            assert time.monotonic() < deadline, "the private server did not start: %s" % exc
            time.sleep(0.01)
    assert newcomer.execute_sql("SELECT 1").fetchone()[0] == 1
    newcomer.close()
    # "connection refused" or "the database system is starting up" (57P03), depending on
    # timing: every one of them is a disconnect.
    assert all(kind(exc) == (False, True) for exc in seen), [str(exc) for exc in seen]


def test_refused_connection_is_a_disconnect():
    pytest.importorskip("psycopg")
    pytest.importorskip("pymysql")
    port = free_port()                       # nothing listens there
    for url in ("postgresql://postgres@127.0.0.1:%d/postgres" % port,
                "mysql://root@127.0.0.1:%d/test" % port):
        db = open_database(Config.from_dict({"database": {"url": url}}).database)
        exc = failure(db.connect)
        assert kind(exc) == (False, True), (url, exc)
        # A query or a transaction connects on its way, and peewee wraps that connect
        # error once more: still a disconnect (it used to crash a runner waiting out an
        # outage at its first reconnection attempt).
        exc = failure(db.execute_sql, "SELECT 1")
        assert kind(exc) == (False, True), (url, exc)

        def begin(db=db):
            with db.atomic():
                pass
        exc = failure(begin)
        assert kind(exc) == (False, True), (url, exc)


# -- MariaDB / MySQL -----------------------------------------------------------------------

def test_mysql_killed_connection_is_a_disconnect(my):
    queue = my.queue()
    db = queue.store.db
    try:
        mysql_kill(my.admin, db.execute_sql("SELECT CONNECTION_ID()").fetchone()[0])
        exc = failure(db.execute_sql, "SELECT 1")
        assert exc.orig.args[0] in (2006, 2013, 1927, 4031), exc
        assert kind(exc) == (False, True)
        # PyMySQL then refuses the connection it closed: InterfaceError (0, '').
        again = failure(db.execute_sql, "SELECT 1")
        assert kind(again) == (False, True)
        db.close()
        assert db.execute_sql("SELECT 1").fetchone()[0] == 1
    finally:
        queue.close()


def test_mysql_deadlock_and_lock_wait_timeout_are_transient(my):
    import pymysql
    queue = my.queue()
    db = queue.store.db
    try:
        make_pair(db)
        errors = deadlock(db)
        assert len(errors) == 1, errors
        assert errors[0].orig.args[0] == 1213
        assert kind(errors[0]) == (True, False)

        parts = urlsplit(my.url)
        other = pymysql.connect(host=parts.hostname, port=parts.port or 3306,
                                user=parts.username or "root", password=parts.password or "",
                                database=my.name)
        try:
            with other.cursor() as cur:
                cur.execute("BEGIN")
                cur.execute("SELECT n FROM pair WHERE id = 1 FOR UPDATE")
            db.execute_sql("SET SESSION innodb_lock_wait_timeout = 1")
            timeout = failure(db.execute_sql, "UPDATE pair SET n = n + 1 WHERE id = 1")
            assert timeout.orig.args[0] == 1205
            assert kind(timeout) == (True, False)
        finally:
            other.close()
    finally:
        queue.close()


def test_a_deadlock_inside_a_nested_write_runs_the_outermost_transaction_again(database_pm):
    """store.write inside store.write (DurableRun.add: the add inside the transaction of
    its step): a deadlock in the inner one rolls back the whole transaction on MariaDB (not
    only the savepoint), so the outermost is run again, all of it. Trying the inner one
    alone again ran it outside any transaction: its writes committed on their own, the
    outer ones before it lost, and the outer one failed (SAVEPOINT does not exist)."""
    queue = database_pm.queue()
    store, db = queue.store, queue.store.db
    make_pair(db)
    db.execute_sql("CREATE TABLE marks (what VARCHAR(20) NOT NULL)")
    db.execute_sql("CREATE TABLE ballast (n INTEGER NOT NULL)")
    if database_pm.backend == "postgresql":
        import psycopg
        other = psycopg.connect(database_pm.url)
        # The store's side waits first and checks first: the victim.
        other.execute("SET deadlock_timeout = '10s'")
        other.commit()
    else:
        import pymysql
        parts = urlsplit(database_pm.url)
        other = pymysql.connect(host=parts.hostname, port=parts.port or 3306,
                                user=parts.username or "root", password=parts.password or "",
                                database=database_pm.name)
    holds_2, go, errors = threading.Event(), threading.Event(), []
    outer_calls, inner_calls = [], []

    def other_side():
        try:
            cur = other.cursor()
            # InnoDB takes the transaction that changed fewer rows as the victim.
            cur.executemany("INSERT INTO ballast (n) VALUES (%s)", [(n,) for n in range(3000)])
            cur.execute("UPDATE pair SET n = n + 1 WHERE id = 2")
            holds_2.set()
            go.wait(20)
            time.sleep(0.5)          # the store's side waits for row 2 first
            cur.execute("UPDATE pair SET n = n + 1 WHERE id = 1")
            other.commit()
        except Exception as exc:     # reported below: the other side must not be the victim
            errors.append(exc)

    def inner():
        inner_calls.append(1)
        db.execute_sql("UPDATE pair SET n = n + 10 WHERE id = 1")
        if len(inner_calls) == 1:
            go.set()
        db.execute_sql("UPDATE pair SET n = n + 10 WHERE id = 2")
        db.execute_sql("INSERT INTO marks (what) VALUES ('inner')")

    def outer():
        outer_calls.append(1)
        db.execute_sql("INSERT INTO marks (what) VALUES ('before')")
        store.write(inner)
        db.execute_sql("INSERT INTO marks (what) VALUES ('after')")

    thread = threading.Thread(target=other_side)
    thread.start()
    try:
        assert holds_2.wait(20)
        store.write(outer)
        thread.join(30)
        assert not errors, errors
        assert len(inner_calls) == 2, "the deadlock did not hit the store's side"
        assert len(outer_calls) == 2
        assert sorted(r[0] for r in db.execute_sql("SELECT what FROM marks").fetchall()) == [
            "after", "before", "inner"]
        assert dict(db.execute_sql("SELECT id, n FROM pair").fetchall()) == {1: 11, 2: 11}
    finally:
        go.set()
        thread.join(30)
        other.close()
        queue.close()


def test_mysql_errors_are_classified_by_code_not_by_message(my):
    queue = my.queue()
    db = queue.store.db
    try:
        trick = failure(db.execute_sql,
                        "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '%s'" % TRICK)
        assert TRICK in str(trick)                    # text matching would have said yes
        assert trick.orig.args[0] == 1644
        assert kind(trick) == (False, False)
        assert kind(failure(db.execute_sql, "SELEC 1")) == (False, False)
        assert kind(failure(db.execute_sql, "SELECT * FROM no_such_table")) == (False, False)
        assert db.execute_sql("SELECT 1").fetchone()[0] == 1
    finally:
        queue.close()


# -- SQLite --------------------------------------------------------------------------------

def test_sqlite_busy_is_transient_and_retried(lite):
    queue = lite.queue(database={"busy_timeout": 0.05})
    db = queue.store.db
    path = lite.url[len("sqlite:///"):]
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute_sql("CREATE TABLE pair (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
        other.execute("BEGIN IMMEDIATE")                     # holds the write lock

        def insert():
            with db.atomic():
                db.execute_sql("INSERT INTO pair (id, n) VALUES (1, 0)")
        busy = failure(insert)
        assert driver_error(busy).sqlite_errorcode & 0xFF == 5    # SQLITE_BUSY
        assert kind(busy) == (True, False)

        # retry_transaction rides it out once the other writer lets go.
        release = threading.Timer(0.2, other.execute, ("COMMIT",))
        release.start()
        retry_transaction(db, lambda: db.execute_sql("INSERT INTO pair (id, n) VALUES (2, 0)"))
        release.join()
        assert db.execute_sql("SELECT COUNT(*) FROM pair").fetchone()[0] == 1
    finally:
        other.close()
        queue.close()


def test_sqlite_errors_are_classified_by_code_not_by_message(lite):
    queue = lite.queue()
    db = queue.store.db
    try:
        syntax = failure(db.execute_sql, "SELEC 1")
        assert kind(syntax) == (False, False)
        db.execute_sql("CREATE TABLE t (x INTEGER)")
        db.execute_sql("CREATE TRIGGER refuse BEFORE INSERT ON t BEGIN "
                       "SELECT RAISE(ABORT, '%s'); END" % TRICK)
        trick = failure(db.execute_sql, "INSERT INTO t (x) VALUES (1)")
        assert TRICK in str(trick)                    # text matching would have said yes
        assert kind(trick) == (False, False)
        # Not retried: raised on the first attempt.
        attempts = []

        def insert():
            attempts.append(1)
            return db.execute_sql("INSERT INTO t (x) VALUES (1)")
        failure(retry_transaction, db, insert)
        assert len(attempts) == 1
    finally:
        queue.close()


# -- run.progress() under a lost connection ------------------------------------------------

SEEN = {}


class KillsItsConnection(TaskHandler):
    """Ends its own (the runner's) database connection from the server's side, then reports
    progress. data: {"then": "nothing" | "flush" | "progress"}."""

    def handle(self, run):
        store = run.queue.store
        kill_own_connection(store.db, store.backend, SEEN["admin"])
        run.progress(50)                  # must not raise
        SEEN["progress raised"] = False
        then = run.data["then"]
        if then == "flush":
            SEEN["flushed"] = run.flush_progress()
            SEEN["percent"] = run.queue.runs_of(run.task_id)[-1].percent_completed
        elif then == "progress":
            run.progress(70)
            SEEN["percent"] = run.queue.runs_of(run.task_id)[-1].percent_completed
        SEEN["lost"] = run.lost


class ProgressWhileLocked(TaskHandler):
    """Its run's row is locked by another connection while it reports progress twice
    (PostgreSQL lock_timeout: 55P03 each time), then once more after the lock is gone."""

    def handle(self, run):
        import psycopg
        db = run.queue.store.db
        db.execute_sql("SET lock_timeout = '100ms'")
        locker = psycopg.connect(SEEN["url"])
        try:
            locker.execute("SELECT id FROM task_runs WHERE id = %s FOR UPDATE", (run.id,))
            run.progress(40)
            run.progress(45)
            SEEN["flushed while locked"] = run.flush_progress()
            locker.rollback()
            run.progress(60)
            SEEN["percent"] = run.queue.runs_of(run.task_id)[-1].percent_completed
        finally:
            locker.close()
            db.execute_sql("RESET lock_timeout")


def progress_warnings(caplog):
    return [r for r in caplog.records
            if r.name == "taskrunner.runner" and "not stored" in r.getMessage()]


@pytest.fixture
def server_db(request, tmp_path):
    db = Database(request.param, tmp_path)
    yield db
    db.drop()


@pytest.mark.parametrize("server_db", ["postgresql", "mysql"], indirect=True)
@pytest.mark.parametrize("then", ["nothing", "flush", "progress"])
def test_progress_never_raises_a_database_error_into_the_handler(server_db, then, caplog):
    direct_only(server_db, "a server connection the server ends is replaced unseen; the client's is not cut")
    caplog.set_level(logging.WARNING, logger="taskrunner.runner")
    queue = server_db.queue()
    SEEN.clear()
    SEEN["admin"] = server_db.admin
    try:
        task_id = queue.add_task("test_db_errors.KillsItsConnection", {"then": then})
        assert queue.run_pending() == 1
        run = queue.runs_of(task_id)[-1]
        assert (run.status, run.error_code, run.error_message) == (SUCCESS, None, None)
        assert SEEN["progress raised"] is False and SEEN["lost"] is False
        if then == "flush":
            # The kept 50 % was written once the connection came back.
            assert SEEN["flushed"] is True and SEEN["percent"] == 50
        elif then == "progress":
            assert SEEN["percent"] == 70
        assert len(progress_warnings(caplog)) == 1
    finally:
        SEEN.clear()
        queue.close()


@pytest.mark.parametrize("server_db", ["postgresql", "mysql"], indirect=True)
def test_a_run_ends_after_its_connection_was_killed_in_the_handler(server_db, caplog):
    """No progress call at all: the runner itself meets the dead connection when it records
    the outcome, and reconnects (is_disconnect) to record it."""
    direct_only(server_db, "a server connection the server ends is replaced unseen; the client's is not cut")
    caplog.set_level(logging.WARNING, logger="taskrunner.runner")
    queue = server_db.queue()
    SEEN.clear()
    SEEN["admin"] = server_db.admin
    try:
        task_id = queue.add_task("test_db_errors.KillsOnly")
        assert queue.run_pending() == 1
        assert queue.runs_of(task_id)[-1].status == SUCCESS
        assert any("database unavailable" in r.getMessage() for r in caplog.records)
    finally:
        SEEN.clear()
        queue.close()


class KillsOnly(TaskHandler):
    def handle(self, run):
        store = run.queue.store
        kill_own_connection(store.db, store.backend, SEEN["admin"])


def test_progress_warns_once_and_writes_the_latest_percent_later(pg, caplog):
    direct_only(pg, "the handler's SET lock_timeout is session state")
    caplog.set_level(logging.WARNING, logger="taskrunner.runner")
    queue = pg.queue()
    SEEN.clear()
    SEEN["url"] = pg.url
    try:
        task_id = queue.add_task("test_db_errors.ProgressWhileLocked")
        assert queue.run_pending() == 1
        assert queue.runs_of(task_id)[-1].status == SUCCESS
        assert SEEN["flushed while locked"] is False
        assert SEEN["percent"] == 60
        warnings = progress_warnings(caplog)
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "40%" in warnings[0].getMessage()
    finally:
        SEEN.clear()
        queue.close()
