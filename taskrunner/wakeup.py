"""Waking idle runners when work arrives, so they need not poll fast.

Same host, every database: each idle runner listens on a Unix datagram socket in a
directory named after the database; whoever makes a run claimable sends one byte to each
socket there. PostgreSQL also carries the news across hosts: runners LISTEN on a channel,
and adding a task NOTIFYs it in the same transaction (delivered on commit).

Same-host wake-ups are best-effort: a directory or socket this process may not use (the
application and the runners run as different users, a read-only or full disk) never
reaches the caller — it is logged once and the runners poll. A lost wake-up costs at most
``[runner] poll_interval``.

The directory: ``$TASKRUNNER_WAKEUP_DIR``, else ``[runner] wakeup_dir``, else
``$XDG_RUNTIME_DIR`` or the temporary directory; in it one subdirectory per database,
named after the database's canonical key (`channel_key`: one database spelled two ways is
one channel). Subdirectory and sockets are the owner's alone, unless the directory is a
setgid group directory: then its group shares them. Sockets of dead processes are removed
by whoever finds them, and the subdirectory by whoever leaves it empty.

Whoever waits for a task to end (`TaskQueue.wait`) listens the same way in a directory of
its own (the database's directory + `ENDED`): a run's end on this host wakes it. Ends on
other hosts reach it by its bounded poll.
"""
import errno
import hashlib
import logging
import os
import secrets
import socket
import stat
import tempfile
from urllib.parse import unquote, urlsplit

CHANNEL = "taskrunner_runs"
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306}
LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}
# The directory of waiters for runs that ended, beside the one of idle runners.
ENDED = "-ended"

log = logging.getLogger("taskrunner.wakeup")
_reported = set()


def _report_once(what, directory, exc):
    key = (what, directory)
    if key not in _reported:
        _reported.add(key)
        log.warning("same-host wake-ups %s in %s unavailable (%s): runners poll instead",
                    what, directory, exc.strerror or exc)


def channel_key(url):
    """What identifies the database, however its URL is spelled: SQLite's absolute real
    path; a server's backend, host (every loopback spelling is one), port (the default
    written or not) and database name. Users, passwords and options are not part of it."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower().split("+")[0]
        if scheme == "sqlite":
            return "sqlite:" + os.path.realpath(unquote(parts.path[1:]))
        backend = {"postgres": "postgresql", "mariadb": "mysql"}.get(scheme, scheme)
        host = (parts.hostname or "localhost").lower()
        host = "localhost" if host in LOOPBACK else host
        port = parts.port or DEFAULT_PORTS.get(backend)
        return "%s://%s:%s/%s" % (backend, host, port, unquote(parts.path.lstrip("/")))
    except ValueError:
        return url


def base_directory(configured=""):
    return (os.environ.get("TASKRUNNER_WAKEUP_DIR") or configured
            or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())


def directory(url, configured=""):
    """The wake-up directory of the database `url` (see the module's docstring)."""
    digest = hashlib.sha1(channel_key(url).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return os.path.join(base_directory(configured), "taskrunner-%s" % digest)


def _mode(path):
    """0700, with the group's bits added when `path`'s parent is a setgid directory."""
    try:
        parent = os.stat(os.path.dirname(path))
    except OSError:
        return 0o700
    return 0o700 | (parent.st_mode & 0o070 if parent.st_mode & stat.S_ISGID else 0)


class Listener:
    """A runner's end: a socket to wait on while idle. Raises OSError when it cannot be
    made (use `open_listener`)."""

    def __init__(self, path):
        self.directory = path
        self.path = os.path.join(path, "%d.%s.sock" % (os.getpid(), secrets.token_hex(4)))
        mode = _mode(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            for attempt in range(3):
                try:
                    os.mkdir(path, mode)
                    os.chmod(path, mode)  # the umask must not narrow a shared directory
                except FileExistsError:
                    pass
                try:
                    self.sock.bind(self.path)
                    break
                except FileNotFoundError:
                    if attempt == 2:  # removed under us by a last listener leaving, thrice
                        raise
            os.chmod(self.path, mode & 0o660)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        sweep(path)  # what runners killed before closing theirs left behind

    def fileno(self):
        return self.sock.fileno()

    def drain(self):
        try:
            while self.sock.recv(64):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self):
        self.sock.close()
        _unlink_quietly(self.path)
        _remove_if_empty(self.directory)


def open_listener(path):
    """A Listener on the wake-up directory `path`, or None (logged once): the runner then
    polls."""
    try:
        return Listener(path)
    except OSError as exc:
        _report_once("for runners", path, exc)
        return None


def sweep(path):
    """Remove the sockets of processes that are gone; returns the live ones."""
    try:
        return _send(path, None)
    except OSError:
        return []


def notify_local(path):
    """Wake the idle runners of this host listening in `path`; never raises."""
    try:
        _send(path, b"!")
    except OSError as exc:
        _report_once("for senders", path, exc)


def _send(path, payload):
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    live = []
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    try:
        for name in names:
            target = os.path.join(path, name)
            try:
                if payload is None:
                    sender.connect(target)
                    sender.close()
                    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sender.setblocking(False)
                else:
                    sender.sendto(payload, target)
                live.append(target)
            except (ConnectionRefusedError, FileNotFoundError):
                _unlink_quietly(target)  # its runner is gone
            except OSError as exc:
                # EAGAIN/ENOBUFS: its queue is full, it has wake-ups pending already.
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                    _report_once("for senders", path, exc)  # another user's socket
                live.append(target)
    finally:
        sender.close()
    if not live:
        _remove_if_empty(path)
    return live


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove_if_empty(path):
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (another listener), or gone already


def notify_in_transaction(db, backend):
    """PostgreSQL: NOTIFY the runners of every host, delivered when the transaction commits."""
    if backend == "postgresql":
        db.execute_sql("SELECT pg_notify(%s, '')", (CHANNEL,))


class PostgresListener:
    """LISTEN on the runner's own connection; a NOTIFY makes its socket readable. One that
    arrives during another query is kept by psycopg and yielded by the next drain, and the
    runner checks for work after every wait anyway."""

    def __init__(self, db):
        self.db = db
        self.connection = None

    def ensure(self):
        """LISTEN on the current connection (again after a reconnect)."""
        connection = self.db.connection()
        if connection is not self.connection:
            self.db.execute_sql("LISTEN %s" % CHANNEL)
            self.connection = connection

    def fileno(self):
        return self.connection.fileno()

    def drain(self):
        for _ in self.connection.notifies(timeout=0):
            pass
