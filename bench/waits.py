"""Where a system's workers spend their time during a drain: a sampler thread that, every
0.1 s, looks at the main thread of each worker process (taskrunner's runners — the
overseer's children but its hub and maintainer; Huey's consumer's worker processes; each
Procrastinate, PgQueuer or DBOS worker) and puts it in one class, from /proc/PID/task/PID/
`stat` (the state), `syscall` (the system call it is blocked in and its arguments) and the
descriptor that call names (/proc/PID/fd/N):

- running: state R, or in no system call (between calls, on a CPU or runnable);
- busy_sleep: a relative CLOCK_REALTIME sleep (nanosleep, or clock_nanosleep with clock 0 and
  no flags) — what SQLite's busy handler does (usleep) while another connection holds the
  write lock; Python's time.sleep sleeps on CLOCK_MONOTONIC to an absolute time and is
  `sleep` instead;
- host_lock: blocked in flock/fcntl on taskrunner's host lock file (<database>-hostlock):
  in line for SQLite's writer;
- sync_lock: blocked in flock/fcntl on taskrunner's group sync file (<database>-sync):
  waiting for another runner's fdatasync of the WAL;
- file_lock: blocked in flock/fcntl on any other file;
- io: state D (waiting for the disk) or in fsync/fdatasync;
- db_wait: waiting on a socket — poll/ppoll/epoll (psycopg, asyncpg) or a read/recvfrom of a
  socket (PyMySQL): the database server's answer;
- idle: select/pselect6 — taskrunner's runner waiting for a wake-up when it found no work;
- sleep: another sleep (a peer's own polling pause);
- other: anything else (a futex: waiting for the GIL or another thread; an exec; ...).

writer_wait (SQLite) is busy_sleep + host_lock + sync_lock + file_lock: asleep on the
writer. Whether the writer was free meanwhile comes from /proc/locks, read at the same
tick: SQLite in WAL mode holds its write lock as a POSIX lock of byte 120 of <database>-shm,
and the host and sync locks are flocks of their files. A writer wait is "while free" when
what it waits for was held by no one at that tick: for busy_sleep SQLite's write lock, for a
lock file that file's lock. The samples of one tick are read one after the other within
about a millisecond, not at one instant: a lock released in between shows as free.

On PostgreSQL the sampler also reads pg_stat_activity's wait_event_type/wait_event of the
system's backends (those of its database, not the bench's own connections) at each tick:
"Client:ClientRead" is a backend waiting for its client, "IO:WALSync" a commit's WAL flush,
"LWLock:WALWrite" one waiting for another's flush, "running" no wait event, "idle" a session
out of any transaction (its wait event is ClientRead too).

The shares are of all samples of all workers of one drain. One thread, 10 Hz, a handful of
small /proc reads per worker and one /proc/locks read per tick.
"""
import collections
import os
import platform
import threading
import time

import psutil

from bench import common

INTERVAL = 0.1
CLASSES = ("running", "busy_sleep", "host_lock", "sync_lock", "file_lock", "io", "db_wait",
           "idle", "sleep", "other")
WRITER = ("busy_sleep", "host_lock", "sync_lock", "file_lock")
NOT_WORKERS = ("tr-hub", "tr-maintainer")
SQLITE_WRITE_BYTE = 120      # WAL_WRITE_LOCK's byte in the -shm file (sqlite3 os_unix.c)

_SYSCALLS = {
    "x86_64": {"nanosleep": 35, "clock_nanosleep": 230, "flock": 73, "fcntl": 72, "fsync": 74,
               "fdatasync": 75, "poll": 7, "ppoll": 271, "epoll_wait": 232,
               "epoll_pwait": 281, "epoll_pwait2": 441, "read": 0, "recvfrom": 45,
               "recvmsg": 47, "select": 23, "pselect6": 270},
    "aarch64": {"nanosleep": 101, "clock_nanosleep": 115, "flock": 32, "fcntl": 25,
                "fsync": 82, "fdatasync": 83, "ppoll": 73, "epoll_pwait": 22,
                "epoll_pwait2": 441, "read": 63, "recvfrom": 207, "recvmsg": 212,
                "pselect6": 72},
}
_NR = {nr: name for name, nr in _SYSCALLS.get(platform.machine(), {}).items()}
_LOCK_WAIT_CMDS = (7, 38)    # fcntl F_SETLKW, F_OFD_SETLKW


