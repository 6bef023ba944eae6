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

A process that must not wait long (the overseer's loop, a stopping runner) takes it with a
`timeout`: it polls for the lock until then, and a lock still held is `HostLockBusy`, an
error the caller handles as a busy database.

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
    caller, the database was busy (not an error worth a retry of its own: the caller's
    next turn tries again)."""


class HostLock:
    """A context manager: the host lock of the SQLite file `database` (a path), held by one
    thread of one process at a time. Re-entered by its holding thread, it does nothing more
    (the outermost exit releases it). Safe across fork: a child opens its own file. With
    `timeout` (seconds), entering waits at most that long, then raises HostLockBusy."""

    def __init__(self, database, timeout=None):
        self.path = database + SUFFIX
        self.timeout = timeout
        self._pid = None
        self._fd = None
        self._threads = None
        self._holder = None
        self._depth = 0
        _instances.add(self)

    def _forget(self):
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._pid = self._fd = None

    def _open(self):
        """Per process: the lock file's descriptor (None without one) and a thread lock."""
        self._pid = os.getpid()
        self._threads = threading.Lock()
        self._holder, self._depth = None, 0
        self._fd = None
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
        if self.timeout is None:
            self._threads.acquire()
        elif not self._threads.acquire(timeout=self.timeout):
            raise self._busy()
        try:
            if self._fd is not None:
                self._lock_file()
        except BaseException:
            self._threads.release()
            raise
        self._holder, self._depth = me, 1
        return self

    def _lock_file(self):
        if self.timeout is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            return
        # flock has no timeout: poll (a short, rare wait; a blocking flock could wait for a
        # writer that itself waits out SQLite's busy timeout behind another program).
        deadline, pause = time.monotonic() + self.timeout, POLL
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise self._busy() from None
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)

    def _busy(self):
        return HostLockBusy("the host lock %s was held by another writer for %gs"
                            % (self.path, self.timeout))

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return
        self._holder = None
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()
