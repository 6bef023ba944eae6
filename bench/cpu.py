"""CPU seconds a system under test used: all its processes, and on PostgreSQL the server
backends that served it. Read from /proc (through psutil), user + system time.

Processes: the trees rooted at the processes the bench started (an overseer and its
runners; Huey's consumer and its workers; each Procrastinate worker), each process counted
with the children it has reaped (a runner that exited and was waited for by its overseer
is in the overseer's children times), sampled while they are still alive, before the bench
stops them: their start-up is included, their shutdown is not.

Server: the backends of the system's database, not the bench's own connections
(application_name common.APPLICATION_NAME), sampled at every tick of the wait; each
backend counts with its last sample, so the last moments of a backend that disconnects
between two ticks are missed (the systems keep their connections open while they work).
The server's shared processes (WAL writer, checkpointer, autovacuum) are not counted.
"""
import psutil

from bench import common
from bench.waits import Sampler


def tree(pid):
    """The process `pid` and its descendants; [] when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def tree_seconds(pids):
    """user + system seconds of the processes `pids`, their descendants, and the children
    each of them has reaped; a zombie still counts."""
    total = 0.0
    for pid in pids:
        for process in tree(pid):
            try:
                t = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


class ServerCpu:
    """CPU of the PostgreSQL backends serving one database, sampled by `sample()`."""

    SQL = ("SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name <> %s "
           "AND backend_type = 'client backend'")

    def __init__(self, url):
        self.database = url.rsplit("/", 1)[1]
        self.conn = common.connect(common.PG_ADMIN_URL, autocommit=True)
        self.last = {}          # (pid, create_time) → user + system seconds at the last sample

    def sample(self):
        cur = self.conn.cursor()
        cur.execute(self.SQL, (self.database, common.APPLICATION_NAME))
        for (pid,) in cur.fetchall():
            try:
                process = psutil.Process(pid)
                t = process.cpu_times()
                self.last[(pid, process.create_time())] = t.user + t.system
            except psutil.NoSuchProcess:
                pass

    def seconds(self):
        return sum(self.last.values())

    def close(self):
        self.conn.close()


class Meter:
    """CPU of one measurement: `tick()` while waiting, `finish()` once the work is done
    (before the processes are stopped) → {"cpu_s": ..., "db_cpu_s": ... or None,
    "waits": bench/waits.py's Sampler, stopped}. `children`: which processes are the
    workers whose time it samples (bench/waits.py's worker_pids)."""

    def __init__(self, url, pids, children=True):
        self.pids = list(pids)
        self.server = ServerCpu(url) if common.backend_of(url) == "postgresql" else None
        self.waits = Sampler(url, self.pids, children)

    def tick(self):
        if self.server is not None:
            self.server.sample()

    def finish(self):
        cpu = tree_seconds(self.pids)
        self.waits.stop()
        if self.server is None:
            return {"cpu_s": round(cpu, 3), "db_cpu_s": None, "waits": self.waits}
        self.server.sample()
        return {"cpu_s": round(cpu, 3), "db_cpu_s": round(self.server.seconds(), 3),
                "waits": self.waits}

    def close(self):
        self.waits.stop()
        if self.server is not None:
            self.server.close()


def per_1000(usage, jobs):
    """{"cpu_s_per_1000": ..., "db_cpu_s_per_1000": ...} from a Meter's finish()."""
    return {key + "_per_1000": None if usage[key] is None else round(1000 * usage[key] / jobs, 3)
            for key in ("cpu_s", "db_cpu_s")}
