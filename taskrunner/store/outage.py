"""Riding out a database outage — a restart, a crash, a network cut, a full or read-only
disk — however long it lasts.

`call_through` calls a function until the database answers it. On a lost connection, or a
database that cannot be written for now (`is_unwritable`: a full disk, a read-only file
system or server, an I/O error), it drops the connection and tries again with a backoff
capped at RECONNECT_DELAY, so work resumes within about that much of the server accepting
connections, or the disk taking writes, again; a deadlock or a busy database is tried again
for TRANSIENT_PATIENCE. Which is which is decided by code (db.is_disconnect,
db.is_transient, is_unwritable); any other error is raised at once.

An outage is logged twice per process and database, whichever of its threads meets it
first: when it begins (`note_lost`) and when a write gets through again (`note_back`) —
never a line per attempt.
"""
import errno
import logging
import os
import sqlite3
import sys
import threading
import time
import weakref

import peewee as pw

from .db import (SQLITE_FULL, SQLITE_IOERR, SQLITE_READONLY, driver_error, first_error,
                 is_disconnect, is_transient, sqlite_file_problem)

log = logging.getLogger("taskrunner.outage")

RECONNECT_DELAY = 1.0        # the longest wait between two reconnection attempts
TRANSIENT_PATIENCE = 60.0

# -- a database that cannot be written for now -------------------------------------------------
#
# By code, as db.py classifies (never by message text). What ends these is outside the
# database: space freed, a file system remounted read-write, a primary promoted. Until
# then every write fails the same way, and nothing acknowledged is lost: the transaction
# that failed was rolled back, and the work in hand (a run's outcome) waits in memory.

# SQLite primary result codes: SQLITE_FULL (the disk, or a quota), SQLITE_READONLY (the file
# or its file system turned read-only), SQLITE_IOERR (the kernel refused a write or a sync:
# EIO, EROFS, ENOSPC met outside SQLite's own check). The fdatasync of group commit
# (groupsync.SyncFailed) by its errno likewise.
SQLITE_UNWRITABLE = frozenset((SQLITE_FULL, SQLITE_READONLY, SQLITE_IOERR))
# PostgreSQL: 53100 disk_full (a table or index could not grow; a WAL write that fails is a
# PANIC instead: the server restarts, which is a disconnect), 58030 io_error, 25006
# read_only_sql_transaction (a standby, or default_transaction_read_only, after a failover).
PG_UNWRITABLE_STATES = frozenset(("53100", "58030", "25006"))
# MySQL / MariaDB: 1021 ER_DISK_FULL, 1114 ER_RECORD_FILE_FULL (a table full: the disk, or
# innodb_data_file_path's limit), 1290 ER_OPTION_PREVENTS_STATEMENT (--read-only),
# 1792 ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION, 1836 ER_READ_ONLY_MODE.
MYSQL_UNWRITABLE_CODES = frozenset((1021, 1114, 1290, 1792, 1836))


def is_unwritable(exc):
    """The database cannot take writes for now (a full disk, a read-only file system or
    server, an I/O error) — a condition to wait out, not a bug. By error code only."""
    err = driver_error(first_error(exc)) if isinstance(exc, pw.PeeweeException) \
        else driver_error(exc)
    if isinstance(err, OSError):
        # A failed fdatasync after a commit (groupsync.SyncFailed).
        return err.errno in (errno.EIO, errno.EROFS, errno.ENOSPC, errno.EDQUOT)
    if isinstance(err, sqlite3.Error):
        code = getattr(err, "sqlite_errorcode", None)
        return code is not None and code & 0xFF in SQLITE_UNWRITABLE
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(err, psycopg.Error):
        return err.sqlstate in PG_UNWRITABLE_STATES
    pymysql = sys.modules.get("pymysql")
    if pymysql is not None and isinstance(err, pymysql.err.MySQLError):
        return bool(err.args) and err.args[0] in MYSQL_UNWRITABLE_CODES
    return False


