#!/usr/bin/env python3
"""Searching tasks by their data at a million tasks, with and without the key's index
(issue 42): ``taskrunner tasks --data order_id=V`` / the dashboard's ``?data=order_id=V``.

    python bench/search.py [--db sqlite|postgresql|mysql|all] [--tasks N] [--repeat R]
                           [--json FILE]

Fills a fresh database in bulk (one INSERT ... SELECT over a generated series) with N ended
tasks whose data is ``{"order_id": i, "customer": "c<i % 1000>"}``, then times one page
(50 tasks, newest first) of a search for an old task (i = N / 10) and a recent one
(i = N - 10), three ways:

- ``scan``: no index, no window: what finding the old task costs without an index (every
  row's JSON is read);
- ``window``: no index, today's bounded page (the 100,000 most recent tasks): fast enough,
  but the old task is not in it;
- ``index``: after ``taskrunner index add order_id``.

Reports the median of R times each, the ratio scan / index, and how long building the
index took. Exit 0 when every search found what it should.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

KEY = "order_id"


def fill(store, n):
    """`n` ended tasks with data {"order_id": i, "customer": "c<i % 1000>"}, i from 1 to
    `n`, in one INSERT ... SELECT copying a template task's columns (so a column added to
    task_queue later needs no change here); returns their ids' lowest."""
    from taskrunner.store.models import SUCCESS
    Task = store.Task
    template = Task.create(**_template_fields(store))
    copied = [f.column_name for f in Task._meta.sorted_fields
              if f.column_name not in ("id", "data", "last_status", "active_key")]
    if store.backend == "postgresql":
        series = "generate_series(1, %d) AS g(i)" % n
    elif store.backend == "mysql":
        series = "(SELECT seq AS i FROM seq_1_to_%d) AS g" % n
    else:
        series = ("(WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s "
                  "WHERE i < %d) SELECT i FROM s) AS g" % n)
    parts = ["'{\"order_id\": '", "i", "', \"customer\": \"c'", "(i % 1000)", "'\"}'"]
    data = ("CONCAT(%s)" % ", ".join(parts) if store.backend == "mysql"
            else " || ".join(parts))
    if store.backend != "sqlite":
        data = data.replace("%", "%%")      # no parameters, but the drivers parse them
    columns = ", ".join(copied)
    store.db.execute_sql(
        "INSERT INTO task_queue (%s, data, last_status) SELECT %s, %s, '%s' "
        "FROM task_queue t, %s WHERE t.id = %d ORDER BY i"
        % (columns, ", ".join("t." + c for c in copied), data, SUCCESS, series, template.id))
    Task.delete().where(Task.id == template.id).execute()
    return template.id + 1


def _template_fields(store):
    now = store.database_time()
    return dict(queued_on=now, scheduled_on=now, handler="app.tasks.Ship", data="{}",
                max_retries=5, run_timeout=3600.0, updated_on=now, finished_on=now,
                run_count=1)


def search(store, value, how):
    """The tasks of one page of a search for order_id=`value`: `how` is scan, window or
    index (the reads the faces use)."""
    from taskrunner.reads import data_search, summaries
    if how == "scan":
        Task = store.Task
        return [row.id for row in Task.select(Task.id).where(
            data_search.condition(store, KEY, value)).order_by(Task.id.desc()).limit(50)]
    view = summaries.TaskFilter(data=(KEY, value))
    return [t.id for t in summaries.find_tasks(store, view, limit=50).tasks]


def timed(fn, repeat):
    times = []
    for _ in range(repeat + 1):        # the first, cold, is not counted
        started = time.perf_counter()
        result = fn()
        times.append(1000 * (time.perf_counter() - started))
    return round(statistics.median(times[1:]), 2), result


def run(backend, n, repeat):
    from taskrunner import TaskQueue
    from taskrunner.store import data_index
    url = common.create_database(backend, "search")
    queue = TaskQueue(url, migrate=True)
    store = queue.store
    started = time.monotonic()
    first = fill(store, n)
    filled = time.monotonic() - started
    store.db.execute_sql("ANALYZE TABLE task_queue" if backend == "mysql" else
                         "ANALYZE task_queue" if backend == "postgresql" else "ANALYZE")
    old, recent = str(n // 10), str(n - 10)
    want = {old: [first + n // 10 - 1], recent: [first + n - 11]}
    report = {"tasks": n, "fill_s": round(filled, 1)}
    for how in ("scan", "window", "index"):
        if how == "index":
            started = time.monotonic()
            data_index.add(store, KEY)
            report["index_build_s"] = round(time.monotonic() - started, 2)
        for label, value in (("old", old), ("recent", recent)):
            ms, found = timed(lambda: search(store, value, how), repeat)
            expected = [] if (how, label) == ("window", "old") and n > 100_000 else want[value]
            if found != expected:
                raise SystemExit("%s %s search for %s found %r, not %r"
                                 % (backend, how, value, found, expected))
            report["%s_%s_ms" % (how, label)] = ms
    report["scan_over_index"] = common.ratio(report["scan_old_ms"], report["index_old_ms"])
    report["window_over_index"] = common.ratio(report["window_recent_ms"],
                                               report["index_recent_ms"])
    queue.close()
    common.drop_url(url)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="bench/search.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=("sqlite", "postgresql", "mysql", "all"),
                        default="sqlite")
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    report = {}
    try:
        for backend in (("sqlite", "postgresql", "mysql") if args.db == "all" else (args.db,)):
            report[backend] = run(backend, args.tasks, args.repeat)
            r = report[backend]
            print("%s: %d tasks filled in %.0f s, index built in %.1f s"
                  % (backend, args.tasks, r["fill_s"], r["index_build_s"]), flush=True)
    finally:
        common.cleanup()
    common.print_table(
        "Search by order_id, one page of 50, ms (median of %d)" % args.repeat,
        ["database", "scan old", "window recent", "window old (not found)", "index old",
         "index recent", "scan / index", "window / index"],
        [[b, r["scan_old_ms"], r["window_recent_ms"], r["window_old_ms"], r["index_old_ms"],
          r["index_recent_ms"], r["scan_over_index"], r["window_over_index"]]
         for b, r in report.items()])
    common.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
