"""Riding out a database outage — a restart, a crash, a network cut — however long it lasts.

`call_through` calls a function until the database answers it. On a lost connection it
drops the connection and tries again with a backoff capped at RECONNECT_DELAY, so work
resumes within about that much of the server accepting connections again; a deadlock or a
busy database is tried again for TRANSIENT_PATIENCE. Which is which is decided by code
(db.is_disconnect, db.is_transient); any other error is raised at once.
"""
import logging
import time

import peewee as pw

from .db import is_disconnect, is_transient

log = logging.getLogger("taskrunner.outage")

RECONNECT_DELAY = 1.0        # the longest wait between two reconnection attempts
TRANSIENT_PATIENCE = 60.0


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


def call_through(db, fn, reconnected=None, give_up=None):
    """fn(), through any outage; returns (its result, seconds the database was unreachable
    or None). `reconnected()` runs first on a new connection, before fn is tried again.
    `give_up()`, asked after each lost attempt, returns a reason to stop waiting (raised as
    DatabaseLost) or None."""
    delay, lost_at, deadline = 0.1, None, time.monotonic() + TRANSIENT_PATIENCE
    while True:
        try:
            if lost_at is not None and reconnected is not None:
                reconnected()
            result = fn()
        except (pw.OperationalError, pw.InterfaceError) as exc:
            if is_disconnect(exc):
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("database unavailable (%s); reconnecting every %gs at most",
                                first_line(exc), RECONNECT_DELAY)
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
        if lost_at is None:
            return result, None
        lost_for = time.monotonic() - lost_at
        log.info("database reachable again after %.1fs", lost_for)
        return result, lost_for
