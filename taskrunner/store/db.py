"""Opening the database named by a URL, and what differs between the three backends.

SQLite is the embedded default: WAL, a busy timeout, and every transaction taken as a
write transaction up front (BEGIN IMMEDIATE), which is how SQLite serialises claims.
PostgreSQL (psycopg 3) and MySQL/MariaDB (PyMySQL) are for many hosts sharing one database.
"""
import math
import os
import re
import sqlite3
import sys
import time
from urllib.parse import parse_qsl, urlsplit

import peewee
from playhouse import db_url

from ..errors import ConfigError, DatabaseUnavailable
from ..masking import redact

SCHEMES = {
    "sqlite": "sqlite",
    "postgres": "postgresql",
    "postgresql": "postgresql",
    "mysql": "mysql",
}


def split_url(url):
    """urlsplit(url) with its port read, ConfigError (password masked) for a malformed URL."""
    if not isinstance(url, str):
        raise ConfigError("the database URL must be a string, not %s" % type(url).__name__)
    try:
        url.encode("utf-8")
        parts = urlsplit(url)
        if parts.scheme.lower() != "sqlite":   # sqlite://:memory: has no port
            parts.port
    except UnicodeEncodeError:
        raise ConfigError("invalid database URL %s: not UTF-8 text" % _shown(url)) from None
    except ValueError as exc:
        # urllib's message quotes the port as it read it, which may be part of a password.
        reason = "the port is not a number from 0 to 65535" if "port" in str(exc).lower() \
            else "unbalanced [ ] around the host"
        raise ConfigError("invalid database URL %s: %s" % (_shown(url), reason)) from None
    return parts


def _shown(url):
    return repr(redact(url.encode("utf-8", "backslashreplace").decode("utf-8")))


def backend_of(url):
    scheme = split_url(url).scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError("unsupported database URL %s: use sqlite:///PATH, postgresql://... or "
                          "mysql://..." % _shown(url))
    return SCHEMES[scheme]


def sqlite_path(url, ephemeral=False):
    """The file of a sqlite:// URL. A database that would not outlive the process (an empty
    path, ``:memory:``, a temporary database) is refused unless `ephemeral`: a task added to
    it is acknowledged and then lost. With `ephemeral`, such a URL is ``:memory:``."""
    parts = split_url(url)
    if parts.query or parts.fragment:
        raise ConfigError("invalid SQLite URL %s: it takes no parameters (set [database] keys "
                          "instead)" % _shown(url))
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    memory = (parts.netloc == ":memory:" and not path) or path in ("", ":memory:") \
        or path.startswith("file::memory:")
    if parts.netloc and not memory:
        raise ConfigError("invalid SQLite URL %s: use sqlite:///relative/path or "
                          "sqlite:////absolute/path" % _shown(url))
    if memory and not ephemeral:
        raise ConfigError("database URL %s names no file: its tasks would be lost with the "
                          "process; use sqlite:///PATH (an in-memory database only with "
                          "TaskQueue(..., ephemeral=True))" % _shown(url))
    return ":memory:" if memory else path


# What a connection through each [database] pooler needs. PgBouncer in transaction pooling
# mode hands each transaction (each autocommit statement) to whichever server connection is
# free, so nothing may outlive a transaction on the server: no server-side prepared
# statements (psycopg prepares a query after its 5th execution; PgBouncer < 1.21 cannot
# follow them, later ones only with max_prepared_statements set), no LISTEN (runners poll,
# or LISTEN on [database] listen_url), no session advisory locks, SET or temporary tables.
# taskrunner's SQL uses none of these (migrations take pg_advisory_xact_lock).
POOLERS = {"": {}, "pgbouncer": {"prepare_threshold": None}}


CONNECT_TIMEOUT = 10       # seconds


