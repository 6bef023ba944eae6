"""The wake-up hub: one per host and database, kept by the overseer.

It binds ``hub`` in the database's wake-up directory (wakeup.py). Runners tell it when they
go idle (``i QUEUES``) and when they find work by themselves (``b``); whoever makes runs
claimable sends it the news (``w COUNT QUEUE``), and the hub wakes that many of its idle
runners that serve the queue, longest idle first, forgetting them until they say they are
idle again. News of unknown size (``*``) wakes every idle runner; news of an unknown queue,
or of one no idle runner serves, wakes `COUNT` runners of each group of queues served.

On PostgreSQL the hub also LISTENs, on a direct connection of its own (``listen_url``), for
the news of other hosts (and of transactions that added tasks with ``connection=``); news
from its own origin already came as a datagram. After a failure it connects again with a
backoff, and the outage is logged once. Everything here is best-effort: an error costs the
runners at most ``poll_interval``.

The overseer runs the hub in a process of its own (`HubProcess`), so that waking a runner
never waits for the overseer's database work.

The hub's directory is checked like every runtime directory (runtimedir.py), and the hub
takes a datagram only from a user that directory trusts (its own, root, or in a shared
group directory a member of the group), by the sender's credentials the kernel attaches:
if the directory's modes are widened later, nobody else can pose as an idle runner (and
take its wake-ups) or flood the hub with news.
"""
import errno
import logging
import os
import select
import signal
import socket
import struct
import time

from . import wakeup
from .runtimedir import RuntimeDir
from ..masking import redact

log = logging.getLogger("taskrunner.hub")

MAX_BACKOFF = 30.0
CONNECT_TIMEOUT = 5
APPLICATION_NAME = "taskrunner-hub"    # how its connection shows in pg_stat_activity
_CREDENTIALS = struct.Struct("iII")    # struct ucred: pid, uid, gid


