"""What bench/run.py prints: a table per scenario (`SHOW`), and the targets of the design
and of the issues, measured (`evaluate`)."""
from bench import common
from bench.common import median, print_table
from bench.systems import CLASSES
from bench.waits import CLASSES as WAIT_CLASSES

PEER_NAMES = {"huey": "Huey", "procrastinate": "Procrastinate", "pgqueuer batch=1": "PgQueuer (batch 1)",
              "pgqueuer batch=100": "PgQueuer (batch 100)", "dbos": "DBOS"}


def _mmm(summary):
    return "%s (%s–%s)" % (common.fmt(summary["median"]), common.fmt(summary["min"]),
                           common.fmt(summary["max"]))


def largest_share(entry):
    """The median over the rounds of the largest worker's share, or None when unknown."""
    values = [max(shares) for shares in entry.get("shares", []) if shares]
    return median(values) if values else None


def _share(entry):
    value = largest_share(entry)
    return "-" if "shares" not in entry else "n/a" if value is None else "%.0f %%" % (100 * value)


def _cpu(entry, key):
    value = entry.get(key)
    return "-" if value is None else "%.2f" % value


def _cell_rows(backend, cell):
    rows = []
    for name, e in cell["systems"].items():
        over = e.get("over_peer", {}).get("jobs_per_s")
        if e.get("lost"):
            name += " (lost %d jobs)" % e["lost"]
        rows.append([backend, cell["workers"], cell["log_level"], name, _mmm(e["jobs_per_s"]),
                     _mmm(e["steady_jobs_per_s"]), "-" if over is None else "%.2f ×" % over,
                     "%.0f %%" % (100 * e["taskrunner_over"]) if "taskrunner_over" in e else "",
                     _cpu(e, "cpu_s_per_1000"), _cpu(e, "db_cpu_s_per_1000"), _share(e)])
    return rows


HEADERS = ["db", "W", "log", "system", "jobs/s (min–max)", "steady (p10–p90)", "÷ peer",
           "taskrunner ÷ it", "CPU s / 1k jobs", "DB server CPU s / 1k", "largest share"]


def _show_cells(results, title):
    rows = []
    for backend, r in results.items():
        for cell in r["cells"]:
            rows.extend(_cell_rows(backend, cell))
        for peer, why in r.get("skipped", {}).items():
            rows.append([backend, "", "", peer, "skipped: " + why] + [""] * 6)
        for error in r.get("errors", []):
            rows.append([backend, "", "", "FAILED", error] + [""] * 6)
    print_table(title, HEADERS, rows)


def show_throughput(results):
    some = next(iter(results.values()))["cells"][0]
    _show_cells(results, "throughput: %d no-op tasks drained with W workers (jobs/s, median "
                         "(min–max) of %d rounds; ratios: medians of per-round ratios)"
                % (some["n"], some["rounds"]))
    show_classes(results)
    show_waits(results, "throughput")


# -- where the workers spend their time (bench/waits.py) ---------------------------------

WAIT_HEADERS = ["running", "on CPU", "CPU wait", "busy sleep", "host lock", "sync lock", "file lock", "io", "db wait",
                "idle", "sleep", "thread wait", "other", "writer wait", "… while free", "server waits"]


def _pct(value):
    return "-" if value is None else "%.0f %%" % (100 * value)


