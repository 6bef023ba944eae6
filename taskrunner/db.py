"""Opening the database named by a URL, and what differs between the three backends.

SQLite is the embedded default: WAL, a busy timeout, and every transaction taken as a
write transaction up front (BEGIN IMMEDIATE), which is how SQLite serialises claims.
PostgreSQL (psycopg 3) and MySQL/MariaDB (PyMySQL) are for many hosts sharing one database.
"""
import re
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


def is_transient(exc):
    """Deadlocks, lock timeouts and a busy SQLite: the transaction can simply be run again."""
    text = str(exc).lower()
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    return code in (1205, 1213) or "deadlock" in text or "database is locked" in text \
        or "could not serialize" in text or "lock wait timeout" in text


def is_disconnect(exc):
    """The server went away (restart, network): drop the connection and reconnect later."""
    if isinstance(exc, peewee.InterfaceError):
        return True
    text = str(exc).lower()
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    return code in (2003, 2006, 2013) or "server closed the connection" in text \
        or "connection" in text and ("closed" in text or "refused" in text or "lost" in text) \
        or "terminating connection" in text


def retry_transaction(db, fn, attempts=8):
    """Run ``fn`` in a write transaction, again after a deadlock or a busy database."""
    for attempt in range(attempts):
        try:
            with db.atomic():
                return fn()
        except peewee.OperationalError as exc:
            if attempt == attempts - 1 or not is_transient(exc):
                raise
            time.sleep(min(0.5, 0.005 * 2 ** attempt))