def outage_kind(exc):
    """"disconnect" (the connection is gone or cannot be made), "unwritable" (see
    `is_unwritable`) or None: what a caller rides out rather than raises."""
    if is_disconnect(exc):
        return "disconnect"
    if is_unwritable(exc):
        return "unwritable"
    return None


class DatabaseLost(Exception):
    """The caller stopped waiting for an unreachable database (its `give_up` said why)."""


def first_line(exc):
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def close_quietly(db):
    """Drop this thread's connection after an error. Closing a dead one may fail in any
    driver-specific way (PyMySQL: "Already closed"), which changes nothing."""
    try:
        if not db.is_closed():
            db.close()
    except Exception:
        log.debug("closing the lost connection failed", exc_info=True)


# -- one start line and one end line per outage -------------------------------------------------

_lock = threading.Lock()
_outages = weakref.WeakKeyDictionary()     # peewee Database -> (monotonic start, kind)


def _after_fork_in_child():
    """A child starts with no outage of its own, and a lock no thread of its holds."""
    global _lock
    _lock = threading.Lock()
    _outages.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _described(db, exc, kind):
    line = first_line(first_error(exc) if isinstance(exc, pw.PeeweeException) else exc)
    if kind == "unwritable" and isinstance(db, pw.SqliteDatabase):
        problem = sqlite_file_problem(db.database)
        if problem:
            return "%s: %s" % (problem, line)
    return line


def note_lost(db, exc):
    """`exc`, an error of a statement on `db`: whether it is an outage (`outage_kind`). The
    first of an outage is logged, once for all the threads of this process using `db`."""
    kind = outage_kind(exc)
    if kind is None:
        return False
    with _lock:
        if db in _outages:
            return True
        _outages[db] = (time.monotonic(), kind)
    if kind == "disconnect":
        log.warning("database unavailable (%s); reconnecting every %gs at most",
                    _described(db, exc, kind), RECONNECT_DELAY)
    else:
        log.warning("database cannot be written (%s); trying again every %gs at most, "
                    "keeping the work in hand", _described(db, exc, kind), RECONNECT_DELAY)
    return True


def note_back(db):
    """A statement on `db` got through: the end of its outage, if there was one, is logged
    (once). Returns for how long it lasted, or None."""
    if db not in _outages:
        return None
    with _lock:
        began = _outages.pop(db, None)
    if began is None:
        return None
    lasted = time.monotonic() - began[0]
    log.info("database %s again after %.1fs",
             "reachable" if began[1] == "disconnect" else "writable", lasted)
    return lasted


def call_through(db, fn, reconnected=None, give_up=None):
    """fn(), through any outage; returns (its result, seconds the database was unreachable
    or unwritable, or None). `reconnected()` runs first on a new connection, before fn is
    tried again. `give_up()`, asked after each lost attempt, returns a reason to stop
    waiting (raised as DatabaseLost) or None."""
    delay, lost_at, deadline = 0.1, None, time.monotonic() + TRANSIENT_PATIENCE
    while True:
        try:
            if lost_at is not None and reconnected is not None:
                reconnected()
            result = fn()
        except (pw.OperationalError, pw.InterfaceError) as exc:
            if note_lost(db, exc):
                if lost_at is None:
                    lost_at = time.monotonic()
                # A full disk or a read-only file: SQLite rolled the transaction back
                # itself, so peewee's view of the connection is stale; a new one is cheap.
                close_quietly(db)
                reason = give_up() if give_up is not None else None
                if reason:
                    raise DatabaseLost(reason) from None
            elif not is_transient(exc) or time.monotonic() > deadline:
                raise
            # A deadlock or a busy database rolled back the transaction and left the
            # connection usable (closing it would also drop PostgreSQL's LISTEN).
            time.sleep(delay)
            delay = min(delay * 2, RECONNECT_DELAY)
            continue
        note_back(db)
        if lost_at is None:
            return result, None
        return result, time.monotonic() - lost_at