def _read(path):
    with open(path) as fh:
        return fh.read()


def _fd_target(pid, fd):
    try:
        return os.readlink("/proc/%d/fd/%d" % (pid, fd))
    except OSError:
        return ""


def classify(pid):
    """(class, (the locked file's path, FLOCK or POSIX) or None) of the main thread of process `pid`; None when
    it is gone or cannot be read."""
    base = "/proc/%d/task/%d/" % (pid, pid)
    try:
        stat = _read(base + "stat")
        call = _read(base + "syscall").split()
    except OSError:
        return None
    state = stat[stat.rindex(")") + 2]
    if state == "R" or not call or call[0] == "running":
        return "running", None
    if state == "D":
        return "io", None
    try:
        name = _NR.get(int(call[0]))
        args = [int(a, 16) for a in call[1:7]]
    except ValueError:
        return "other", None
    if name == "nanosleep" or (name == "clock_nanosleep" and args[:2] == [0, 0]):
        return "busy_sleep", None
    if name == "clock_nanosleep":
        return "sleep", None
    if name == "flock" or (name == "fcntl" and args[1] in _LOCK_WAIT_CMDS):
        path = _fd_target(pid, args[0])
        kind = ("host_lock" if path.endswith("-hostlock") else
                "sync_lock" if path.endswith("-sync") else "file_lock")
        return kind, (path, "FLOCK" if name == "flock" else "POSIX")
    if name in ("fsync", "fdatasync"):
        return "io", None
    if name in ("poll", "ppoll", "epoll_wait", "epoll_pwait", "epoll_pwait2"):
        return "db_wait", None
    if name in ("read", "recvfrom", "recvmsg"):
        return ("db_wait" if _fd_target(pid, args[0]).startswith("socket:") else "other"), None
    if name in ("select", "pselect6"):
        return "idle", None
    return "other", None


def held_locks():
    """{(device "MM:mm", inode): [(kind, type, start, end)]} of the locks granted now
    (/proc/locks; the waiters' "->" lines left out)."""
    held = collections.defaultdict(list)
    try:
        lines = _read("/proc/locks").splitlines()
    except OSError:
        return held
    for line in lines:
        f = line.split()
        if len(f) < 8 or f[1] == "->":
            continue
        major, minor, inode = f[5].split(":")
        held[(int(major, 16), int(minor, 16), int(inode))].append((f[1], f[3], f[6], f[7]))
    return held


