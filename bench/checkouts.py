"""Two checkouts of taskrunner side by side: this one and another (e.g. main in its own work
tree), draining the same no-op backlog on SQLite with `taskrunner overseer` and W runners,
in alternating rounds (the order flips every round), so that their ratio is measured within
one run on a noisy machine. Each side's processes import the taskrunner of its checkout.

    python bench/checkouts.py --other /work/main --tasks 10000 --workers 1,2,8 --rounds 4 \\
        --json bench/results/2026-11-25-group-sync-ab.json
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common
from bench.backlog import queue_backlog
from bench.common import (OverseerProcess, create_database, drop_url, finish_times,
                          median, rates)


def drain(root, n, workers, timeout):
    """n no-ops drained by an overseer of the checkout at `root`: its rates."""
    common.ROOT = root
    url = create_database("sqlite", "checkouts")
    try:
        queue_backlog(url, n, common.NOOP, None)
        overseer = OverseerProcess(url, workers, "checkouts", log={"level": "warning"}).start()
        try:
            overseer.wait_done(n, timeout)
            return rates(overseer.launched, finish_times(url))
        finally:
            overseer.stop()
    finally:
        drop_url(url)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, help="the other checkout's root directory")
    parser.add_argument("--tasks", type=int, default=10000)
    parser.add_argument("--workers", default="1,2,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json")
    args = parser.parse_args()
    sides = {"this": common.ROOT, "other": os.path.abspath(args.other)}
    workers = [int(w) for w in args.workers.split(",")]
    report = {"load_before": os.getloadavg(), "tasks": args.tasks, "sides": sides,
              "rounds": [], "this_over_other": {}}
    common.install_signal_cleanup()
    try:
        for index in range(args.rounds):
            for w in workers:
                order = ["other", "this"] if index % 2 == 0 else ["this", "other"]
                for side in order:
                    result = drain(sides[side], args.tasks, w, args.timeout)
                    result.update(side=side, workers=w, round=index, load=os.getloadavg()[0])
                    report["rounds"].append(result)
                    print("round %d W=%d %-5s %8.1f jobs/s (steady %8.1f), load %.2f" % (
                        index + 1, w, side, result["jobs_per_s"],
                        result["steady_jobs_per_s"], result["load"]), flush=True)
    finally:
        common.cleanup()
    report["load_after"] = os.getloadavg()
    for w in workers:
        ratios = []
        for index in range(args.rounds):
            rate = {r["side"]: r["jobs_per_s"] for r in report["rounds"]
                    if r["workers"] == w and r["round"] == index}
            ratios.append(round(rate["this"] / rate["other"], 3))
        report["this_over_other"][str(w)] = {"per_round": ratios, "median": median(ratios)}
        print("W=%d this / other: %s (median %.3f)" % (w, ratios, median(ratios)))
    if args.json:
        common.write_json(args.json, report)


if __name__ == "__main__":
    main()
