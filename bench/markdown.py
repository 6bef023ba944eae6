#!/usr/bin/env python3
"""The performance page's tables against the peers, in Markdown, from the JSON of bench/run.py:

    python bench/markdown.py bench/results/2026-11-23-peers-main.json

One table per database for the throughput sweep (one row per W, log level and taskrunner
variant), a durable-class and a batched-class table (taskrunner's default beside the floor
and the durable peers; its batch variant beside PgQueuer's batch of 100, Huey and the
floor), one of where each system's workers spend their time (bench/waits.py), one for the
work scenario (tasks that sleep) and one for single-enqueue latency.
Figures are the medians of the rounds; ratios the medians of the per-round ratios.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import PEER_NAMES, WAIT_HEADERS, class_rows, wait_cells, wait_rows  # noqa: E402

PEERS = {"huey": "Huey", "procrastinate": "Procrastinate"}
NAMES = dict(PEER_NAMES, floor="raw floor")
DATABASES = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "mysql": "MariaDB"}


def _n(value, digits=0):
    return "—" if value is None else "{:,.{}f}".format(value, digits)


def _cpu(entry):
    """CPU s per 1,000 jobs: processes, + server when measured."""
    own, server = entry.get("cpu_s_per_1000"), entry.get("db_cpu_s_per_1000")
    if own is None:
        return "—"
    return "%.2f" % own if server is None else "%.2f + %.2f" % (own, server)


def _shares(entry):
    rounds = [s for s in entry.get("shares", []) if s]
    if not rounds:
        return "n/a"
    middle = sorted(rounds, key=max)[len(rounds) // 2]
    return "/".join("%.0f" % (100 * s) for s in middle)


def _bounds(cell):
    """floor ÷ peer and (SQLite) the disk's ceiling ÷ peer, measured in the same cell."""
    bounds = []
    for name, short in (("floor", "floor"), ("ceiling", "disk")):
        entry = cell["systems"].get(name)
        if entry and "over_peer" in entry:
            bounds.append("%s %.2f ×" % (short, entry["over_peer"]["jobs_per_s"]))
    return ", ".join(bounds) or "—"


def _rows(cell, label, bounds):
    peer = cell["peer"]
    p = cell["systems"].get(peer, {}) if peer else {}
    out = []
    for name, e in cell["systems"].items():
        if not name.startswith("taskrunner"):
            continue
        variant = "" if name == "taskrunner" else " (%s)" % name.split(" ", 1)[1]
        out.append("| %s%s | %s | %s | %s | %s | %s | %s / %s | %s |" % (
            label, variant, _n(p.get("jobs_per_s", {}).get("median")) + _lost(p), _n(e["jobs_per_s"]["median"]),
            "%.2f ×" % e["over_peer"]["jobs_per_s"] if "over_peer" in e else "—",
            bounds, "%s / %s" % (_shares(e), _shares(p)) if p else _shares(e),
            _cpu(e), _cpu(p), _quieter(e, p)))
    return out


def _lost(entry):
    return " (lost %d)" % entry["lost"] if entry.get("lost") else ""


def _quieter(entry, peer):
    """The first log level's jobs/s ÷ this level's, measured in the same rounds."""
    if "first_level_over" not in entry:
        return "—"
    return "%.2f × / %s" % (entry["first_level_over"]["jobs_per_s"],
                            "%.2f ×" % peer["first_level_over"]["jobs_per_s"]
                            if "first_level_over" in peer else "—")


def throughput_table(backend, result):
    peer = next((c["peer"] for c in result["cells"] if c["peer"]), None)
    name = PEERS.get(peer, "peer")
    lines = ["| %s, %s no-op tasks | %s jobs/s | taskrunner jobs/s | taskrunner ÷ %s | bounds "
             "(÷ %s) | shares %% (taskrunner / %s) | CPU s per 1,000 jobs, taskrunner / %s | "
             "warning ÷ info, taskrunner / %s |"
             % (DATABASES[backend], _n(result["cells"][0]["n"]), name, name, name, name, name, name),
             "|---|---:|---:|---:|---|---|---|---|"]
    for cell in result["cells"]:
        lines.extend(_rows(cell, "W = %d, log %s" % (cell["workers"], cell["log_level"]), _bounds(cell)))
    lines.extend("| %s | failed | | | | | | |" % error.split(":", 1)[0] for error in result.get("errors", []))
    return "\n".join(lines)


def _range(summary):
    return "%s (%s–%s)" % (_n(summary["median"]), _n(summary["min"]), _n(summary["max"]))