def server_waits(waits, top=3):
    """The `top` commonest wait events of the server's backends: "Client:ClientRead 57 %, …"."""
    server = waits.get("server") or {}
    ranked = sorted(server.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join("%s %s" % (k, _pct(v)) for k, v in ranked) or "-"


def wait_cells(waits):
    """The shares of one entry's "waits" (bench/waits.py), in WAIT_HEADERS' order."""
    shares = [_pct(waits["shares"][k]) for k in WAIT_CLASSES]
    return (shares[:1] + [_pct(waits.get("on_cpu")), _pct(waits.get("cpu_wait"))] + shares[1:]
            + [_pct(waits["writer_wait"]), _pct(waits["writer_wait_while_free"]),
               server_waits(waits)])


def wait_rows(results):
    """(backend, cell, system name, its "waits") of every measured system, in order."""
    for backend, r in results.items():
        for cell in r.get("cells", []):
            for name, e in cell["systems"].items():
                if e.get("waits"):
                    yield backend, cell, name, e["waits"]


def show_waits(results, scenario):
    rows = [[backend, cell["workers"], cell["log_level"], name] + wait_cells(waits)
            for backend, cell, name, waits in wait_rows(results)]
    if rows:
        print_table("%s: where the workers spend their time (share of 10 Hz samples of each "
                    "worker's main thread from the first finish to the last, median of the "
                    "rounds; on CPU, CPU wait: its time on a CPU and runnable waiting for one; "
                    "writer wait = busy sleep + host, sync and file locks; … while free: of "
                    "those, the writer they waited for held by no one)" % scenario,
                    ["db", "W", "log", "system"] + WAIT_HEADERS, rows)


def _batched_name(cell):
    return next((name for name in cell["systems"] if name.startswith("taskrunner") and "batch" in name),
                None)


def class_rows(backend, cell, klass):
    """The rows of one durability class in one cell: taskrunner (default, or its batched
    variant) first, then the floor and the peers of that class (the batched class: also
    Huey on SQLite, which its target names), each with taskrunner ÷ it.
    Row: [system, jobs/s summary, steady summary, ÷ jobs/s, ÷ steady, CPU, server CPU,
    largest share]."""
    base = "taskrunner" if klass == "durable" else _batched_name(cell)
    if base not in cell["systems"]:
        return []
    others = [name for name in cell["systems"]
              if name == "floor" or CLASSES.get(name) == klass
              or (klass == "batched" and name == "huey")]
    entry = cell["systems"][base]
    rows = [[base, entry["jobs_per_s"], entry["steady_jobs_per_s"], None, None,
             entry.get("cpu_s_per_1000"), entry.get("db_cpu_s_per_1000"), largest_share(entry)]]
    for name in others:
        e, over = cell["systems"][name], entry.get("over", {}).get(name, {})
        rows.append([name, e["jobs_per_s"], e["steady_jobs_per_s"], over.get("jobs_per_s"),
                     over.get("steady_jobs_per_s"), e.get("cpu_s_per_1000"),
                     e.get("db_cpu_s_per_1000"), largest_share(e)])
    return rows


def show_classes(results):
    """The durable-class and the batched-class tables (issue 32): taskrunner's default
    beside the floor and the durable peers; its batched variant beside the batched peers."""
    for klass in ("durable", "batched"):
        rows = []
        for backend, r in results.items():
            for cell in r["cells"]:
                if cell["log_level"] != "warning":
                    continue
                for row in class_rows(backend, cell, klass):
                    name, jobs, steady, over, over_steady, cpu, db_cpu, share = row
                    rows.append([backend, cell["workers"], name, _mmm(jobs), _mmm(steady),
                                 "" if over is None else "%.2f ×" % over,
                                 "" if over_steady is None else "%.2f ×" % over_steady,
                                 "-" if cpu is None else "%.2f" % cpu,
                                 "-" if db_cpu is None else "%.2f" % db_cpu,
                                 "n/a" if share is None else "%.0f %%" % (100 * share)])
        if rows:
            print_table("%s class: taskrunner%s ÷ each (jobs/s, median (min–max); ratios: medians "
                        "of per-round ratios)" % (klass, "" if klass == "durable" else " batched"),
                        ["db", "W", "system", "jobs/s", "steady", "taskrunner ÷ it",
                         "÷ it, steady", "CPU s / 1k", "DB server CPU s / 1k", "largest share"],
                        rows)


def show_work(results):
    some = next(iter(results.values()))["cells"][0]
    _show_cells(results, "work: %d tasks sleeping %g ms each, W = %d"
                % (some["n"], some["task_ms"], some["workers"]))
    show_waits(results, "work")


def show_enqueue(results):
    rows = [[b, _mmm(r["add_task_per_s"]), _mmm(r["add_tasks_per_s"])] for b, r in results.items()]
    print_table("enqueue (tasks/s)", ["db", "add_task, one call each", "add_tasks, one batch"], rows)
    rows = []
    for backend, r in results.items():
        single = r.get("single") or {}
        over = single.get("over_peers") or {single.get("peer"): single.get("p50_over_peer")}
        over99 = single.get("p99_over_peers", {})
        for name, e in single.get("systems", {}).items():
            rows.append([backend, name, e["p50_ms"], e["p95_ms"], e.get("p99_ms", "—"), ", ".join(
                "%.2f × / %s %s" % (v, "%.2f ×" % over99[peer] if peer in over99 else "—",
                                    PEER_NAMES[peer]) for peer, v in over.items())
                if name == "taskrunner" else ""])
        for peer, why in single.get("skipped", {}).items():
            rows.append([backend, peer, "skipped: " + why, "", "", ""])
    if rows:
        print_table("single enqueue, one call at a time, alternating blocks of calls, every "
                    "system's workers running (ms)",
                    ["db", "system", "p50", "p95", "p99", "p50 / p99 ÷ peer's"], rows)


def show_pickup(results):
    rows = []
    for backend, r in results.items():
        for name, e in r.get("systems", {}).items():
            rows.append([backend, name, e["p50_ms"], e["p95_ms"], e["p99_ms"], e["max_ms"],
                         "%.2f × / %.2f ×" % (r["p50_over_peer"], r["p99_over_peer"])
                         if name == "taskrunner" else ""])
        for peer, why in r.get("skipped", {}).items():
            rows.append([backend, peer, "skipped: " + why, "", "", "", ""])
    if rows:
        some = next((r for r in results.values() if "rounds" in r), {})
        print_table("pickup after %s s idle: the enqueue call's return → the handler ran (ms), "
                    "%s jobs each" % (some.get("idle_s", "?"), some.get("rounds", "?")),
                    ["db", "system", "p50", "p95", "p99", "max", "p50 / p99 ÷ peer's"], rows)


def show_latency(results):
    rows = [[b, r["p50_ms"], r["p95_ms"], r["p99_ms"], r["max_ms"], r["idle_runner_cpu_pct_max"],
             r["idle_overseer_cpu_pct"]] for b, r in results.items()]
    print_table("pickup latency after idle: queued_on → started_on (ms), 200 tasks 20 ms apart",
                ["db", "p50", "p95", "p99", "max", "idle runner CPU % (max)", "overseer CPU %"], rows)


def show_rss(results):
    rows = [[b, r["overseer_rss_mb"], r["runner_rss_mb_max"], r["overseer_uss_mb"],
             max(r["runner_uss_mb"])] for b, r in results.items()]
    print_table("footprint, idle (MB)", ["db", "overseer RSS", "runner RSS (max)", "overseer USS",
                                         "runner USS (max)"], rows)


def show_scale(results):
    rows = [[b, "%d vs %d" % tuple(r["sizes"]), _mmm(r["small_runs_per_s"]), _mmm(r["large_runs_per_s"]),
             "%.0f %%" % (100 * r["ratio"]), r["build_seconds"][r["sizes"][1]]]
            for b, r in results.items()]
    print_table("scale: claim+finish throughput (runs/s) by pending backlog, %s runs per measurement"
                % next(iter(results.values()))["drained_per_measurement"],
                ["db", "pending", "small", "large", "large/small", "build large (s)"], rows)


def show_detection(results):
    rows = [[b, r["kills"], r["to_timeout_p50_s"], r["to_timeout_p99_s"], r["to_restart_p50_s"],
             r["to_restart_p99_s"]] for b, r in results.items()]
    print_table("dead-runner detection after kill -9 (s), check_interval 1 s",
                ["db", "kills", "→ timeout p50", "→ timeout p99", "→ next run started p50",
                 "→ next run p99"], rows)


SHOW = {"throughput": show_throughput, "work": show_work, "enqueue": show_enqueue,
        "pickup": show_pickup, "latency": show_latency, "rss": show_rss, "scale": show_scale, "detection": show_detection}


# -- targets -----------------------------------------------------------------------------

# Throughput ÷ peer on no-op tasks at log level warning (issue 16): (default, batched)
# taskrunner; PostgreSQL from W = 2. Work (tasks sleeping 5 ms): taskrunner ÷ peer.
THROUGHPUT_TARGETS = {"huey": (1.2, 2.5), "procrastinate": (5.0, 10.0)}
MIN_WORKERS = {"huey": 1, "procrastinate": 2}
WORK_TARGETS = {"huey": 1.0, "procrastinate": 2.0}


def _bounds(cell):
    """What bounds taskrunner ÷ peer in this cell: floor ÷ peer and (SQLite) ceiling ÷ peer."""
    shown = ["%s %.2f ×" % (label, cell["systems"][name]["over_peer"]["jobs_per_s"])
             for name, label in (("floor", "raw floor"), ("ceiling", "disk"))
             if "over_peer" in cell["systems"].get(name, {})]
    return " (bounds: %s)" % ", ".join(shown) if shown else ""


def _taskrunners(cell):
    return [(name, e) for name, e in cell["systems"].items() if name.startswith("taskrunner")]


def _throughput_targets(backend, r, add):
    for cell in r["cells"]:
        peer, w = cell["peer"], cell["workers"]
        for name, e in _taskrunners(cell):
            quieter = e.get("first_level_over", {})
            if quieter.get("level") == "warning" and cell["log_level"] == "info":
                v = quieter["jobs_per_s"]
                add("quieter logging not slower: %s log warning ÷ info ≥ 0.95 (W=%d)" % (name, w),
                    backend, v, v >= 0.95, "%.2f ×" % v)
            share = largest_share(e)
            if w > 1 and share is not None:
                add("largest runner share ≤ 1.25 ÷ W (%s, W=%d, log %s)" % (name, w, cell["log_level"]),
                    backend, share, share <= 1.25 / w, "%.0f %%" % (100 * share))
            if peer in THROUGHPUT_TARGETS and cell["log_level"] == "warning" and w >= MIN_WORKERS[peer]:
                goal = THROUGHPUT_TARGETS[peer]["batch" in name]
                v = e["over_peer"]["jobs_per_s"]
                add("%s ≥ %g × %s (W=%d, log warning)" % (name, goal, PEER_NAMES[peer], w), backend,
                    v, v >= goal, "%.2f ×" % v + _bounds(cell))
        if "floor" in cell["systems"]:
            v = cell["systems"]["floor"]["taskrunner_over"]
            add("throughput ≥ 60 %% of the raw floor (W=%d)" % w, backend, v, v >= 0.6,
                "%.0f %%" % (100 * v))


# Issue 32, by durability class: (peer, the W it applies at, taskrunner ÷ peer at least, on
# "jobs_per_s" or "steady_jobs_per_s"). Durable: taskrunner's default; batched: its batch
# variant. "floor": taskrunner ÷ floor.
CLASS_TARGETS = {
    "durable": [("floor", (1, 2, 8), 0.95, "jobs_per_s"), ("huey", (1,), 1.0, "jobs_per_s"),
                ("huey", (2, 8), 1.2, "jobs_per_s"), ("procrastinate", (2, 8), 3.0, "jobs_per_s"),
                ("dbos", (2, 8), 1.5, "jobs_per_s")],
    "batched": [("pgqueuer batch=100", (2, 8), 1.5, "jobs_per_s"),
                ("pgqueuer batch=100", (2, 8), 1.2, "steady_jobs_per_s"),
                ("huey", (1, 2, 8), 3.0, "jobs_per_s")],
}
# CPU per job at most the peer's: (class, peer).
CPU_TARGETS = (("durable", "huey"), ("batched", "pgqueuer batch=100"))


def _cpu_total(entry):
    own, server = entry.get("cpu_s_per_1000"), entry.get("db_cpu_s_per_1000")
    return None if own is None else own + (server or 0)


def _class_targets(backend, r, add):
    for cell in r["cells"]:
        if cell["log_level"] != "warning":
            continue
        w = cell["workers"]
        for klass, goals in CLASS_TARGETS.items():
            base = "taskrunner" if klass == "durable" else _batched_name(cell)
            entry = cell["systems"].get(base)
            if entry is None:
                continue
            for other, ws, goal, key in goals:
                over = entry.get("over", {}).get(other)
                if w in ws and over is not None:
                    v = over[key]
                    label = "raw floor" if other == "floor" else PEER_NAMES[other]
                    add("%s class: %s ≥ %g × %s%s (W=%d)" % (klass, base, goal, label,
                                                           ", steady" if key != "jobs_per_s" else "", w),
                        backend, v, v >= goal, "%.2f ×" % v)
        for klass, other in CPU_TARGETS:
            base = "taskrunner" if klass == "durable" else _batched_name(cell)
            mine, theirs = (_cpu_total(cell["systems"][n]) if n in cell["systems"] else None
                            for n in (base, other))
            if mine is not None and theirs:
                v = mine / theirs
                add("%s class: %s CPU per job ≤ %s's (W=%d)" % (klass, base, PEER_NAMES[other], w),
                    backend, v, v <= 1, "%.2f × (%.2f vs %.2f s / 1k)" % (v, mine, theirs))


def evaluate(report):
    """(target, db, measured, met) for every target that was measured."""
    out = []

    def add(name, backend, value, met, shown):
        out.append({"target": name, "db": backend, "measured": value, "shown": shown, "met": bool(met)})

    for backend, r in report.get("throughput", {}).items():
        if "cells" in r:
            _throughput_targets(backend, r, add)
            _class_targets(backend, r, add)
    for backend, r in report.get("work", {}).items():
        for cell in r.get("cells", []):
            peer = cell["peer"]
            for name, e in _taskrunners(cell) if peer else ():
                v = e["over_peer"]["jobs_per_s"]
                add("%g ms tasks: %s ≥ %g × %s (W=%d)" % (cell["task_ms"], name, WORK_TARGETS[peer],
                                                         PEER_NAMES[peer], cell["workers"]),
                    backend, v, v >= WORK_TARGETS[peer], "%.2f ×" % v)
    for backend, r in report.get("enqueue", {}).items():
        single = r.get("single") or {}
        over = single.get("over_peers") or ({single["peer"]: single["p50_over_peer"]}
                                            if "p50_over_peer" in single else {})
        for peer, v in over.items():
            add("add_task p50 ≤ %s's single enqueue" % PEER_NAMES[peer], backend, v, v <= 1,
                "%.2f × (%.2f vs %.2f ms)" % (v, single["systems"]["taskrunner"]["p50_ms"],
                                              single["systems"][peer]["p50_ms"]))
    for backend, r in report.get("pickup", {}).items():
        if "systems" not in r:
            continue
        peer = r["peer"]
        for q in ("p50", "p99"):
            v = r[q + "_over_peer"]
            add("pickup %s after %g s idle ≤ %s's" % (q, r["idle_s"], PEER_NAMES[peer]), backend,
                v, v <= 1, "%.2f × (%.2f vs %.2f ms)" % (
                    v, r["systems"]["taskrunner"][q + "_ms"], r["systems"][peer][q + "_ms"]))
    for backend, r in report.get("latency", {}).items():
        add("pickup p50 ≤ 10 ms", backend, r["p50_ms"], r["p50_ms"] <= 10, "%.1f ms" % r["p50_ms"])
        add("pickup p99 ≤ 50 ms", backend, r["p99_ms"], r["p99_ms"] <= 50, "%.1f ms" % r["p99_ms"])
        v = r["idle_runner_cpu_pct_max"]
        add("idle runner CPU < 1 %", backend, v, v < 1, "%.2f %%" % v)
    for backend, r in report.get("scale", {}).items():
        add("%d pending ≥ 80 %% of %d pending" % (r["sizes"][1], r["sizes"][0]), backend, r["ratio"],
            r["ratio"] >= 0.8, "%.0f %%" % (100 * r["ratio"]))
    for backend, r in report.get("detection", {}).items():
        v = r["to_restart_p99_s"]
        add("detection p99 ≤ 1.5 s (kill → next run started)", backend, v, v <= 1.5, "%.2f s" % v)
    for backend, r in report.get("rss", {}).items():
        v = r["runner_rss_mb_max"]
        add("idle runner RSS ≤ 40 MB", backend, v, v <= 40, "%.1f MB" % v)
    return out
