"""Waking idle runners when work arrives, so they need not poll fast.

Same host, every database: each idle runner listens on a Unix datagram socket in a
directory named after the database. An overseer keeps a hub there (hub.py): its runners
tell it when they go idle and when they leave idle (transitions only: a busy runner costs
nothing), and whoever makes runs claimable sends the hub one datagram saying how many and
in which queue; the hub wakes that many idle runners, not all of them. Without a hub
(standalone runners, `run_pending`) the sender writes one byte to each socket of the
directory, whose listing it keeps until the directory changes.

PostgreSQL also carries the news across hosts: adding a task NOTIFYs a channel in the same
transaction (delivered on commit), with the same count and queue and the sender's origin
(host and directory), and the hub of every other host LISTENs on a direct connection of
its own (`listen_url`). Runners under an overseer never LISTEN, so a busy runner's
connection holds no notifications; standalone runners LISTEN themselves. Behind a pooler
(``[database] pooler``) LISTEN needs ``[database] listen_url``, else runners of other hosts
poll.

Same-host wake-ups are best-effort: a directory or socket this process may not use (the
application and the runners run as different users, a read-only or full disk) never
reaches the caller — it is logged once and the runners poll. A lost wake-up costs at most
``[runner] poll_interval``.

The directory: in ``$TASKRUNNER_WAKEUP_DIR``, else ``[runner] wakeup_dir``, one
subdirectory per database named after its canonical key (`channel_key`: one database
spelled two ways is one channel); without either, a SQLite database's is beside its file
(``<database>-wakeup``: shared by exactly who shares the database, out of other users'
reach unless they may write there), a server's in ``$XDG_RUNTIME_DIR``, else the temporary
directory. Subdirectory and sockets are the owner's alone, unless the base is a setgid group
directory: then its group shares them. Whoever planted a name there first (a symlink, a
directory of another user) gets it refused, never used (runtimedir.py). Sockets of dead
processes are removed by whoever finds them, and the subdirectory by whoever leaves it
empty.

Whoever waits for a task to end (`TaskQueue.wait`) listens the same way in a directory of
its own (the database's directory + `ENDED`): a run's end on this host wakes it. Ends on
other hosts reach it by its bounded poll. With nobody waiting, a run's end costs one
failed open() of a missing directory.
"""
import errno
import hashlib
import logging
import os
import random
import secrets
import socket
import tempfile
import time
from urllib.parse import unquote, urlsplit

from .runtimedir import RuntimeDir

CHANNEL = "taskrunner_runs"
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306}
LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}
# The directory of waiters for runs that ended, beside the one of idle runners.
ENDED = "-ended"
# The hub's socket in the runners' directory (hub.py); senders never list it as a runner.
HUB = "hub"
# A SQLite database's wake-up directory, beside its file, without a configured base.
BESIDE = "-wakeup"
ANY = "*"
# A directory changed this recently may change again within its mtime's granularity: its
# listing is not kept.
SETTLED = 0.05

log = logging.getLogger("taskrunner.wakeup")
_reported = set()


def report_once(what, directory, exc):
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


