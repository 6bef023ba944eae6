"""The calendar's speed, which its unit tests no longer judge (a shared machine's timings
swing): how long an expression that never elapses takes to say so, and how many elapses per
second the search finds across a switch to summer time.

    python bench/calendar_speed.py [--elapses 3000] [--repeat 5] [--json FILE]
"""
import argparse
import json
import os
import sys
import time
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from taskrunner.calendar import parse_calendar  # noqa: E402

NEVER = ("*-02-30", "*-04-31 UTC", "*-02,04,06,09,11-31 Europe/Berlin", "2023-*-* 12:00")


def never(repeat):
    """The best of `repeat` times (s) to find that each of NEVER has no next elapse."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for expr in NEVER:
            assert parse_calendar(expr).next_after(datetime(2024, 1, 1)) is None
        best = min(best, time.perf_counter() - started)
    return best


def elapses_per_second(count, repeat):
    """The best rate of `repeat` searches of `count` elapses of a 5-second timer in
    Europe/Berlin across the switch to summer time."""
    event, best = parse_calendar("*:*:0/5 Europe/Berlin"), float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        assert len(event.iter_after(datetime(2024, 3, 31), count)) == count
        best = min(best, time.perf_counter() - started)
    return count / best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elapses", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="write the figures to this file too")
    args = parser.parse_args()
    result = {"never_seconds": round(never(args.repeat), 4),
              "elapses_per_second": round(elapses_per_second(args.elapses, args.repeat))}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
