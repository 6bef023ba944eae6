"""The host lock: this host's writers of one SQLite database take turns on a lock file
beside it before they ask SQLite for its write lock.

SQLite lets one writer in at a time, and a writer that finds the database busy waits in
SQLite's busy handler, which sleeps in steps of milliseconds and polls again: the lock may
stay free for most of a step while every other runner sleeps (a lock storm), and whoever
happens to poll at the right moment gets it again and again (an uneven split). A blocking
``flock`` on a file wakes a waiter the moment the holder lets go. Every write transaction
of a store (`Store.write`) takes the host lock around BEGIN IMMEDIATE ... COMMIT, so SQLite's
lock is always free when it is asked for; SQLite's busy timeout stays as the backstop for
writers that do not take the host lock (other programs, single statements outside a
transaction).

No wait on it is unbounded: a store's lock has a `timeout` (SQLite's ``busy_timeout``, or a
bounded store's patience: the overseer's loop, a stopping runner), and a lock still held
then is `HostLockBusy`, an error the caller handles as a busy database — as SQLite's own
lock would be. So a writer frozen while it holds the lock (SIGSTOP, a debugger) stops this
host's other writers no longer than another program holding SQLite's lock would. flock has
no timeout: a process's waits go to a thread of its own (`_Waiter`), blocked in flock on a
descriptor of its own, which the waiting caller takes over the moment the kernel grants it
(the holder's hand-over stays immediate); a caller that gave up leaves that thread to
release what it gets later, and the next caller to wait on it.

The lock file is ``<database>-hostlock``, created owner-only (0600) and never removed (a
lock file removed while someone waits on it would let two writers in at once). It is used
only when it is this user's own, checked on what was opened (runtimedir.open_own_file): a
file another user planted there first, which they could lock for ever, or a symbolic link,
is never used. When it cannot be opened or is refused (a read-only directory, a file of
another user), the store works without it, as before, and says so once. The kernel releases
a dead process's lock.
"""
import fcntl
import logging
import os
import threading
import time
import weakref

import peewee

from .runtimedir import everyone_may_write, open_own_file

log = logging.getLogger("taskrunner.db")

SUFFIX = "-hostlock"
POLL = 0.005        # seconds between two tries of a lock taken with a timeout (it grows)
_reported = set()
_open_directories = set()     # databases whose directory everyone may write (said once)
_instances = weakref.WeakSet()


def _after_fork_in_child():
    """A forked child closes its copy of each lock file's descriptor: a flock belongs to the
    open file, which the copy would keep locked after its parent died holding it."""
    for lock in list(_instances):
        lock._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class HostLockBusy(peewee.OperationalError):
    """The host lock stayed held for the whole timeout of a `HostLock` that has one: to the
    caller, the database was busy — transient, as SQLite's "database is locked" is (an
    unbounded store tries its write again; a bounded one leaves it to its next turn): its
    `transient` says so to store.db, which classifies errors."""

    transient = True


