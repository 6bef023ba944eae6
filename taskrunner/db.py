"""Opening the database named by a URL, and what differs between the three backends.

SQLite is the embedded default: WAL, a busy timeout, and every transaction taken as a
write transaction up front (BEGIN IMMEDIATE), which is how SQLite serialises claims.
PostgreSQL (psycopg 3) and MySQL/MariaDB (PyMySQL) are for many hosts sharing one database.
"""
import re
import sqlite3
import sys
import time
from urllib.parse import urlsplit

import peewee
from playhouse import db_url

from .errors import ConfigError, DatabaseUnavailable

SCHEMES = {
    "sqlite": "sqlite",
    "postgres": "postgresql",
    "postgresql": "postgresql",
    "mysql": "mysql",
}


def mask_url(url):
    """The URL with its password replaced by ***, safe for logs, errors and status output.
    The password runs from the first ':' after '//' to the last '@' (an unencoded '@' or '/'
    in a password must not leak part of it)."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*:)(.*)@([^@]*)$", url)
    if not match:
        return url
    return "%s***@%s" % (match.group(1), match.group(3))


def backend_of(url):
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError("unsupported database URL %r: use sqlite:///PATH, postgresql://... or mysql://..."
                          % mask_url(url))
    return SCHEMES[scheme]


def open_database(database_config):
    """A peewee Database for ``[database]``; connects lazily (nothing crosses a fork)."""
    url = database_config.url
    backend = backend_of(url)
    if backend == "sqlite":
        if urlsplit(url).netloc:
            raise ConfigError("invalid SQLite URL %r: use sqlite:///relative/path or sqlite:////absolute/path"
                              % url)
        return db_url.connect(
            url,
            timeout=database_config.busy_timeout,
            lock_type="IMMEDIATE",
            pragmas={
                "journal_mode": "wal",
                "synchronous": database_config.sqlite_synchronous,
                "busy_timeout": int(database_config.busy_timeout * 1000),
            },
        )
    if backend == "postgresql":
        _require("psycopg", "postgres")
        return db_url.connect(url.replace("postgres://", "postgresql://", 1),
                              unquote_password=True, unquote_user=True,
                              connect_timeout=10, prefer_psycopg3=True)
    _require("pymysql", "mysql")
    # DATETIME(6): microseconds matter for FIFO order and timing.
    return db_url.connect(url, unquote_password=True, unquote_user=True, charset="utf8mb4",
                          connect_timeout=10, field_types={"DATETIME": "DATETIME(6)"})


def _require(module, extra):
    try:
        __import__(module)
    except ImportError:
        raise ConfigError("the %s driver is not installed: pip install 'taskrunner[%s]'"
                          % (module, extra)) from None


def check_connection(db, url):
    """Connect now, turning a driver error into a one-line message with the password masked."""
    try:
        db.connect(reuse_if_open=True)
    except peewee.DatabaseError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable("cannot connect to database %s: %s"
                                  % (mask_url(url), _scrub(first_line, url))) from None


def _scrub(message, url):
    password = urlsplit(url).password
    return message.replace(password, "***") if password else message


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


def retry_transaction(db, fn, attempts=8):
    """Run ``fn`` in a write transaction, again after a deadlock or a busy database."""
    for attempt in range(attempts):
        try:
            with db.atomic():
                return fn()
        except peewee.DatabaseError as exc:
            # DatabaseError, not only OperationalError: what is transient is decided by the
            # code (is_transient), whatever class a driver gives it.
            if attempt == attempts - 1 or not is_transient(exc):
                raise
            time.sleep(min(0.5, 0.005 * 2 ** attempt))
