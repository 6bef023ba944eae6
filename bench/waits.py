"""Where a system's workers spend their time during a drain: a sampler thread that, every
0.1 s, looks at the main thread of each worker process (taskrunner's runners — the
overseer's children but its hub and maintainer; Huey's consumer's worker processes, not its
scheduler process; each Procrastinate, PgQueuer or DBOS worker) and puts it in one class,
from /proc/PID/task/PID/ `stat` (the state), `syscall` (the system call it is blocked in and
its arguments) and the descriptor that call names (/proc/PID/fd/N):

- running: state R, or in no system call (between calls, on a CPU or runnable; the summary's
  on_cpu and cpu_wait split the workers' time between the two, from the main thread's
  /proc/PID/task/PID/schedstat at the window's first and last tick);
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
  socket (PyMySQL): the database server's answer (on SQLite, something else: a peer's own
  pipes);
- idle: select/pselect6 — taskrunner's runner waiting for a wake-up when it found no work;
- sleep: another sleep (a peer's own polling pause);
- thread_wait: a futex — waiting for the GIL, a lock or another thread (DBOS's main thread
  waits so for the thread pool that runs its workflows: its shares say little); but a
  taskrunner runner's main thread in a futex while another of its threads is blocked on the
  host lock or group sync file is in host_lock or sync_lock: a contended host lock is taken
  by a thread of its own (host/hostlock.py), the main thread waiting for it;
- other: anything else.

writer_wait (SQLite) is busy_sleep + host_lock + sync_lock + file_lock: asleep on the
writer. Whether the writer was free meanwhile comes from /proc/locks, read in the same
tick: SQLite in WAL mode holds its write lock as a POSIX lock of byte 120 of <database>-shm,
and the host and sync locks are flocks of their files. A writer wait is "while free" when
what it waits for was held by no one, neither in /proc/locks read just before the workers'
states nor in the one read just after (a few milliseconds apart): for busy_sleep SQLite's
write lock, for a lock file that file's lock. A lock taken and let go again between the two
reads still shows as free; a waiter the kernel has woken is runnable (running), not asleep.

On PostgreSQL the sampler also reads pg_stat_activity's wait_event_type/wait_event of the
system's backends (those of its database, not the bench's own connections) at each tick:
"Client:ClientRead" is a backend waiting for its client, "IO:WALSync" a commit's WAL flush,
"LWLock:WALWrite" one waiting for another's flush, "running" no wait event; of the backends
in a transaction or a statement (sessions idle out of any transaction are left out).

The shares are of all samples of all workers from the drain's first finish to its last (the
workers' start-up and the bench's noticing the end left out; all samples when that window
holds none). The cost: one thread, 10 Hz, a few small /proc reads per worker per tick, two
of /proc/locks when a worker waits on SQLite's writer, one query on PostgreSQL.
"""
import collections
import os
import platform
import threading
import time

from bench import common

INTERVAL = 0.1
CLASSES = ("running", "busy_sleep", "host_lock", "sync_lock", "file_lock", "io", "db_wait",
           "idle", "sleep", "thread_wait", "other")
WRITER = ("busy_sleep", "host_lock", "sync_lock", "file_lock")
NOT_WORKERS = ("tr-hub", "tr-maintainer")
SQLITE_WRITE_BYTE = 120      # WAL_WRITE_LOCK's byte in the -shm file (sqlite3 os_unix.c)