def open_database(database_config, ephemeral=False, patience=None):
    """A peewee Database for ``[database]``; connects lazily (nothing crosses a fork).
    `ephemeral` allows an in-memory SQLite database (tests). `patience` (seconds) bounds
    every wait of one statement for the database — a lock held by someone else, a
    connection — for a process that must never wait long (see `Store`): SQLite's busy
    timeout; PostgreSQL's lock_timeout and statement_timeout (not through a pooler, which
    refuses session options at connect) and its connect_timeout (libpq waits at least
    2 s); MySQL's innodb_lock_wait_timeout (whole seconds, at least 1) and connect_timeout.
    A URL that sets ``options`` (PostgreSQL) or ``init_command`` (MySQL) itself keeps it, and
    its statements then wait as the server's settings say."""
    url = database_config.url
    backend = backend_of(url)
    if backend == "sqlite":
        busy = database_config.busy_timeout if patience is None else patience
        return peewee.SqliteDatabase(
            sqlite_path(url, ephemeral),
            timeout=busy,
            lock_type="IMMEDIATE",
            pragmas={
                "journal_mode": "wal",
                "synchronous": database_config.sqlite_synchronous,
                "busy_timeout": int(busy * 1000),
            },
        )
    parts = split_url(url)
    if not parts.path.strip("/"):
        raise ConfigError("database URL %s names no database: use %s://[USER@]HOST[:PORT]/NAME"
                          % (_shown(url), parts.scheme))
    connect_timeout = CONNECT_TIMEOUT if patience is None else max(1, math.ceil(patience))
    try:
        if backend == "postgresql":
            _require("psycopg", "postgres")
            bounds = {}
            if patience is not None and not database_config.pooler \
                    and "options" not in _query_keys(parts):
                bounds["options"] = "-c lock_timeout=%d -c statement_timeout=%d" % (
                    patience * 1000, patience * 1000)
            return db_url.connect(url.replace("postgres://", "postgresql://", 1),
                                  unquote_password=True, unquote_user=True,
                                  connect_timeout=connect_timeout, prefer_psycopg3=True,
                                  **POOLERS[database_config.pooler], **bounds)
        _require("pymysql", "mysql")
        bounds = {} if patience is None or "init_command" in _query_keys(parts) else {
            "init_command": "SET SESSION innodb_lock_wait_timeout = %d"
                            % max(1, math.ceil(patience))}
        # peewee's db_url names a MySQL URL's password `passwd`, an alias PyMySQL deprecates
        # (a DeprecationWarning at every connect): the parsed URL with PyMySQL's own name.
        params = db_url.parse(url, unquote_password=True, unquote_user=True)
        if "passwd" in params:
            params["password"] = params.pop("passwd")
        # DATETIME(6): microseconds matter for FIFO order and timing.
        params.update(charset="utf8mb4", connect_timeout=connect_timeout,
                      field_types={"DATETIME": "DATETIME(6)"}, **bounds)
        return peewee.MySQLDatabase(params.pop("database"), **params)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError("invalid database URL %s: %s" % (_shown(url), redact(str(exc), url))) \
            from None


def _query_keys(parts):
    return {key for key, _ in parse_qsl(parts.query, keep_blank_values=True)}


def _require(module, extra):
    try:
        __import__(module)
    except ImportError:
        raise ConfigError("the %s driver is not installed: pip install 'taskrunner-db[%s]'"
                          % (module, extra)) from None


def check_connection(db, url):
    """Connect now and check the server's version, turning a driver error into a one-line
    message with the password masked."""
    try:
        db.connect(reuse_if_open=True)
        check_version(*server_version(db))
    except peewee.DatabaseError as exc:
        raise DatabaseUnavailable("cannot connect to database %s: %s"
                                  % (redact(url), describe_error(exc, url))) from None
    except (TypeError, ValueError) as exc:
        # A query-string parameter the driver does not take, or one of the wrong type.
        raise ConfigError("invalid database URL %s: %s" % (_shown(url), redact(str(exc), url))) \
            from None


# -- versions ----------------------------------------------------------------------------------

# What the SQL needs: SQLite's claim is UPDATE ... RETURNING (3.35); MySQL and MariaDB claim
# with FOR UPDATE SKIP LOCKED (MySQL 8.0.1, MariaDB 10.6); PostgreSQL's needs 9.5 (SKIP LOCKED)
# but psycopg 3 speaks to servers from 10 on.
MINIMUM_VERSIONS = {"SQLite": (3, 35, 0), "PostgreSQL": (10, 0), "MySQL": (8, 0, 1),
                    "MariaDB": (10, 6, 0)}


