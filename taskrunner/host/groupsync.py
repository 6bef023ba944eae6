"""Group commit for SQLite's durable mode: this host's runners share the fsync of the WAL.

With ``synchronous=FULL`` SQLite fsyncs the WAL inside every commit, while it holds its write
lock (and the runner the host lock): the host's runners queue behind each other's fsyncs, one
fsync per commit. A runner's store instead commits with ``synchronous=NORMAL`` (no sync in
the commit) and then, before it acts on the commit — starts the run it claimed, goes on to
the next job, tells its caller — waits until the WAL is durable up to that commit
(`GroupSync.commit_done`). One ``fdatasync`` of the WAL covers every commit written before it
began, whoever wrote it, so a runner that finds a sync covering its commit has nothing to do
(PostgreSQL's WAL flush works this way).

Shared state, per database on this host: ``<database>-sync`` (owner-only, 0600, like the
host lock's file, never removed; used only when it is this user's own, checked on what was
opened — a file or link another user planted is never written or mapped, and each runner
then syncs alone), three counters mapped into every process: `written`
(commits counted), `synced` (of those, the ones known durable) and `flushes` (fdatasyncs
done). A committer takes the next `written` number as its ticket right after COMMIT
returned; then, under the flush lock (a ``flock`` of the file, held during the fdatasync), if
`synced` covers its ticket it is done; else it reads `written` — every commit counted so far
has its frames in the WAL file already — fdatasyncs the WAL and publishes that number as
`synced`. Runners whose commits landed during someone's fdatasync wait on the flush lock and
share the next one. `written` is read and changed under a record lock of the file's first
byte (held for a few memory accesses, so a committer never waits for a sync to take its
ticket); `synced` and `flushes` are changed and read under the flush lock. The kernel
releases both locks of a process that dies (kill -9 included), so no one waits on a dead
holder; a deleted file loses no durability: a new one only starts the counting afresh.

Why this is as durable as FULL (SQLite's documentation of ``PRAGMA synchronous``: in WAL
mode, FULL is NORMAL plus one sync of the WAL after each commit; here that sync comes after
the commit and is shared, but always before anyone acts on the commit):
- The fdatasync is of the WAL's inode, not of a descriptor's writes: it flushes every frame
  any process wrote into the file before it began (and the file's size), so it covers every
  ticket counted before it read `written`.
- Frames carry cumulative checksums and the salts of their WAL generation: recovery replays
  frames up to the first invalid one and keeps the transactions whose commit frame lies in
  that prefix. Later frames written but not yet synced when the power fails are cut off;
  nothing before a synced commit can be, since it is all on disk.
- The WAL is overwritten from its start only after a checkpoint copied all of it into the
  database: in NORMAL SQLite syncs the WAL before a checkpoint, the database file after it,
  and the WAL header when the WAL starts again (so an old frame can never pass for a new one).
  A commit checkpointed before its sync is therefore durable in the database file.
- The WAL file is deleted only by the last connection's close, after a full checkpoint;
  while the committer's connection is open (it just committed) the file stays. The WAL is
  opened again for each new connection of the store (the file may be a new one); when
  there is no WAL file at all, the database file is synced instead.
- SQLite pads a synced commit to a sector boundary only without power-safe overwrite, which
  SQLite assumes on Unix by default: there FULL writes the same bytes as NORMAL.
What differs: between COMMIT and the sync (a fraction of a millisecond) another connection
may read the commit before it is durable. A power failure in that window loses an outcome
nobody acted on but that reader; the run is then taken over as a crashed one and runs
again, as it would had the power failed during the run.

Only a runner's store syncs this way (`Store.use_group_sync`): the writes of other processes
(an application's `add_task`, the CLI) keep FULL, since their callers may commit outside the
store's write paths.
"""
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import weakref

import peewee

from .runtimedir import open_own_file

log = logging.getLogger("taskrunner.db")

SUFFIX = "-sync"
# written, synced, flushes: native 8-byte words at aligned offsets.
_COUNTERS = struct.Struct("QQQ")
_WORD = struct.Struct("Q")
# Their byte offsets in the mapping (read and written in place: commit_done runs per job).
_WRITTEN, _SYNCED, _FLUSHES = 0, _WORD.size, 2 * _WORD.size
_reported = set()
_instances = weakref.WeakSet()


def _after_fork_in_child():
    """A forked child closes its copies: a flock belongs to the open file, which the copy
    would keep locked after its parent died holding it."""
    for sync in list(_instances):
        sync._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SyncFailed(peewee.OperationalError):
    """The fdatasync that makes a commit durable failed (an I/O error, a file system turned
    read-only or full): whether that commit survives a power failure is unknown, as after a
    connection lost during COMMIT, and the caller treats it so (outage.is_unwritable by the
    errno: the commit is tried again, idempotently, once the disk takes writes)."""