class Hub:
    """The hub of the wake-up directory `directory`. `configured`: the queues with a
    ``[queues.NAME]`` table (a runner serving ``default`` serves every other queue);
    `listen_url`: where to LISTEN ("" for nowhere)."""

    def __init__(self, directory, configured=(), listen_url=""):
        self.directory = directory
        self.path = os.path.join(directory, wakeup.HUB)
        self.origin = wakeup.origin(directory)
        self.configured = frozenset(configured)
        self.listen_url = listen_url
        self.sock = None
        self.dir = None           # the directory (RuntimeDir) while the hub is bound
        self.inode = None
        self.idle = {}            # runner socket's name -> queues it serves (None: all), FIFO
        self.connection = None
        self.next_connect = 0.0
        self.backoff = 1.0
        self.lost = False

    # -- the socket -------------------------------------------------------------------------

    def take(self):
        """Bind the hub socket unless a live hub holds it (another overseer of this host and
        database); True when this one is the hub. Called again every check_interval: a hub
        whose overseer died is taken over, and one that lost its name gives up."""
        if self.sock is not None:
            held = self.dir.entry(wakeup.HUB)
            if held is not None and held.st_ino == self.inode:
                return True
            log.info("wake-up hub %s lost (taken over or removed): binding again", self.path)
            self._close_socket()
        temporary = ".hub.%d" % os.getpid()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        opened = None
        try:
            opened = RuntimeDir.open(self.directory, create=True)
            if answers(opened.address(wakeup.HUB)):
                sock.close()
                opened.close()
                return False
            opened.remove(temporary)
            # Before the name is visible: a datagram queued without credentials is dropped.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(opened.address(temporary))
            opened.chmod(temporary, 0o600 if opened.group is None else 0o660)
            opened.rename(temporary, wakeup.HUB)   # atomically replaces a dead hub's socket
            self.inode = os.stat(wakeup.HUB, dir_fd=opened.fd, follow_symlinks=False).st_ino
        except OSError as exc:
            sock.close()
            if opened is not None:
                opened.remove(temporary)
                opened.close()
            wakeup.report_once("hub", self.directory, exc)
            return False
        sock.setblocking(False)
        self.sock, self.dir, self.idle = sock, opened, {}
        # Runners that went idle while there was no hub have not told this one: wake them
        # all once, and they tell it as they go idle again.
        wakeup.notify_local(self.directory)
        log.debug("wake-up hub bound at %s", self.path)
        return True

    def _close_socket(self):
        if self.sock is not None:
            self.sock.close()
            self.dir.close()
            self.sock = self.dir = None
            self.idle = {}

    def close(self):
        """Leave: remove the hub's name (if still ours) and the LISTEN connection."""
        if self.sock is not None:
            held = self.dir.entry(wakeup.HUB)
            if held is not None and held.st_ino == self.inode:
                self.dir.remove(wakeup.HUB)
            self.dir.remove_if_empty()         # unless a runner still listens there
            self._close_socket()
        self._drop_connection()

    # -- waiting ----------------------------------------------------------------------------

    def sources(self):
        """What `sleep` selects on besides the hub process's signal pipe."""
        self._ensure_listening()
        return [s for s in (self.sock, self.connection) if s is not None]

    def sleep(self, fd, timeout):
        """Serve wake-ups for up to `timeout` seconds; True as soon as `fd` (the hub
        process's signal pipe) is readable."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = select.select(self.sources() + [fd], [], [], left)[0]
            if fd in ready:
                return True
            self.serve(ready)
        return False

    def serve(self, ready):
        """Handle what `ready` (a subset of `sources()`) has to say."""
        if self.sock is not None and self.sock in ready:
            self._serve_datagrams()
        if self.connection is not None and self.connection in ready:
            self._serve_notifications()

    def _serve_datagrams(self):
        while True:
            try:
                data, ancillary, _, sender = self.sock.recvmsg(256, socket.CMSG_SPACE(
                    _CREDENTIALS.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                wakeup.report_once("hub", self.directory, exc)
                return
            if not self._trusted(ancillary):
                continue
            # A runner's socket by its name in the hub's directory: the path it bound may be
            # one of its own descriptors (runtimedir.address).
            name = os.path.basename(sender) if sender else ""
            text = data.decode("utf-8", "replace")
            if text.startswith("i ") and name:
                self.idle.pop(name, None)            # to the end: longest idle goes first
                queues = text[2:]
                self.idle[name] = None if queues == wakeup.ANY else frozenset(
                    queues.split(","))
            elif text == "b" and name:
                self.idle.pop(name, None)
            else:
                count, queue, _ = wakeup.parse_news(text)
                self.wake(count, queue)

    def _trusted(self, ancillary):
        """Whether the sender's credentials (the kernel's, SO_PASSCRED) name a user the
        hub's directory trusts."""
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                    and len(data) >= _CREDENTIALS.size:
                uid = _CREDENTIALS.unpack_from(data)[1]
                if self.dir.trusted(uid):
                    return True
                log.debug("wake-up hub ignored a datagram of uid %d", uid)
                return False
        return False

    def wake(self, count=None, queue=None):
        """Wake `count` idle runners serving `queue` (see the module's docstring)."""
        if not self.idle or count == 0:
            return
        if count is None:
            chosen = list(self.idle)
        else:
            chosen = [name for name, serving in self.idle.items()
                      if queue is not None and self._serves(serving, queue)][:count]
            if not chosen:
                groups = {}
                for name, serving in self.idle.items():
                    groups.setdefault(serving, []).append(name)
                chosen = [name for names in groups.values() for name in names[:count]]
        for name in chosen:
            del self.idle[name]
            try:
                self.sock.sendto(b"!", self.dir.address(name))
            except (BlockingIOError, InterruptedError):
                pass                                 # it has a wake-up pending already
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOBUFS):
                    wakeup.report_once("hub", self.directory, exc)
        log.debug("woke %d runner(s) for %s run(s) in %s", len(chosen),
                  wakeup.ANY if count is None else count, queue or wakeup.ANY)

    def _serves(self, serving, queue):
        return serving is None or queue in serving \
            or ("default" in serving and queue not in self.configured)

    # -- LISTEN -----------------------------------------------------------------------------

    def _ensure_listening(self):
        if not self.listen_url or self.sock is None or self.connection is not None \
                or time.monotonic() < self.next_connect:
            return
        import psycopg
        try:
            connection = psycopg.connect(self.listen_url, autocommit=True,
                                         connect_timeout=CONNECT_TIMEOUT,
                                         application_name=APPLICATION_NAME)
            connection.execute("LISTEN %s" % wakeup.CHANNEL)
        except (psycopg.Error, OSError) as exc:
            self._lost(exc)
            return
        self.connection, self.backoff = connection, 1.0
        if self.lost:
            self.lost = False
            log.info("wake-up hub listening again")

    def _serve_notifications(self):
        import psycopg
        try:
            for notification in self.connection.notifies(timeout=0):
                count, queue, sender = wakeup.parse_news(notification.payload)
                if sender != self.origin:
                    self.wake(count, queue)
        except (psycopg.Error, OSError) as exc:
            self._drop_connection()
            self._lost(exc)

    def _lost(self, exc):
        if not self.lost:
            self.lost = True
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("wake-up hub cannot LISTEN (%s): runners of other hosts' tasks poll "
                        "until it can", redact(text, self.listen_url))
        self.next_connect = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)

    def _drop_connection(self):
        """Close the LISTEN connection; `_ensure_listening` opens it again."""
        if self.connection is not None:
            try:
                self.connection.close()
            except Exception:
                log.debug("closing the LISTEN connection failed", exc_info=True)
            self.connection = None


