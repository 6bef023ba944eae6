"""What the database and the hosts show while a fleet runs (bench/fleet.py): the server's
statements, connections and CPU; the runs running per host, sampled and exactly; the holder
of the maintenance lease; the memory of the server's backends."""
import collections
import threading
import time

from bench import common

# The role of the bench's own connections, left out of what the fleet is measured to cost.
MONITOR = "monitor"
MIB = 1024 * 1024
# Lease tables of the maintenance leader, by the names they could have: the lookup is
# tolerant of their absence (main has none) and of their columns.
LEASE_TABLE_HINTS = ("lease", "leader")


class Counters:
    """Snapshots of the server: statements (pg_stat_statements calls of every role but the
    bench's, in the fleet's database; COMMITs count), the hosts' connections, CPU seconds;
    `since(earlier)` gives the rates and the statements that made them."""

    def __init__(self, fleet):
        self.fleet, self.conn = fleet, fleet.monitor()

    def snapshot(self):
        cur = self.conn.cursor()
        cur.execute("SELECT s.queryid, s.calls, s.query FROM pg_stat_statements s "
                    "JOIN pg_roles r ON r.oid = s.userid JOIN pg_database d ON d.oid = s.dbid "
                    "WHERE r.rolname <> %s AND d.datname = %s",
                    (MONITOR, self.fleet.cluster.database))
        calls = {row[0]: (row[1], row[2]) for row in cur.fetchall()}
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                    "AND usename <> %s", (self.fleet.cluster.database, MONITOR))
        connections = cur.fetchone()[0]
        return {"at": time.monotonic(), "calls": calls,
                "connections": connections, "cpu": self.fleet.cluster.cpu_seconds()}

    @staticmethod
    def since(before, after, top=8):
        seconds = after["at"] - before["at"]
        by_query = []
        for queryid, (calls, text) in after["calls"].items():
            done = calls - before["calls"].get(queryid, (0, ""))[0]
            if done:
                by_query.append((done, " ".join(text.split())[:160]))
        by_query.sort(reverse=True)
        statements = sum(n for n, _ in by_query)
        return {"seconds": round(seconds, 2), "statements": statements,
                "statements_per_s": round(statements / seconds, 1),
                "db_cpu_s": round(after["cpu"] - before["cpu"], 2),
                "db_cpu_share": round((after["cpu"] - before["cpu"]) / seconds, 3),
                "connections": after["connections"],
                "top_statements": [{"per_s": round(n / seconds, 2), "query": q}
                                   for n, q in by_query[:top]]}

    def close(self):
        self.conn.close()


class ConcurrencySampler(threading.Thread):
    """Every `interval`: running runs grouped by the runner's host. Keeps the most seen per
    host and in all."""

    def __init__(self, fleet, interval=0.2):
        super().__init__(daemon=True, name="concurrency")
        self.fleet, self.interval = fleet, interval
        self.stopping = threading.Event()
        self.most = collections.Counter()
        self.most_total = self.samples = 0
        self.error = None

    def run(self):
        try:
            with self.fleet.monitor() as conn:
                cur = conn.cursor()
                while not self.stopping.wait(self.interval):
                    cur.execute("SELECT r.host, count(*) FROM task_runs x JOIN task_runners r "
                                "ON r.id = x.runner_id WHERE x.status = 'running' "
                                "GROUP BY r.host")
                    rows = cur.fetchall()
                    for host, n in rows:
                        self.most[host] = max(self.most[host], n)
                    self.most_total = max(self.most_total, sum(n for _, n in rows))
                    self.samples += 1
        except Exception as exc:  # reported with the scenario's result
            self.error = "%s: %s" % (type(exc).__name__, exc)

    def stop(self):
        self.stopping.set()
        self.join(10)


def most_overlapping(url):
    """{host: the most runs of the host whose [started_on, finished_on] overlap}, from
    every ended run: the per-host limit checked exactly, where sampling could miss a
    moment. A runner's next run starts when its previous one ends (the same statement),
    so an end counts before a start at the same instant."""
    events = collections.defaultdict(list)
    for host, started, finished in common.query(
            url, "SELECT r.host, x.started_on, x.finished_on FROM task_runs x JOIN task_runners r "
            "ON r.id = x.runner_id WHERE x.started_on IS NOT NULL AND x.finished_on IS NOT NULL"):
        events[host] += [(started, 1), (finished, -1)]
    most = {}
    for host, changes in events.items():
        running = peak = 0
        for _, change in sorted(changes):
            running += change
            peak = max(peak, running)
        most[host] = peak
    return dict(sorted(most.items()))


def find_leader(fleet):
    """(lease table, number of the host holding the maintenance lease). (None, None) when
    the schema has no lease table (main before the lease work); (table, None) when no one
    holds it. Tolerant of the table's columns: the holder is a column about the holder or
    host naming a host ("host3", "host3/..."), or a runner id whose row is on one; a row
    with no holder (released) holds nothing; a row named "maintenance" comes first."""
    tables = [r[0] for r in common.query(
        fleet.url, "SELECT table_name FROM information_schema.tables WHERE table_schema = "
        "'public'") if any(hint in r[0] for hint in LEASE_TABLE_HINTS)]
    if not tables:
        return None, None
    hosts = {h.hostname: n for n, h in fleet.hosts.items()}
    for table in tables:
        with common.connect(fleet.url, autocommit=True) as conn:
            cur = conn.cursor()
            cur.execute('SELECT * FROM "%s"' % table)    # a name from the catalogue
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, row)) for row in cur.fetchall()]
        rows.sort(key=lambda row: row.get("name") != "maintenance")
        for row in rows:
            if any(row[k] is None for k in names if k.startswith("holder")):
                continue
            for key, value in row.items():
                if not any(word in key for word in ("host", "holder", "runner", "owner")):
                    continue
                if isinstance(value, str) and value.split("/")[0] in hosts:
                    return table, hosts[value.split("/")[0]]
                if isinstance(value, int) and not isinstance(value, bool):
                    found = common.query(fleet.url, "SELECT host FROM task_runners WHERE id = ?",
                                         (value,))
                    if found and found[0][0].split("/")[0] in hosts:
                        return table, hosts[found[0][0].split("/")[0]]
    return tables[0], None


def backend_uss(fleet):
    """Mean USS (MiB) of the cluster's client backends."""
    import psutil
    sizes = []
    for child in fleet.cluster.postmaster().children():
        try:
            if "hosts" in " ".join(child.cmdline()):
                sizes.append(child.memory_full_info().uss)
        except psutil.Error:
            pass
    return round(sum(sizes) / len(sizes) / MIB, 2) if sizes else None
