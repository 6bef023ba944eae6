#!/usr/bin/env python3
"""/metrics when whoever adds tasks picks the queue names (issue 31): 20,000 tasks in
20,000 queues and 10,000 periodic tasks must scrape in under 1 MB and 0.5 s.

    python bench/metrics_cardinality.py [--queues N] [--periodic M] [--repeat R]

Fills a fresh SQLite database (tasks through `add_tasks`, periodic tasks copied in bulk from
one made by `add_periodic`), then times `exposition()` R times after a first, cold one (the
run totals read once, as the dashboard does at start) and prints the size, the lines, the
median and worst time, and the process's peak RSS.
"""
import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fill(queue, queues, periodic_tasks):
    from taskrunner.periodic import scheduler as periodic
    for start in range(0, queues, 1000):
        queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "queue": "q%05d" % n}
                         for n in range(start, min(start + 1000, queues))])
    model = queue.store.PeriodicTask
    template = periodic.add_periodic(queue.store, "p00000", "taskrunner.handlers.Echo",
                                     "every 1h")
    row = {field: getattr(template, field) for field in model._meta.fields if field != "id"}
    with queue.store.db.atomic():
        for start in range(1, periodic_tasks, 500):
            model.insert_many([dict(row, name="p%05d" % n)
                               for n in range(start, min(start + 500, periodic_tasks))]).execute()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=20000)
    parser.add_argument("--periodic", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from taskrunner import TaskQueue
    from taskrunner.config import Config
    from taskrunner.reads import summaries
    from taskrunner.web.metrics import exposition
    directory = tempfile.mkdtemp(prefix="trmetrics-")
    config = Config.from_dict({"database": {"url": "sqlite:///%s/q.db" % directory,
                                            "sqlite_synchronous": "off"}})
    queue = TaskQueue(config, migrate=True)
    started = time.perf_counter()
    fill(queue, args.queues, args.periodic)
    print("filled %d queues, %d periodic tasks in %.1f s" % (
        args.queues, args.periodic, time.perf_counter() - started))
    totals = summaries.RunTotals()
    text = exposition(queue.store, totals)
    times = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        text = exposition(queue.store, totals)
        times.append(time.perf_counter() - started)
    print("scrape: %d bytes, %d lines; %.3f s median, %.3f s worst (%d scrapes); peak RSS "
          "%.0f MB" % (len(text), text.count(b"\n"), statistics.median(times), max(times),
                       args.repeat, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    queue.close()


if __name__ == "__main__":
    main()