_SYSCALLS = {
    "x86_64": {"nanosleep": 35, "clock_nanosleep": 230, "flock": 73, "fcntl": 72, "fsync": 74,
               "fdatasync": 75, "poll": 7, "ppoll": 271, "epoll_wait": 232,
               "epoll_pwait": 281, "epoll_pwait2": 441, "read": 0, "recvfrom": 45,
               "recvmsg": 47, "select": 23, "pselect6": 270, "futex": 202},
    "aarch64": {"nanosleep": 101, "clock_nanosleep": 115, "flock": 32, "fcntl": 25,
                "fsync": 82, "fdatasync": 83, "ppoll": 73, "epoll_pwait": 22,
                "epoll_pwait2": 441, "read": 63, "recvfrom": 207, "recvmsg": 212,
                "pselect6": 72, "futex": 98},
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
    """(class, (the locked file's path, FLOCK or POSIX) or None) of the main thread of
    process `pid`; None when it is gone or cannot be read."""
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
    if name == "futex":
        return _lock_of_a_thread(pid) or ("thread_wait", None)
    return "other", None


def _lock_of_a_thread(pid):
    """The lock wait (class and lock, as `classify`'s) of another thread of process `pid`
    blocked on taskrunner's host lock or group sync file, or None. A runner takes a
    contended host lock in a thread of its own (host/hostlock.py: a flock has no deadline,
    the thread's wait has one), its main thread waiting in a futex for the grant: without
    this, its wait in line for the writer would count as a thread wait."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for tid in tids:
        if int(tid) == pid:
            continue
        try:
            call = _read("/proc/%d/task/%s/syscall" % (pid, tid)).split()
            name = _NR.get(int(call[0]))
            args = [int(a, 16) for a in call[1:7]]
        except (OSError, ValueError, IndexError):
            continue
        if name == "flock" or (name == "fcntl" and args[1] in _LOCK_WAIT_CMDS):
            path = _fd_target(pid, args[0])
            if path.endswith(("-hostlock", "-sync")):
                return (("host_lock" if path.endswith("-hostlock") else "sync_lock"),
                        (path, "FLOCK" if name == "flock" else "POSIX"))
    return None


def held_locks():
    """{(device major, minor, inode): [(kind, type, start, end)]} of the locks granted now
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


def _holds(locks, key, want):
    """Whether a lock that blocks a `want` ("FLOCK" or "POSIX") lock of the file `key` is
    held: a flock waits for a flock only, a record lock for a record lock (any record lock
    of the file counts: the group sync's is of byte 0, the one it waits for)."""
    return any(kind == want or (want == "POSIX" and kind == "OFDLCK")
               for kind, *_ in locks.get(key, ()))


def _started(pid):
    """The process's start time (clock ticks since boot), or None when it is gone."""
    try:
        stat = _read("/proc/%d/stat" % pid)
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def worker_pids(roots, children=True):
    """The worker processes among the started processes `roots`: with `children` True,
    each root's children but taskrunner's hub and maintainer (from /proc/ROOT/task/*/children:
    no scan of every process); "but the first", the same less the first one started (Huey's
    consumer starts its scheduler process before its workers); False: the roots themselves."""
    if not children:
        return list(roots)
    if children == "but the first":
        found = [(t, pid) for pid, t in ((pid, _started(pid)) for pid in worker_pids(roots))
                 if t is not None]
        return [pid for _, pid in sorted(found)[1:]]
    pids = []
    for root in roots:
        try:
            tasks = os.listdir("/proc/%d/task" % root)
        except OSError:
            continue
        for tid in tasks:
            try:
                found = _read("/proc/%d/task/%s/children" % (root, tid)).split()
            except OSError:
                continue
            for pid in map(int, found):
                try:
                    if _read("/proc/%d/comm" % pid).strip() not in NOT_WORKERS:
                        pids.append(pid)
                except OSError:
                    pass
    return pids


class Sampler:
    """A thread sampling the worker processes among or under `roots` (`children`: see
    `worker_pids`) every INTERVAL until `stop()`; `summary(window)` gives the shares.
    `url` names the database: SQLite's file for its write lock, PostgreSQL's database for
    its backends' wait events."""

    # Sessions idle out of any transaction (a pool's spare connections, a hub's listener)
    # are left out: the shares are of the backends serving a transaction or a statement.
    PG_SQL = ("SELECT coalesce(wait_event_type || ':' || wait_event, 'running') "
              "FROM pg_stat_activity WHERE datname = %s AND application_name <> %s "
              "AND backend_type = 'client backend' AND state <> 'idle'")

    def __init__(self, url, roots, children=True):
        self.roots, self.children = list(roots), children
        self.backend = common.backend_of(url)
        self.path = url[len("sqlite:///"):] if self.backend == "sqlite" else None
        self.database = url.rsplit("/", 1)[1] if self.backend == "postgresql" else None
        # One entry per tick: (epoch seconds, [worker class], [writer wait while free:
        # bool], [server wait event]).
        self.timeline = []
        self.schedstat = []       # per tick: (epoch seconds, {pid: (ns on CPU, ns runnable)})
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-waits", daemon=True)
        self._thread.start()

    @property
    def ticks(self):
        return len(self.timeline)

    def _loop(self):
        conn = None
        if self.database is not None:
            try:
                conn = common.connect(common.PG_ADMIN_URL, autocommit=True)
            except Exception:     # a sampler must never stop the measurement
                conn = None
        try:
            while not self._stopping.wait(INTERVAL):
                now = time.time()
                kinds, free = self._sample(worker_pids(self.roots, self.children))
                server = self._sample_server(conn) if conn is not None else []
                self.timeline.append((now, kinds, free, server))
        finally:
            if conn is not None:
                conn.close()

    def _sample(self, pids):
        before = held_locks() if self.path is not None else None
        samples = [s for s in map(classify, pids) if s is not None]
        kinds = [kind for kind, _ in samples]
        self._clocks(pids)
        waiting = [(kind, lock) for kind, lock in samples if kind in WRITER]
        if not waiting or before is None:
            return kinds, []
        # Free: held by no one both just before and just after the workers were read.
        after = held_locks()
        shm = _file_key(self.path + "-shm")
        free = []
        for kind, lock in waiting:
            if kind == "busy_sleep":
                free.append(not any(sqlite_writer_held(locks, shm) for locks in (before, after)))
                continue
            path, want = lock
            key = _file_key(path)
            free.append(key is not None and not any(_holds(locks, key, want)
                                                    for locks in (before, after)))
        return kinds, free

    def _clocks(self, pids):
        """Each worker's main thread's cumulative ns on a CPU and waiting for one
        (/proc/PID/task/PID/schedstat), kept per tick in `self.schedstat`."""
        now, clocks = time.time(), {}
        for pid in pids:
            try:
                on_cpu, runnable = _read("/proc/%d/task/%d/schedstat" % (pid, pid)).split()[:2]
            except (OSError, ValueError):
                continue
            clocks[pid] = (int(on_cpu), int(runnable))
        self.schedstat.append((now, clocks))

    def _cpu_shares(self, window):
        """(on a CPU, waiting for a CPU): fractions of the workers' wall time in `window`
        (or all of it), from the first and last schedstat of each worker in it; None, None
        when no worker was seen at two ticks."""
        first, last = {}, {}
        for t, clocks in self.schedstat:
            if window is not None and not window[0] <= t <= window[1]:
                continue
            for pid, c in clocks.items():
                first.setdefault(pid, (t, c))
                last[pid] = (t, c)
        wall = sum(last[p][0] - first[p][0] for p in last) * 1e9
        if wall <= 0:
            # A window of one tick (a very short drain): the whole sampling instead.
            return self._cpu_shares(None) if window is not None else (None, None)
        return tuple(round(sum(last[p][1][i] - first[p][1][i] for p in last) / wall, 3)
                     for i in (0, 1))

    def _sample_server(self, conn):
        try:
            cur = conn.cursor()
            cur.execute(self.PG_SQL, (self.database, common.APPLICATION_NAME))
            return [row[0] for row in cur.fetchall()]
        except Exception:
            return []

    def stop(self):
        """Stop sampling (idempotent)."""
        if not self._stopping.is_set():
            self._stopping.set()
            self._thread.join(10)

    def summary(self, window=None):
        """{"samples": n, "ticks": n, "shares": {class: fraction}, "writer_wait": fraction,
        "writer_wait_while_free": fraction of the writer waits or None, "on_cpu" and
        "cpu_wait": fractions of the workers' time on a CPU and runnable waiting for one
        (schedstat: "running" is both), "server": {wait
        event: fraction} or None (PostgreSQL: its backends' samples, those in a transaction or a
        statement)}, of the ticks within `window` (epoch seconds (from, to): the drain,
        first to last finish) when it holds any, else of all."""
        ticks = self.timeline
        if window is not None:
            inside = [t for t in ticks if window[0] <= t[0] <= window[1]]
            ticks = inside or ticks
            window = window if inside else None
        counts, free, server = collections.Counter(), [], collections.Counter()
        for _, kinds, frees, events in ticks:
            counts.update(kinds)
            free.extend(frees)
            server.update(events)
        total = sum(counts.values())
        result = {"samples": total, "ticks": len(ticks),
                  "shares": {k: round(counts[k] / total, 3) if total else None for k in CLASSES},
                  "writer_wait": round(sum(counts[k] for k in WRITER) / total, 3)
                  if total else None,
                  "writer_wait_while_free": round(sum(free) / len(free), 3) if free else None,
                  "server": None}
        result["on_cpu"], result["cpu_wait"] = self._cpu_shares(window)
        if self.database is not None:
            n = sum(server.values())
            result["server"] = {k: round(v / n, 3) for k, v in server.most_common()}
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
            "on_cpu": med([s.get("on_cpu") for s in summaries]),
            "cpu_wait": med([s.get("cpu_wait") for s in summaries]),
            "server": {k: med([(s.get("server") or {}).get(k, 0.0) for s in summaries])
                       for k in server_keys} or None}
