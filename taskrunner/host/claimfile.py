"""The runs a batched runner holds claimed and has not started, kept where whoever finds the
runner dead on its host can read them: those runs go back to the queue unstarted and
uncounted, instead of each counting as a crashed run of its task.

A batched runner (``[runner] batch`` > 1, batches.py) claims up to `batch` runs at once. In
the database all of them are ``running`` under it, and which of them it has started is not
stored there: that would cost the write per run a batch saves. So the runner keeps the list
in a file of its own, ``<wake-up directory>-claimed/<runner id>`` (owner-only, 0600, like the
wake-up sockets; the directory is checked like theirs, runtimedir.py), mapped into its memory: it publishes the runs it holds, in the order it
will start them, when it claims or re-reads them, and counts one more started before it
starts each (one word written: nothing on the hot path but a store to memory). A death (kill -9 included) leaves the file as it
was, so the runs listed never started. Whoever marks the runner dead on this host (its
overseer reaping it, a sweep finding its PID gone) reads the file (`unstarted`) and removes
it (`discard`); the runner removes it when it exits by itself, having given its claimed runs
back. A runner that dies on another host, or that could not write the file, has every run it
held counted as crashed, as before; so does a run it was about to start when it died.

Layout: native 8-byte words — the count, how many of them were started, then the run ids.
Publishing sets the count to 0, the started to 0, writes the ids, then the count: a runner
killed half-way leaves a count of 0 or the whole list, never ids it did not hold. Runs listed but no longer ``running`` under the runner (its
batch was checked, or ended) are left alone by the reader (liveness.py), whose update is
conditional like every end of a run (rule 4).

The runner creates its file afresh (``O_EXCL``, after removing a stale one of a trusted
user): a file someone else made beforehand is never written, and no other user can shrink
the file mapped in the runner's memory (a store into a mapping past the end of its file is
SIGBUS). The reader and `discard` take only a regular file of a trusted user, never through
a symlink.
"""
import logging
import mmap
import os
import stat
import struct

from .runtimedir import RuntimeDir

log = logging.getLogger("taskrunner.runner")
_reported = set()

SUFFIX = "-claimed"
_WORD = struct.Struct("Q")
_COUNT, _STARTED, _IDS = 0, 1, 2       # word offsets: count, how many started, the ids


def directory(wakeup_directory):
    """The claimed-runs directory of a database, beside its wake-up directory."""
    return wakeup_directory + SUFFIX


def _path(wakeup_directory, runner_id):
    return os.path.join(directory(wakeup_directory), str(int(runner_id)))


# The most a reader takes: the count, the started count and `[runner] batch`'s maximum ids.
_LARGEST = _WORD.size * (_IDS + 1000)


class ClaimFile:
    """The writer's side, in the runner's process: `publish` the runs it holds, in the order
    it starts them; `starting` before it starts the next; `remove` when it exits by itself. Without a file (a directory it may not write)
    it does nothing, and the runner's death counts as before."""

    def __init__(self, wakeup_directory, runner_id, size):
        self.path = _path(wakeup_directory, runner_id)
        name = os.path.basename(self.path)
        self._dir = self._fd = self._map = None
        self._size = size
        self._started = 0
        parent = os.path.dirname(self.path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            for attempt in range(3):
                opened = RuntimeDir.open(parent, create=True)
                try:
                    opened.remove(name, stat.S_ISREG)   # an earlier runner's with this id
                    fd = os.open(name, flags, 0o600, dir_fd=opened.fd)
                    break
                except FileNotFoundError:
                    opened.close()
                    if attempt == 2:      # removed under us by a last file leaving, thrice
                        raise
                except OSError:
                    opened.close()
                    raise
        except OSError as exc:
            return _unavailable(parent, exc)
        try:
            # Zeros written, not a hole: a store into a mapped hole on a full disk is SIGBUS.
            os.pwrite(fd, bytes(_WORD.size * (_IDS + size)), 0)
            self._map = mmap.mmap(fd, _WORD.size * (_IDS + size), mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            os.unlink(name, dir_fd=opened.fd)
            opened.close()
            return _unavailable(parent, exc)
        self._fd, self._dir = fd, opened

    def publish(self, run_ids):
        """The runs held now, claimed and not started (at most `size` of them), in the order
        they will start."""
        if self._map is None:
            return
        ids = list(run_ids)[:self._size]
        _WORD.pack_into(self._map, _COUNT, 0)
        self._started = 0
        _WORD.pack_into(self._map, _STARTED * _WORD.size, 0)
        struct.pack_into("%dQ" % len(ids), self._map, _IDS * _WORD.size, *ids)
        _WORD.pack_into(self._map, _COUNT, len(ids))

    def starting(self):
        """The next of the runs published starts now."""
        if self._map is None:
            return
        self._started += 1
        _WORD.pack_into(self._map, _STARTED * _WORD.size, self._started)

    def remove(self):
        """The runner exits by itself: nothing it held is left unstarted."""
        if self._map is None:
            return
        self._map.close()
        os.close(self._fd)
        self._map = self._fd = None
        self._dir.remove(os.path.basename(self.path), stat.S_ISREG)
        self._dir.remove_if_empty()
        self._dir.close()


def _unavailable(parent, exc):
    if parent not in _reported:
        _reported.add(parent)
        log.warning("no file for the runs a batched runner holds (%s: %s): if it dies, each "
                    "run it held counts as crashed", parent, exc.strerror or exc)


def unstarted(wakeup_directory, runner_id):
    """The runs the dead runner `runner_id` of this host held claimed and had not started:
    a set of run ids, empty without a file (or with one that cannot be read, or that is
    not a trusted user's regular file)."""
    name = str(int(runner_id))
    try:
        with RuntimeDir.open(directory(wakeup_directory)) as opened:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                         | getattr(os, "O_NOFOLLOW", 0), dir_fd=opened.fd)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or not opened.trusted(info.st_uid):
                    return set()
                data = os.pread(fd, _LARGEST, 0)
            finally:
                os.close(fd)
    except OSError:
        return set()
    if len(data) < _IDS * _WORD.size:
        return set()
    count, started = struct.unpack_from("2Q", data, 0)
    if (_IDS + count) * _WORD.size > len(data) or started > count:
        return set()
    return set(struct.unpack_from("%dQ" % count, data, _IDS * _WORD.size)[started:])


def discard(wakeup_directory, runner_id):
    """Remove the file of a runner marked dead (its runs were dealt with), and the
    directory when that was its last file."""
    try:
        with RuntimeDir.open(directory(wakeup_directory)) as opened:
            if opened.remove(str(int(runner_id)), stat.S_ISREG):
                opened.remove_if_empty()
    except OSError:
        pass