def sqlite_file(url):
    """The real path of a SQLite database's file, or None (another database, in memory)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "sqlite":
        return None
    path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
    if path in ("", ":memory:") or path.startswith("file:") or parts.netloc:
        return None
    return os.path.realpath(path)


def directory(url, configured=""):
    """The wake-up directory of the database `url` (see the module's docstring)."""
    base = os.environ.get("TASKRUNNER_WAKEUP_DIR") or configured
    if not base:
        database = sqlite_file(url)
        if database is not None:
            return database + BESIDE
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    digest = hashlib.sha1(channel_key(url).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return os.path.join(base, "taskrunner-%s" % digest)


def origin(path):
    """Who sends news from `path` on this host: a hub ignores NOTIFYs of its own origin,
    whose news reached it as a datagram."""
    return "%s:%s" % (socket.gethostname(), path)


def news(count=None, queue=None, sender=""):
    """The text of a wake-up: `count` runs (None: unknown) made claimable in `queue` (None:
    unknown), sent by `sender` (an `origin`, or "" for anyone)."""
    return "w %s %s %s" % (ANY if count is None else int(count), queue or ANY, sender)


def parse_news(text):
    """(count or None, queue or None, origin) of a `news` text; anything else (an empty
    NOTIFY of an older version) is news of unknown size."""
    parts = text.split(" ", 3)
    if len(parts) < 3 or parts[0] != "w":
        return None, None, ""
    count = int(parts[1]) if parts[1].isdigit() else None
    return count, None if parts[2] == ANY else parts[2], parts[3] if len(parts) > 3 else ""


class Listener:
    """A runner's end: a socket to wait on while idle. Raises OSError when it cannot be
    made (use `open_listener`). Under a hub, `idle()` and `leave()` tell the hub."""

    def __init__(self, path):
        self.directory = path
        name = "%d.%s.sock" % (os.getpid(), secrets.token_hex(4))
        self.path = os.path.join(path, name)
        self.announced = False
        # Whether the last drain() read a wake-up sent to this runner alone: it had told a
        # hub it was idle, and a hub wakes one idle runner per run added.
        self.called = False
        for attempt in range(3):
            self.dir = RuntimeDir.open(path, create=True)
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                self.sock.bind(self.dir.address(name))
                self.dir.chmod(name, 0o600 if self.dir.group is None else 0o660)
                break
            except OSError as exc:
                self.sock.close()
                self.dir.remove(name)
                self.dir.close()
                # Removed under us by a last listener leaving (thrice: give up).
                if not isinstance(exc, FileNotFoundError) or attempt == 2:
                    raise
        self.sock.setblocking(False)
        self.hub = self.dir.address(HUB)
        sweep(path)  # what runners killed before closing theirs left behind

    def fileno(self):
        return self.sock.fileno()

    def drain(self):
        """Read what woke us; returns whether anything was there. A hub forgets the runners
        it wakes: the next `idle()` tells it again."""
        woken = False
        try:
            while self.sock.recv(64):
                woken = True
        except (BlockingIOError, InterruptedError):
            pass
        self.called = woken and self.announced
        if woken:
            self.announced = False
        return woken

    def idle(self, serving=None):
        """Tell the hub (if there is one) that this runner waits for work in the queues
        `serving` (None: all). Returns False only when the hub's queue is full (it lags):
        the caller looks again soon, since news sent meanwhile may not wake it."""
        if self.announced:
            return True
        text = "i " + (",".join(serving) if serving is not None else ANY)
        try:
            self.sock.sendto(text.encode("utf-8"), self.hub)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                return False
            return True       # no hub (gone, or none): senders fall back to our socket
        self.announced = True
        return True

    def leave(self):
        """Tell the hub this runner found work by itself (a poll): it is no longer idle."""
        if self.announced:
            self.announced = False
            try:
                self.sock.sendto(b"b", self.hub)
            except OSError:
                pass

    def close(self):
        self.sock.close()
        self.dir.remove(os.path.basename(self.path))
        self.dir.remove_if_empty()
        self.dir.close()


def open_listener(path):
    """A Listener on the wake-up directory `path`, or None (logged once): the runner then
    polls."""
    try:
        return Listener(path)
    except OSError as exc:
        report_once("for runners", path, exc)
        return None


def sweep(path):
    """Remove the sockets of processes that are gone; returns the live ones (names)."""
    try:
        with RuntimeDir.open(path) as opened:
            return _send(opened, None)
    except OSError:
        return []


_sender = [None, None]     # (pid, socket): one unbound socket per process, made after a fork


def _sending_socket():
    pid = os.getpid()
    if _sender[0] != pid:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        _sender[:] = [pid, sock]
    return _sender[1]


def _opened(path, what):
    """The runtime directory `path` opened, or None: missing (nobody listens), or refused or
    unusable (logged once)."""
    try:
        return RuntimeDir.open(path)
    except FileNotFoundError:
        _listings.pop(path, None)
        return None
    except OSError as exc:
        report_once(what, path, exc)
        return None


def notify(path, count=None, queue=None):
    """Wake the idle runners of this host listening in `path` for `count` runs in `queue`
    (None: unknown): one datagram to the hub; without a hub one byte to each runner's
    socket, and when the hub lags, to `count` of them. Never raises."""
    opened = _opened(path, "for senders")
    if opened is None:
        return
    with opened:
        try:
            _sending_socket().sendto(news(count, queue).encode("utf-8"), opened.address(HUB))
            return
        except (BlockingIOError, InterruptedError):
            limit = count                 # the hub lags: wake a few runners directly
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                limit = count
            elif exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
                limit = None              # no hub: every runner
            else:
                report_once("for senders", path, exc)
                limit = None
        try:
            _send(opened, b"!", limit)
        except OSError as exc:
            report_once("for senders", path, exc)


def notify_local(path):
    """Wake every idle runner or waiter listening in `path` (no hub); never raises. With
    nobody listening (no directory), one access() and no exception: the cost of every run's
    end when nobody waits."""
    if not os.access(path, os.F_OK):
        _listings.pop(path, None)
        return
    opened = _opened(path, "for senders")
    if opened is None:
        return
    with opened:
        try:
            _send(opened, b"!")
        except OSError as exc:
            report_once("for senders", path, exc)


_listings = {}     # directory's path -> (its identity and mtime, the sockets in it)


def _targets(opened, fresh=False):
    """The sockets in the directory `opened`, listed again only when it changed."""
    identity, mtime = opened.identity()
    kept = _listings.get(opened.path)
    if not fresh and kept is not None and kept[0] == identity:
        return kept[1]
    targets = [name for name in opened.sockets() if name != HUB]
    if time.time() - mtime > SETTLED:
        _listings[opened.path] = (identity, targets)
    else:
        _listings.pop(opened.path, None)
    return targets


def _send(opened, payload, limit=None):
    """`payload` to the sockets of the directory `opened` (None: connect only, to find
    the dead); a dead one is removed. Returns the names of the live ones."""
    targets = _targets(opened, fresh=payload is None)
    if limit is not None and limit < len(targets):
        targets = random.sample(targets, limit)
    live = []
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if payload is None \
        else _sending_socket()
    sender.setblocking(False)
    try:
        for target in targets:
            try:
                if payload is None:
                    sender.connect(opened.address(target))
                    sender.close()
                    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sender.setblocking(False)
                else:
                    sender.sendto(payload, opened.address(target))
                live.append(target)
            except (ConnectionRefusedError, FileNotFoundError):
                opened.remove(target)     # its runner is gone
                _listings.pop(opened.path, None)
            except OSError as exc:
                # EAGAIN/ENOBUFS: its queue is full, it has wake-ups pending already.
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                    report_once("for senders", opened.path, exc)  # another user's socket
                live.append(target)
    finally:
        if payload is None:
            sender.close()
    if not live and limit is None:
        opened.remove_if_empty()
    return live


def listen_url(database, standalone=False):
    """The URL to LISTEN on for `database` (a ``[database]`` section), or "" when nobody
    does: not PostgreSQL; behind a pooler without ``listen_url`` (LISTEN does not survive
    transaction pooling); a standalone runner behind a pooler (it would hold a direct
    connection of its own: it polls)."""
    if not database.url.lower().startswith(("postgresql", "postgres:")):
        return ""
    if database.pooler:
        return "" if standalone else database.listen_url
    return database.listen_url or database.url


# PostgreSQL's NOTIFY of news, as a statement (or a CTE's body); its parameters: notify_params.
NOTIFY_SQL = "SELECT pg_notify(%s, %s)"


def notify_params(count=None, queue=None, sender=""):
    return (CHANNEL, news(count, queue, sender))


def notify_in_transaction(db, count=None, queue=None, sender=""):
    """PostgreSQL: NOTIFY the hubs and standalone runners of every host, delivered when the
    transaction commits."""
    db.execute_sql(NOTIFY_SQL, notify_params(count, queue, sender))


class PostgresListener:
    """A standalone runner's LISTEN on its own connection; a NOTIFY makes its socket
    readable. One that arrives while the runner waits for another query's result is read
    with that result and kept by psycopg (3.2.4 and later), so the socket stays quiet: the
    runner drains before it blocks as well as after. It LISTENs before it looks for work,
    so a task committed after the look is never missed."""

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
        """Whether any notification had arrived (all are consumed)."""
        heard = False
        for _ in self.connection.notifies(timeout=0):
            heard = True
        return heard