def check_version(product, version):
    """ConfigError in one line when `version` (a tuple of ints) of `product` (a key of
    MINIMUM_VERSIONS) is older than taskrunner's SQL needs."""
    minimum = MINIMUM_VERSIONS[product]
    if tuple(version) < minimum:
        raise ConfigError("%s %s is too old: taskrunner needs %s %s or later"
                          % (product, ".".join(map(str, version)), product,
                             ".".join(map(str, minimum))))


def parse_mysql_version(text):
    """("MariaDB" or "MySQL", version tuple) from SELECT VERSION()'s text."""
    numbers = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", text)
    version = tuple(int(n) for n in numbers.groups()) if numbers else (0, 0, 0)
    return ("MariaDB" if "mariadb" in text.lower() else "MySQL"), version


def server_version(db):
    """(product, version tuple) of the database behind a connected peewee Database."""
    if isinstance(db, peewee.SqliteDatabase):
        return "SQLite", sqlite3.sqlite_version_info
    if isinstance(db, peewee.PostgresqlDatabase):
        number = int(db.execute_sql("SHOW server_version_num").fetchone()[0])
        return "PostgreSQL", (number // 10000, number % 10000) if number >= 100000 \
            else (number // 10000, number // 100 % 100, number % 100)
    return parse_mysql_version(db.execute_sql("SELECT VERSION()").fetchone()[0])


# -- classifying database errors -------------------------------------------------------------
#
# By SQLSTATE or driver error code, never by message text: messages are translated
# (lc_messages), reworded between server versions, and partly chosen by whoever raises the
# error (RAISE EXCEPTION, SIGNAL), so a handler's own error must not pass for a deadlock.

# PostgreSQL. Class 08 (connection_exception) and these mean the session is gone:
# 57P01 admin_shutdown (fast shutdown, pg_terminate_backend), 57P02 crash_shutdown,
# 57P03 cannot_connect_now (starting up, shutting down, in recovery), 57P05
# idle_session_timeout and 25P03 idle_in_transaction_session_timeout (the server closes the
# session after sending them).
PG_DISCONNECT_STATES = frozenset(("57P01", "57P02", "57P03", "57P05", "25P03"))
# Run the transaction again: 40001 serialization_failure, 40P01 deadlock_detected,
# 55P03 lock_not_available (NOWAIT, lock_timeout), 53300 too_many_connections (a slot frees).
PG_TRANSIENT_STATES = frozenset(("40001", "40P01", "55P03", "53300"))

# MySQL / MariaDB error numbers (PyMySQL puts them in args[0]): 2002/2003 cannot connect,
# 2006 server has gone away, 2013 lost connection during query, 2055 lost connection (at
# reading/writing), 1927 connection was killed (MariaDB), 1053 server shutdown in progress,
# 4031 disconnected by the server for inactivity (MySQL 8).
MYSQL_DISCONNECT_CODES = frozenset((2002, 2003, 2006, 2013, 2055, 1927, 1053, 4031))
# 1205 lock wait timeout, 1213 deadlock, 1040 too many connections (as PostgreSQL's 53300).
MYSQL_TRANSIENT_CODES = frozenset((1205, 1213, 1040))

# SQLite primary result codes (sqlite3.SQLITE_BUSY and SQLITE_LOCKED exist only from Python
# 3.11): another connection holds the lock. Extended codes (SQLITE_BUSY_SNAPSHOT, ...) carry
# the primary code in their low byte.
SQLITE_BUSY, SQLITE_LOCKED = 5, 6


def driver_error(exc):
    """The DB-API driver's exception behind `exc`, or None (an error peewee raised itself).

    peewee 4 re-raises a driver error as its own class (``peewee.OperationalError`` for a
    ``psycopg.errors.DeadlockDetected``...) built as ``new_type(driver_exc, *driver_exc.args)``;
    ``PeeweeException.__init__`` keeps the driver's exception as ``exc.orig`` (and, raised in
    ``ExceptionWrapper.__exit__``, it is also ``exc.__context__``). ``__cause__`` covers
    code that wraps with ``raise ... from``. An exception that is not peewee's is returned
    as it is, so a bare driver error is classified too. A failed connection attempt made on
    the way to a query is wrapped twice (``connect()``, then the query's wrapper), so the
    chain is followed down to the driver."""
    for _ in range(8):       # a cycle cannot keep this going
        if not isinstance(exc, peewee.PeeweeException):
            return exc
        exc = getattr(exc, "orig", None) or exc.__cause__
    return None


def _kind(exc):
    """One of "disconnect", "transient" or None for `exc`, by code only."""
    if getattr(exc, "transient", False):    # an error that says so (hostlock.HostLockBusy)
        return "transient"
    if isinstance(exc, peewee.InterfaceError):
        # peewee's own InterfaceError (database not initialised) and a driver's (PyMySQL's
        # (0, '') on a connection it already closed): in any case, no usable connection.
        return "disconnect"
    err = driver_error(exc)
    if err is None:
        return None
    # A driver not imported yet cannot have raised this error: look it up, never import it
    # (`import taskrunner` stays driver-free, and SQLite users need neither).
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(err, psycopg.Error):
        return _postgresql_kind(psycopg, err)
    pymysql = sys.modules.get("pymysql")
    if pymysql is not None and isinstance(err, pymysql.err.MySQLError):
        return _mysql_kind(pymysql, err)
    if isinstance(err, sqlite3.Error):
        return _sqlite_kind(err)
    return None


def _postgresql_kind(psycopg, err):
    state = err.sqlstate
    if state is None:
        # No SQLSTATE: raised by the client, not sent by the server. An OperationalError or
        # InterfaceError of that kind is about the connection itself: "the connection is
        # lost/closed", "consuming input failed: server closed the connection", a failed
        # connection attempt — including "the database system is starting up / shutting
        # down" (57P03): libpq reports a refused connection as text only, without SQLSTATE.
        if isinstance(err, (psycopg.OperationalError, psycopg.InterfaceError)):
            return "disconnect"
        pgconn = getattr(err, "pgconn", None)       # psycopg >= 3.1
        if pgconn is not None and pgconn.status == psycopg.pq.ConnStatus.BAD:
            return "disconnect"
        return None
    if state.startswith("08") or state in PG_DISCONNECT_STATES:
        return "disconnect"
    if state in PG_TRANSIENT_STATES:
        return "transient"
    return None


def _mysql_kind(pymysql, err):
    if isinstance(err, pymysql.err.InterfaceError):
        return "disconnect"       # PyMySQL's (0, ''): used after it closed the connection
    code = err.args[0] if err.args and isinstance(err.args[0], int) else None
    if code in MYSQL_DISCONNECT_CODES:
        return "disconnect"
    if code in MYSQL_TRANSIENT_CODES:
        return "transient"
    return None


def _sqlite_kind(err):
    code = getattr(err, "sqlite_errorcode", None)
    if code is None:
        # Python < 3.11 has no sqlite_errorcode. Without the code, the class is all there is:
        # every sqlite3.OperationalError counts as transient (a busy database is one, but so
        # is a syntax error, which retry_transaction then tries again a few times before
        # raising it). The message text is deliberately not read.
        return "transient" if isinstance(err, sqlite3.OperationalError) else None
    if code & 0xFF in (SQLITE_BUSY, SQLITE_LOCKED):
        return "transient"
    return None       # SQLite has no connection to lose: a file is opened, not a server


def is_transient(exc):
    """Deadlocks, serialization failures, lock timeouts, a busy SQLite, no free connection
    slot: the transaction can simply be run again. By SQLSTATE / error code only."""
    return _kind(exc) == "transient"


def is_disconnect(exc):
    """The connection is gone or cannot be made (server restart or shutdown, terminated
    session, network): drop the connection and reconnect later. By SQLSTATE / error code,
    and for psycopg a connection-level error that has no SQLSTATE."""
    return _kind(exc) == "disconnect"


ATTEMPTS = 8        # tries of a write transaction after a deadlock or a busy database


def retry_transaction(db, fn, attempts=ATTEMPTS, lock=None, single_statement=False):
    """Run ``fn`` in a write transaction, again after a deadlock or a busy database. `lock`:
    a context manager held around each attempt's transaction, not around the wait between
    attempts (SQLite's host lock). `single_statement`: ``fn`` runs one statement, which is
    its own transaction outside a transaction block (no BEGIN and COMMIT round trips)."""
    for attempt in range(attempts):
        try:
            if single_statement:
                return fn()
            if lock is None:
                with write_transaction(db):
                    return fn()
            with lock, write_transaction(db):
                return fn()
        except peewee.DatabaseError as exc:
            # DatabaseError, not only OperationalError: what is transient is decided by the
            # code (is_transient), whatever class a driver gives it.
            cause = first_error(exc)
            if attempt == attempts - 1 or not is_transient(cause):
                if cause is exc:
                    raise
                raise cause from None
            time.sleep(min(0.5, 0.005 * 2 ** attempt))


def write_transaction(db):
    """A transaction block on `db`: peewee's atomic() inside another (a savepoint), else its
    transaction() — what atomic() makes at depth 0, without the wrapper around it (a busy
    SQLite runner opens one per job). Either way peewee's own: savepoints inside,
    after_commit callbacks run on commit and dropped on rollback."""
    return db.atomic() if db.transaction_depth() else db.transaction()


def executor(db):
    """`db.execute_sql` for the statements of every job (sql.claim, sql.end_success): on
    SQLite inside a transaction, the connection's own execute, its errors raised as peewee's
    as execute_sql raises them, without the layers around it (a cursor made and checked, a
    debug log line: together more than the statement of an indexed one-row UPDATE)."""
    conn = db.connection() if db.in_transaction() else None
    if not isinstance(conn, sqlite3.Connection):
        return db.execute_sql
    errors_as_peewee = peewee.__exception_wrapper__

    def execute(statement, params=()):
        # The wrapper only when something is raised: entering and leaving it are two Python
        # calls per statement, more than binding the statement's values.
        try:
            return conn.execute(statement, params)
        except Exception:
            with errors_as_peewee:
                raise
    return execute


def first_error(exc):
    """The database error that started `exc`. When a statement or the commit fails and the
    rollback that follows fails too, peewee raises the rollback's error: SQLite ends the
    transaction itself on a full disk, and "cannot rollback - no transaction is active"
    would hide "database or disk is full". The error being handled then is the cause."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        contexts = (getattr(driver_error(exc), "__context__", None),
                    None if exc.__suppress_context__ else exc.__context__)
        earlier = [c for c in contexts if isinstance(c, peewee.DatabaseError) and c is not exc]
        if not earlier:
            break
        exc = earlier[0]
    return exc


# -- what is wrong with a SQLite file --------------------------------------------------------

SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN = 8, 10, 13, 14
_FREE_ENOUGH = 64 * 1024     # less than this free: a write of a few pages fails


def sqlite_file_problem(path):
    """What keeps SQLite from writing the database `path` (and its -wal and -shm files beside
    it), in words, or None: a missing directory, a directory, a read-only file or file
    system, a full disk."""
    if path == ":memory:":
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return "the directory %s does not exist" % directory
    if os.path.isdir(path):
        return "%s is a directory" % path
    try:
        stat = os.statvfs(directory)
        if stat.f_bavail * stat.f_frsize < _FREE_ENOUGH:
            return "no space left on the file system of %s" % directory
    except OSError:
        pass
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "%s is read-only" % path
    if not os.access(directory, os.W_OK):
        return "the directory %s is read-only (SQLite writes its -wal and -shm files there)" \
            % directory
    return None


def describe_error(exc, url):
    """One line for a database error, secrets masked; for SQLite, what is wrong with the
    file when that explains it (a full disk, a read-only file, a missing directory)."""
    exc = first_error(exc)
    text = str(exc).strip()
    line = redact(text.splitlines()[0] if text else type(exc).__name__, url)
    err = driver_error(exc)
    if isinstance(err, sqlite3.Error) and isinstance(url, str) and url.lower().startswith("sqlite"):
        code = getattr(err, "sqlite_errorcode", None)
        if code is None or code & 0xFF in (SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL,
                                           SQLITE_CANTOPEN):
            try:
                problem = sqlite_file_problem(sqlite_path(url, ephemeral=True))
            except ConfigError:
                problem = None
            if problem:
                return "%s (%s)" % (problem, line)
    return line