def class_table(report, klass):
    """One durability class over every database and W (log level warning)."""
    base = "taskrunner" if klass == "durable" else "taskrunner, batched"
    lines = ["| %s class, %s no-op tasks | system | jobs/s (min–max) | steady jobs/s | %s ÷ it "
             "| ÷ it, steady | CPU s per 1,000 jobs (+ server) | largest share |"
             % (klass, _n(_first_n(report)), base), "|---|---|---:|---:|---:|---:|---|---:|"]
    for backend, result in report.get("throughput", {}).items():
        for cell in result.get("cells", []):
            if cell["log_level"] != "warning":
                continue
            for name, jobs, steady, over, over_steady, cpu, db_cpu, share in class_rows(backend, cell, klass):
                entry = {"cpu_s_per_1000": cpu, "db_cpu_s_per_1000": db_cpu}
                lines.append("| %s, W = %d | %s | %s | %s | %s | %s | %s | %s |" % (
                    DATABASES[backend], cell["workers"], NAMES.get(name, name), _range(jobs),
                    _n(steady["median"]), "" if over is None else "%.2f ×" % over,
                    "" if over_steady is None else "%.2f ×" % over_steady, _cpu(entry),
                    "—" if share is None else "%.0f %%" % (100 * share)))
    return "\n".join(lines) if len(lines) > 2 else None


def waits_table(report):
    """Where the workers spend their time, every system of every throughput cell."""
    rows = list(wait_rows(report.get("throughput", {})))
    if not rows:
        return None
    lines = ["| where the workers spend their time (share of samples) | system | %s |"
             % " | ".join(WAIT_HEADERS), "|---|---|" + "---:|" * (len(WAIT_HEADERS) - 1) + "---|"]
    for backend, cell, name, waits in rows:
        lines.append("| %s, W = %d, log %s | %s | %s |" % (
            DATABASES[backend], cell["workers"], cell["log_level"], NAMES.get(name, name),
            " | ".join(c.replace("-", "—") if c == "-" else c for c in wait_cells(waits))))
    return "\n".join(lines)


def _first_n(report):
    for result in report.get("throughput", {}).values():
        for cell in result.get("cells", []):
            return cell["n"]
    return 0


def work_table(results):
    lines = ["| tasks sleeping %g ms | peer jobs/s | taskrunner jobs/s | taskrunner ÷ peer | bound "
             "(W ÷ sleep) | shares %% (taskrunner / peer) | CPU s per 1,000 jobs, taskrunner / peer | warning ÷ info |"
             % next(iter(results.values()))["cells"][0]["task_ms"],
             "|---|---:|---:|---:|---|---|---|---|"]
    for backend, result in results.items():
        for cell in result["cells"]:
            label = "%s, W = %d, %s, %s" % (DATABASES[backend], cell["workers"], PEERS.get(cell["peer"], "—"),
                                            _n(cell["n"]))
            lines.extend(_rows(cell, label, "%s jobs/s" % _n(cell["workers"] * 1000 / cell["task_ms"])))
    return "\n".join(lines)


def enqueue_table(results, commits_per_s):
    lines = ["| one call at a time, workers running (ms) | taskrunner add_task p50 / p95 / p99 "
             "| peer's enqueue p50 / p95 / p99 | p50, p99 ÷ peer's | add_task/s, add_tasks/s |",
             "|---|---|---|---|---|"]
    for backend, r in results.items():
        single = r.get("single") or {}
        if "systems" not in single:
            continue
        note = " (one commit: %.1f ms)" % (1000 / commits_per_s) if backend == "sqlite" and commits_per_s else ""
        for i, peer in enumerate(single["over_peers"]):
            t, p = single["systems"]["taskrunner"], single["systems"][peer]
            rates = ("%s, %s" % (_n(r["add_task_per_s"]["median"]), _n(r["add_tasks_per_s"]["median"]))
                     if i == 0 else "")
            lines.append("| %s, beside %s%s | %s | %s | %.2f, %s | %s |" % (
                DATABASES[backend], NAMES.get(peer, peer), note if i == 0 else "", _percentiles(t),
                _percentiles(p), single["over_peers"][peer],
                _ratio(single.get("p99_over_peers", {}).get(peer)), rates))
    return "\n".join(lines)


def _percentiles(system):
    """'p50 / p95 / p99' of one system's single enqueue (results before p99 was kept: '—')."""
    return " / ".join("%.2f" % system[k] if k in system else "—"
                      for k in ("p50_ms", "p95_ms", "p99_ms"))


def _ratio(value):
    return "—" if value is None else "%.2f" % value


def main(path):
    with open(path) as fh:
        report = json.load(fh)
    parts = [throughput_table(b, r) for b, r in report.get("throughput", {}).items() if "cells" in r]
    parts.extend(t for t in (class_table(report, k) for k in ("durable", "batched")) if t)
    waits = waits_table(report)
    if waits:
        parts.append(waits)
    work = {b: r for b, r in report.get("work", {}).items() if "cells" in r}
    if work:
        parts.append(work_table(work))
    enqueue = {b: r for b, r in report.get("enqueue", {}).items() if "error" not in r}
    if enqueue:
        parts.append(enqueue_table(enqueue, report["meta"].get("sqlite_commits_per_s")))
    print("\n\n".join(parts))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: bench/markdown.py RESULTS.json")
    main(sys.argv[1])