class HostLock:
    """A context manager: the host lock of the SQLite file `database` (a path), held by one
    thread of one process at a time. Re-entered by its holding thread, it does nothing more
    (the outermost exit releases it). Safe across fork: a child opens its own file. With
    `timeout` (seconds), entering waits at most that long, then raises HostLockBusy;
    without, it waits as long as the lock is held."""

    def __init__(self, database, timeout=None):
        self.path = database + SUFFIX
        self.timeout = timeout
        self._pid = None
        self._fd = None
        self._waiter = None
        self._threads = None
        self._holder = None
        self._held_by = None        # the descriptor whose lock the holder has
        self._depth = 0
        _instances.add(self)

    def _forget(self):
        for fd in (self._fd, self._waiter.fd if self._waiter else None):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._pid = self._fd = self._waiter = None

    def _open(self):
        """Per process: the lock file's descriptor (None without one) and a thread lock."""
        self._pid = os.getpid()
        self._threads = threading.Lock()
        self._holder, self._held_by, self._depth = None, None, 0
        self._fd = self._waiter = None
        if self.path not in _open_directories \
                and everyone_may_write(os.path.dirname(self.path)):
            _open_directories.add(self.path)
            log.warning("the directory of the SQLite database %s is writable by other users: "
                        "they could replace the database, or create its -wal and -shm files "
                        "before SQLite does; keep it in a directory only its users may write",
                        self.path[:-len(SUFFIX)])
        try:
            self._fd = open_own_file(self.path, os.O_RDONLY)
        except OSError as exc:
            if self.path not in _reported:
                _reported.add(self.path)
                log.warning("no host lock for SQLite writers (%s: %s): this host's writers "
                            "wait in SQLite's busy handler instead", self.path,
                            exc.strerror or exc)

    @property
    def available(self):
        """Whether this process has the lock file open."""
        if self._pid != os.getpid():
            self._open()
        return self._fd is not None

    def __enter__(self):
        if self._pid != os.getpid():
            self._open()
        me = threading.get_ident()
        if self._holder == me:
            self._depth += 1
            return self
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if deadline is None:
            self._threads.acquire()
        elif not self._threads.acquire(timeout=self.timeout):
            raise self._busy()
        try:
            if self._fd is not None:
                self._held_by = self._lock_file(deadline)
        except BaseException:
            self._threads.release()
            raise
        self._holder, self._depth = me, 1
        return self

    def _lock_file(self, deadline):
        """Take the file's lock by `deadline` (None: however long); returns the descriptor
        that holds it."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return self._fd
        except BlockingIOError:
            if deadline is None:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                return self._fd
        waiter = self._waiter or self._new_waiter()
        if waiter is None:
            self._poll(deadline)
            return self._fd
        if not waiter.acquire(deadline):
            raise self._busy()
        return waiter.fd

    def _new_waiter(self):
        """A `_Waiter` on a second descriptor of the same lock file (None if it cannot be
        had: the file was replaced since, or cannot be opened)."""
        try:
            fd = open_own_file(self.path, os.O_RDONLY)
        except OSError:
            return None
        mine, again = os.fstat(self._fd), os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (again.st_dev, again.st_ino):
            os.close(fd)
            return None
        self._waiter = _Waiter(fd)
        return self._waiter

    def _poll(self, deadline):
        """Without a waiter: try again and again until `deadline` (no hand-over at once)."""
        pause = POLL
        while True:
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise self._busy() from None
            pause = min(pause * 2, 0.05)

    def _busy(self):
        return HostLockBusy("the host lock %s was held by another writer for %gs"
                            % (self.path, self.timeout))

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return
        held_by, self._holder, self._held_by = self._held_by, None, None
        try:
            if held_by is None:
                pass
            elif self._waiter is not None and held_by == self._waiter.fd:
                self._waiter.release()
            else:
                fcntl.flock(held_by, fcntl.LOCK_UN)
        finally:
            self._threads.release()


class _Waiter:
    """A process's bounded waits for one lock file: a daemon thread blocked in flock on a
    descriptor of its own (a second open file of the lock file: its lock is apart from the
    first descriptor's), while the caller waits for the grant with its deadline. Granted in
    time, the lock is the caller's until `release`; granted after the caller gave up, the
    thread lets it go at once, unless the next caller already waits for it. At most one
    flock is pending per process, however many callers gave up on it. The thread and the
    caller hand over through plain locks (a Condition's wake-up costs more, on every wait of
    a busy host)."""

    def __init__(self, fd):
        self.fd = fd
        self.mutex = threading.Lock()     # guards the three fields below
        self.pending = False      # the thread is asked to take the lock, or blocked taking it
        self.wanted = False       # a caller waits for it
        self.failed = None        # the OSError its flock raised, for the caller
        self.requested = threading.Lock()   # held; released to ask the thread for the lock
        self.granted = threading.Lock()     # held; released when the lock is the caller's
        self.requested.acquire()
        self.granted.acquire()
        self.thread = None

    def acquire(self, deadline):
        """True once the lock is held for the caller; False at `deadline`."""
        with self.mutex:
            self.wanted = True
            if not self.pending:
                self.pending = True
                self.requested.release()
                if self.thread is None:
                    self.thread = threading.Thread(target=self._take, daemon=True,
                                                   name="taskrunner-hostlock")
                    self.thread.start()
        got = self.granted.acquire(timeout=max(0.0, deadline - time.monotonic()))
        with self.mutex:
            self.wanted = False
            if not got:                       # unless granted in this very instant
                got = self.granted.acquire(blocking=False)
            failed, self.failed = self.failed, None
        if failed is not None:
            raise failed
        return got

    def release(self):
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _take(self):
        while True:
            self.requested.acquire()
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                failed = None
            except OSError as exc:
                failed = exc
            with self.mutex:
                self.pending = False
                if self.wanted:
                    self.failed = failed
                    self.granted.release()
                elif failed is None:            # its caller gave up, and nobody waits
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
