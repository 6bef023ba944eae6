"""One enqueue at a time, as a web request queues work: the latency of taskrunner's
add_task beside Huey's enqueue (SQLite) and Procrastinate's defer (PostgreSQL).

    python bench/enqueue_latency.py [--db sqlite,postgresql] [--calls 500] [--rounds 3]
        [--variant NAME=PYTHONPATH ...] [--json FILE]

Each measurement is a fresh process and database: 50 calls to warm up, then `--calls`
timed ones; p50 / p90 / p99 in ms. The systems alternate, the order rotated each round;
the ratio is taskrunner's p50 over the peer's, per round, then the median.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.systems import Procrastinate  # noqa: E402

CHILD = r'''
import json, sys, time
kind, target, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "taskrunner":
    from bench.common import make_queue
    queue = make_queue(target)
    enqueue = lambda: queue.add_task("taskrunner.handlers.Echo")
elif kind == "huey":
    import os
    os.environ["BENCH_HUEY_DB"] = target
    from bench.huey_app import noop
    enqueue = noop
else:
    import os
    os.environ["BENCH_PROCRASTINATE_DSN"] = target
    from bench.procrastinate_app import app, noop
    app.open()
    enqueue = noop.defer
for _ in range(50):
    enqueue()
times = []
for _ in range(calls):
    start = time.perf_counter()
    enqueue()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
'''


def measure(kind, pythonpath, target, calls):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, common.ROOT) if p)
    env["BENCH_SQLITE_SYNCHRONOUS"] = common.SQLITE_SYNCHRONOUS
    out = subprocess.run([sys.executable, "-c", CHILD, kind, target, str(calls)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=common.workdir())
    if out.returncode:
        raise RuntimeError("%s enqueue failed: %s" % (kind, out.stderr[-2000:]))
    times = sorted(json.loads(out.stdout.strip().splitlines()[-1]))
    return {q: round(common.percentile(times, q) * 1000, 3) for q in (50, 90, 99)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="sqlite,postgresql")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PYTHONPATH")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    variants = [v.split("=", 1) for v in args.variant] or [("taskrunner", common.ROOT)]
    common.install_signal_cleanup()
    results = {}
    try:
        for r in range(args.rounds):
            for backend in args.db.split(","):
                peer = "huey" if backend == "sqlite" else "procrastinate"
                systems = [(name, path) for name, path in variants] + [(peer, "")]
                k = r % len(systems)
                for name, path in systems[k:] + systems[:k]:
                    if name == "huey":
                        target = os.path.join(common.workdir(), "huey-%d.db" % time.monotonic_ns())
                    elif name == "procrastinate":
                        target = Procrastinate().prepare(backend, 0)
                    else:
                        target = common.create_database(backend, "enq")
                    try:
                        m = measure("taskrunner" if path else name, path, target, args.calls)
                    finally:
                        if name == "huey":
                            common.drop_database("sqlite", target)
                        else:
                            common.drop_url(target)
                    results.setdefault(backend, {}).setdefault(name, []).append(m)
                    print("round %d %-10s %-14s p50 %.2f ms  p90 %.2f ms  p99 %.2f ms"
                          % (r + 1, backend, name, m[50], m[90], m[99]), flush=True)
    finally:
        common.cleanup()
    summary = {}
    for backend, by in results.items():
        peer = "huey" if backend == "sqlite" else "procrastinate"
        summary[backend] = {name: {"p50_ms": common.median([m[50] for m in ms])}
                            for name, ms in by.items()}
        for name, ms in by.items():
            if name != peer and peer in by:
                summary[backend][name]["p50_over_%s" % peer] = round(common.median(
                    [a[50] / b[50] for a, b in zip(ms, by[peer])]), 3)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "load_avg": os.getloadavg(), "calls": args.calls, "rounds": args.rounds,
                       "variants": dict(variants), "sqlite_synchronous": common.SQLITE_SYNCHRONOUS,
                       "summary": summary, "runs": results}, fh, indent=2)


if __name__ == "__main__":
    sys.exit(main())