class HubProcess:
    """The hub in a process of its own (``tr-hub``), forked and kept by the overseer, so a
    wake-up never waits behind the overseer's database work (a check of 200 runners takes
    tens of milliseconds) and its LISTEN connection never meets a fork: the hub process
    forks nothing, and opens that connection itself. It lives in its own process group
    (a group signal reaches the overseer, which stops it after its runners) and dies with
    the overseer. The overseer's side: `due`, `started`, `exited`, `restart`, `stop`; the
    hub's side: `serve`."""

    RESTART_DELAY = 1.0         # after an exit, the next start waits this long
    STOP_WAIT = 2.0             # then KILL

    def __init__(self, directory, configured=(), listen_url=""):
        self.hub = Hub(directory, configured, listen_url)
        self.pid = None
        self.next_start = 0.0

    def due(self, now):
        """Whether the overseer should fork the hub now."""
        return self.pid is None and now >= self.next_start

    def started(self, pid):
        self.pid = pid

    def exited(self, pid, code, now, stopping=False):
        """The overseer reaped `pid`: True when it was the hub (started again later)."""
        if pid != self.pid:
            return False
        self.pid = None
        self.next_start = now + self.RESTART_DELAY
        if code != 0 and not stopping:
            log.warning("wake-up hub pid %d exited with %s; starting it again", pid,
                        "signal %d" % -code if code < 0 else "exit code %d" % code)
        return True

    def restart(self, configured):
        """After a reload: the queues configured may have changed; the next start is now."""
        self.stop()
        self.hub.configured = frozenset(configured)
        self.next_start = 0.0

    def stop(self):
        """TERM the hub and wait for it (KILL after STOP_WAIT); its name is removed."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + self.STOP_WAIT
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                return
            if time.monotonic() >= deadline:
                log.warning("wake-up hub pid %d did not stop: killing it", pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)

    def serve(self, check_interval, parent):
        """In the forked hub process: serve until a signal, or until the overseer `parent`
        (a pid) is gone — the kernel's death signal may have been set too late, after it
        died; every `check_interval` bind the hub socket again if it is free (a hub of
        another overseer of this host and database may hold it). Returns the exit code."""
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, lambda signum, frame: None)
        try:
            while os.getppid() == parent:
                self.hub.take()
                if self.hub.sleep(wake_r, check_interval):
                    return 0
            log.info("wake-up hub exiting: overseer %d is gone", parent)
            return 0
        finally:
            self.hub.close()


def answers(path):
    """Whether a live process holds the socket `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()

