"""Waking idle runners when work arrives, so they need not poll fast.

Same host, every database: each idle runner listens on a Unix datagram socket in a
directory named after the database; whoever makes a run claimable sends one byte to each
socket there. PostgreSQL also carries the news across hosts: runners LISTEN on a channel,
and adding a task NOTIFYs it in the same transaction (delivered on commit).

A lost wake-up costs at most ``[runner] poll_interval``: runners still poll.

Whoever waits for a task to end (`TaskQueue.wait`) listens the same way in a directory of
its own (`ENDED`): a run's end on this host wakes it. Ends on other hosts reach it by its
bounded poll.
"""
import errno
import functools
import hashlib
import itertools
import os
import socket
import tempfile

CHANNEL = "taskrunner_runs"
# What a listener waits for: runs to claim (idle runners), or runs that ended (waiters).
CLAIMABLE, ENDED = "", "-ended"
_SERIAL = itertools.count()


@functools.lru_cache(maxsize=64)     # computed on every run's end (wake the waiters)
def _directory(url, kind=CLAIMABLE):
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, "taskrunner-%s%s" % (digest, kind))


class Listener:
    """A runner's end: a socket (and, on PostgreSQL, a LISTEN) to wait on while idle."""

    def __init__(self, url, kind=CLAIMABLE):
        self.directory = _directory(url, kind)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        # A process may wait for several tasks at once (threads): each waiter its own socket.
        name = "%d.sock" % os.getpid() if kind == CLAIMABLE else \
            "%d-%d.sock" % (os.getpid(), next(_SERIAL))
        self.path = os.path.join(self.directory, name)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

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
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def notify_local(url, kind=CLAIMABLE):
    """Wake the idle runners (or the waiters, `ENDED`) of this host that work on `url`'s
    database."""
    directory = _directory(url, kind)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    try:
        for name in names:
            path = os.path.join(directory, name)
            try:
                sender.sendto(b"!", path)
            except (ConnectionRefusedError, FileNotFoundError):
                # The runner is gone: its socket file is stale.
                _unlink_quietly(path)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                    raise
                # Its queue is full: it has wake-ups pending already.
    finally:
        sender.close()


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


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