def _file_key(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def sqlite_writer_held(locks, shm_key):
    """Whether SQLite's WAL write lock (a POSIX write lock of byte 120 of -shm) is held."""
    for kind, type_, start, end in locks.get(shm_key, ()):
        if kind in ("POSIX", "OFDLCK") and type_ == "WRITE" and int(start) <= SQLITE_WRITE_BYTE \
                and (end == "EOF" or int(end) >= SQLITE_WRITE_BYTE):
            return True
    return False


def worker_pids(roots):
    """The worker processes under the started processes: each root's children but
    taskrunner's hub and maintainer, or the root itself when it has none."""
    pids = []
    for root in roots:
        try:
            children = [c.pid for c in psutil.Process(root).children()
                        if c.name() not in NOT_WORKERS]
        except psutil.NoSuchProcess:
            continue
        pids.extend(children or [root])
    return pids


class Sampler:
    """A thread sampling the workers under `roots` every INTERVAL until `stop()`, which
    returns the summary (see `summary`). `url` names the database: SQLite's file for its
    write lock, PostgreSQL's database for its backends' wait events."""

    PG_SQL = ("SELECT CASE WHEN state = 'idle' THEN 'idle' ELSE "
              "coalesce(wait_event_type || ':' || wait_event, 'running') END "
              "FROM pg_stat_activity WHERE datname = %s AND application_name <> %s "
              "AND backend_type = 'client backend'")

    def __init__(self, url, roots):
        self.roots = list(roots)
        self.backend = common.backend_of(url)
        self.path = url[len("sqlite:///"):] if self.backend == "sqlite" else None
        self.database = url.rsplit("/", 1)[1] if self.backend == "postgresql" else None
        self.counts = collections.Counter()
        self.waits = 0             # writer-wait samples whose lock state was known
        self.waits_free = 0        # ... of which nothing they wait for was held
        self.server = collections.Counter()
        self.ticks = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-waits", daemon=True)
        self._thread.start()

    def _loop(self):
        conn = None
        if self.database is not None:
            try:
                conn = common.connect(common.PG_ADMIN_URL, autocommit=True)
            except Exception:     # a sampler must never stop the measurement
                conn = None
        pids, refreshed = [], 0.0
        try:
            while not self._stopping.wait(INTERVAL):
                now = time.monotonic()
                if now - refreshed >= 1.0 or not pids:
                    pids, refreshed = worker_pids(self.roots), now
                self._tick(pids)
                if conn is not None:
                    self._sample_server(conn)
        finally:
            if conn is not None:
                conn.close()

    def _tick(self, pids):
        self.ticks += 1
        samples = [s for s in map(classify, pids) if s is not None]
        self.counts.update(kind for kind, _ in samples)
        waiting = [(kind, path) for kind, path in samples if kind in WRITER]
        if not waiting or self.path is None:
            return
        locks = held_locks()
        writer = sqlite_writer_held(locks, _file_key(self.path + "-shm"))
        for kind, lock in waiting:
            self.waits += 1
            if kind == "busy_sleep":
                free = not writer
            else:
                # A flock waits for a flock only, a record lock for a record lock (this
                # counts any record lock of the file: the group sync's is of byte 0).
                path, want = lock
                key = _file_key(path)
                free = key is not None and not any(
                    k == want or (want == "POSIX" and k == "OFDLCK") for k, *_ in locks.get(key, ()))
            self.waits_free += free

    def _sample_server(self, conn):
        try:
            cur = conn.cursor()
            cur.execute(self.PG_SQL, (self.database, common.APPLICATION_NAME))
            self.server.update(row[0] for row in cur.fetchall())
        except Exception:
            pass

    def stop(self):
        if not self._stopping.is_set():
            self._stopping.set()
            self._thread.join(10)
        return self.summary()

    def summary(self):
        """{"samples": n, "shares": {class: fraction}, "writer_wait": fraction,
        "writer_wait_while_free": fraction of the writer waits or None, "server": {wait event:
        fraction} or None (PostgreSQL: its backends' samples, "idle" for an idle session)}."""
        total = sum(self.counts.values())
        shares = {k: round(self.counts[k] / total, 3) if total else None for k in CLASSES}
        result = {"samples": total, "ticks": self.ticks, "shares": shares,
                  "writer_wait": round(sum(self.counts[k] for k in WRITER) / total, 3)
                  if total else None,
                  "writer_wait_while_free": round(self.waits_free / self.waits, 3)
                  if self.waits else None,
                  "server": None}
        if self.database is not None:
            n = sum(self.server.values())
            result["server"] = {k: round(v / n, 3) for k, v in self.server.most_common()} \
                if n else {}
        return result


def median_summary(summaries):
    """The median of each share over the rounds of one cell (None where unknown)."""
    summaries = [s for s in summaries if s and s.get("samples")]
    if not summaries:
        return None

    def med(values):
        values = [v for v in values if v is not None]
        return round(common.median(values), 3) if values else None
    server_keys = sorted({k for s in summaries for k in (s.get("server") or {})})
    return {"samples": sum(s["samples"] for s in summaries),
            "shares": {k: med([s["shares"][k] for s in summaries]) for k in CLASSES},
            "writer_wait": med([s["writer_wait"] for s in summaries]),
            "writer_wait_while_free": med([s["writer_wait_while_free"] for s in summaries]),
            "server": {k: med([(s.get("server") or {}).get(k, 0.0) for s in summaries])
                       for k in server_keys} or None}