class GroupSync:
    """The group sync of the SQLite database file `database` (a path). Per process, opened
    on first use and again after a fork; the threads of a process take turns."""

    def __init__(self, database):
        self.path = database + SUFFIX
        self.wal_path = database + "-wal"
        self.database = database
        self._thread = threading.local()
        self._threads = threading.Lock()
        self._opened = False
        self._fd = self._wal = self._map = self._wal_of = None
        _instances.add(self)

    def _forget(self):
        for fd in (self._fd, self._wal):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._threads = threading.Lock()
        self._opened = False
        self._fd = self._wal = self._map = self._wal_of = None

    def _open(self):
        self._opened = True
        try:
            # Only a file of this user's: one another user planted could be read, rewritten
            # (`synced` raised: commits acknowledged unsynced) or shrunk under the mapping.
            fd = open_own_file(self.path, os.O_RDWR)
        except OSError as exc:
            return self._unavailable(exc)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            try:
                if os.fstat(fd).st_size < _COUNTERS.size:
                    # Zeros written, not a hole: a store into a mapped hole on a full disk
                    # would kill the process (SIGBUS). Under the lock: never over counts.
                    os.pwrite(fd, bytes(_COUNTERS.size), 0)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
            self._map = mmap.mmap(fd, _COUNTERS.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            return self._unavailable(exc)
        self._fd = fd

    def _unavailable(self, exc):
        if self.path not in _reported:
            _reported.add(self.path)
            log.warning("no shared sync file for SQLite runners (%s: %s): each runner syncs "
                        "the WAL after each of its commits alone", self.path,
                        exc.strerror or exc)

    @property
    def available(self):
        """Whether this process has the shared file open (use_group_sync requires it)."""
        if not self._opened:
            self._open()
        return self._fd is not None

    @property
    def last_ticket(self):
        """This thread's latest commit, as counted in `written` (0: none yet): durable once
        `synced` is at least as large."""
        return getattr(self._thread, "ticket", 0)

    def counters(self):
        """(written, synced, flushes) as they are now."""
        if not self.available:
            return (0, 0, 0)
        with self._threads:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
            try:
                return _COUNTERS.unpack_from(self._map)
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def commit_done(self, connection):
        """Right after `connection` (this process's, open) committed: return once the WAL is
        durable up to that commit (waiting for, or doing, the fdatasync that covers it). An
        fdatasync that fails raises: the commit's durability is unknown, as FULL's failing
        COMMIT would say. Without the shared file (in a forked child that cannot open it),
        it syncs alone."""
        with self._threads:
            if connection is not self._wal_of:
                self._reopen_wal(connection)
            if not self.available:
                self._fdatasync()
                return
            fd, shared, word = self._fd, self._map, _WORD
            # `written` changes under the counters' lock; `synced` and `flushes` under the
            # flush lock, whose holder alone reads them without the other.
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            try:
                ticket = word.unpack_from(shared, _WRITTEN)[0] + 1
                word.pack_into(shared, _WRITTEN, ticket)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
            self._thread.ticket = ticket
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if word.unpack_from(shared, _SYNCED)[0] >= ticket:
                    return
                fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
                try:
                    target = word.unpack_from(shared, _WRITTEN)[0]
                finally:
                    fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
                self._fdatasync()
                word.pack_into(shared, _SYNCED, target)
                word.pack_into(shared, _FLUSHES, word.unpack_from(shared, _FLUSHES)[0] + 1)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _reopen_wal(self, connection):
        """A connection opened since the WAL was: the file may be another one (the last
        connection's close deletes the WAL; while one is open it stays, so checking once per
        connection is enough — an fstat before each fdatasync costs as much as a third of
        it here)."""
        if self._wal is not None:
            os.close(self._wal)
            self._wal = None
        self._wal_of = connection
        try:
            self._wal = os.open(self.wal_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            pass

    def _fdatasync(self):
        """Sync the WAL file; without one, the database file, where the checkpoint that
        deleted the WAL put everything."""
        if self._wal is None:
            self._reopen_wal(self._wal_of)
        if self._wal is None:
            try:
                fd = os.open(self.database, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise SyncFailed(exc, "syncing %s failed: %s" % (self.database,
                                                                  exc.strerror or exc)) from exc
            return
        try:
            try:
                os.fdatasync(self._wal)
            except OSError as exc:
                if exc.errno != errno.EINVAL:     # EINVAL: a file system without fdatasync
                    raise
                os.fsync(self._wal)
        except OSError as exc:
            raise SyncFailed(exc, "syncing %s failed: %s" % (self.wal_path,
                                                              exc.strerror or exc)) from exc
