"""Batched acknowledgements: taskrunner with ``[runner] batch`` = 1 (the default), 16 and 64
against Huey (SQLite) and Procrastinate (PostgreSQL, tables ANALYZEd after the enqueue, its
best case), on N no-op tasks queued beforehand, W workers, log level warning on every side.

The compared runs alternate within each round (1, 16, 64, peer, then again), so a noisy
machine slows every side alike; the ratios are medians of the per-round ratios.

    python -m bench.batch --db sqlite,postgresql --n 5000 --workers 2 --rounds 3 \\
        --json bench/results/2026-11-23-batch.json
"""
import argparse
import sys

from bench import common
from bench.common import median, ratio
from bench.systems import Huey, Job, Procrastinate, Taskrunner, measure


def batched(batch, flush_interval=0.005):
    """`taskrunner overseer` with [runner] batch = `batch` (and flush_interval)."""
    return Taskrunner("batch=%d" % batch, {"runner": {"batch": batch,
                                                      "flush_interval": flush_interval}})


class AnalyzedProcrastinate(Procrastinate):
    """Procrastinate with its jobs table ANALYZEd after the enqueue (as autovacuum would
    soon do): its best case."""

    def prepare(self, backend, job):
        url = super().prepare(backend, job)
        conn = common.connect(url, autocommit=True)
        try:
            conn.cursor().execute("ANALYZE")
        finally:
            conn.close()
        return url


# Huey's consumer logs at warning (-q) for a Job at log level warning, like taskrunner's side.
PEER = {"sqlite": Huey(), "postgresql": AnalyzedProcrastinate()}


def run_round(backend, systems, job):
    """One run of each system; a run that fails (Huey can lose a task to "database is
    locked" under load and never reach n) is recorded as such, and its round left out of
    the medians."""
    out = {}
    for system in systems:
        try:
            result = measure(system, backend, job)
        except (common.BenchTimeout, RuntimeError) as exc:
            out[system.name] = {"error": str(exc)}
            print("  %-22s failed: %s" % (system.name, exc), flush=True)
            continue
        out[system.name] = result
        print("  %-22s %8.1f jobs/s (steady %8.1f)" % (system.name, result["jobs_per_s"],
                                                       result["steady_jobs_per_s"]), flush=True)
    return out


def summary(rounds, peer):
    """Per system: median jobs/s and steady; ratios to the peer and to batch=1 (medians of
    the per-round ratios)."""
    rounds = [r for r in rounds if not any("error" in v for v in r.values())] or rounds[:0]
    if not rounds:
        return {}
    names = list(rounds[0])
    table = {}
    for name in names:
        row = {"jobs_per_s": median([r[name]["jobs_per_s"] for r in rounds]),
               "steady_jobs_per_s": median([r[name]["steady_jobs_per_s"] for r in rounds])}
        for label, other in (("peer", peer), ("batch_1", "taskrunner batch=1")):
            if other not in rounds[0] or name == other or not name.startswith("taskrunner"):
                continue
            for key, prefix in (("jobs_per_s", ""), ("steady_jobs_per_s", "steady_")):
                row["%svs_%s" % (prefix, label)] = median(
                    [ratio(r[name][key], r[other][key]) for r in rounds])
        table[name] = row
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite,postgresql")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--workers", default="2", help="comma-separated worker counts")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    common.install_signal_cleanup()
    result = {"when": common.utcnow().isoformat() + "Z", "n": args.n, "rounds": args.rounds,
              "log_level": "warning", "sqlite_synchronous": common.SQLITE_SYNCHRONOUS,
              "versions": {b: common.server_version(b) for b in args.db.split(",")},
              "results": {}}
    try:
        for backend in args.db.split(","):
            peer = PEER.get(backend)
            peer_ok = peer is not None and peer.available(backend) is None
            for workers in [int(w) for w in args.workers.split(",")]:
                systems = [batched(int(b)) for b in args.batches.split(",")]
                systems += [peer] if peer_ok else []
                rounds = []
                for i in range(args.rounds):
                    print("%s, W=%d, round %d" % (backend, workers, i + 1), flush=True)
                    rounds.append(run_round(backend, systems, Job(
                        args.n, workers, timeout=args.timeout)))
                table = summary(rounds, peer.name if peer_ok else None)
                result["results"]["%s-w%d" % (backend, workers)] = {"rounds": rounds,
                                                                   "median": table}
                for name, row in table.items():
                    print("  median %-22s %s" % (name, row), flush=True)
    finally:
        common.cleanup()
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
