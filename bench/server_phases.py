"""PostgreSQL server instructions per job split by phase, counted by callgrind as
bench/server_instructions.py counts a whole drain: ``python -m bench.server_phases --tree .
[--tree /other] [--tasks 1000] [--batch 100] [--pgqueuer] [--json FILE]``.

Each phase runs in a process of its own, so on a backend of its own, whose count is the
phase's; the same process doing nothing but connect (and, for taskrunner, one empty write
transaction) is subtracted. Per tree, on a fresh ``init-db`` database:
- ``enqueue``: N tasks through ``TaskQueue.add_tasks``, B per call (the API, not the bench's
  set-based backlog);
- ``claim``: N / B claims of B runs (``lifecycle.claim_many``, one write transaction each,
  the statement a batched runner sends, without the backlog-share read, for a runner that
  holds no queue slot), each by a runner registered for it, so that each runner holds one
  batch as in a drain;
- ``success``: each batch ended ``success`` in one transaction by its runner
  (``lifecycle.end_successes``, the runner's flush).
A runner drains with the success of one batch and the next claim in one transaction; here
they are apart so each is counted alone. ``--keep DIR``: each phase's callgrind files in
a directory of DIR of their own. ``--pgqueuer``: PgQueuer's enqueue of N jobs
(bench/pgqueuer_app.py's, B jobs per call), beside its drain as server_instructions.py counts it.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

from bench import common
from bench.ab import run_in_tree
from bench.server_instructions import Cluster

# Run in the tree measured (its taskrunner on PYTHONPATH): argv = url phase n batch file.
CHILD = textwrap.dedent("""
    import json, sys
    from taskrunner import TaskQueue
    from taskrunner.config import Config
    from taskrunner.fleet import liveness
    from taskrunner.runs import lifecycle
    from taskrunner.store.models import utcnow
    url, phase, path = sys.argv[1], sys.argv[2], sys.argv[5]
    n, batch = int(sys.argv[3]), int(sys.argv[4])
    queue = TaskQueue(Config.from_dict({"database": {"url": url}}), migrate=False)
    store = queue.store
    store.write(lambda: None)
    if phase == "register":
        json.dump({"runners": [liveness.register(store, take_slot=False).id
                               for _ in range(0, n, batch)]}, open(path, "w"))
    elif phase == "enqueue":
        for start in range(0, n, batch):
            queue.add_tasks([{"handler": "taskrunner.handlers.Echo"}] * min(batch, n - start))
    elif phase == "claim":
        state = json.load(open(path))
        claimed = []
        for runner in state["runners"]:
            got = store.write(lambda: lifecycle.claim_many(
                store, runner, ["default"], utcnow(), batch, share=False,
                held_queues=frozenset()))
            claimed.append([runner, [[c.run_id, c.task_id] for c in got]])
        state["claimed"] = claimed
        json.dump(state, open(path, "w"))
    elif phase == "success":
        state = json.load(open(path))
        for runner, runs in state["claimed"]:
            done = [(r, t, None, utcnow(), None) for r, t in runs]
            store.write(lambda: lifecycle.end_successes(store, runner, done))
    queue.close()
""")
PHASES = ("enqueue", "claim", "success")


def _phase(cluster, root, child, url, phase, n, batch, state, keep=None):
    idle = cluster.backends()
    before = cluster.written()
    run_in_tree(root, [sys.executable, child, url, phase, str(n), str(batch), state],
                check=True, capture_output=True, timeout=3600)
    cluster.wait_gone(idle)
    if keep:
        cluster.keep(cluster.written() - before, os.path.join(
            keep, "%s-b%d-%s" % (os.path.basename(root), batch, phase)))
    return cluster.instructions(cluster.written() - before)


def tree_phases(cluster, root, n, batch, scratch, keep=None):
    """{phase: server instructions per job} of the tree at `root`."""
    child = os.path.join(scratch, "child.py")
    with open(child, "w") as fh:
        fh.write(CHILD)
    name = "ph_%d_%d" % (os.getpid(), len(os.listdir(scratch)))
    url = cluster.database(name)
    run_in_tree(root, [sys.executable, "-m", "taskrunner", "--database", url, "init-db"],
                check=True, capture_output=True)
    state = os.path.join(scratch, name + ".json")
    idle = cluster.backends()
    cluster.wait_gone(idle)
    _phase(cluster, root, child, url, "register", n, batch, state)
    empty = _phase(cluster, root, child, url, "none", 0, batch, state, keep)
    out = {}
    for phase in PHASES:
        total = _phase(cluster, root, child, url, phase, n, batch, state, keep)
        if phase == "enqueue":
            idle = cluster.backends()
            with common.connect(url, autocommit=True) as conn:
                conn.cursor().execute("ANALYZE task_queue")
                conn.cursor().execute("ANALYZE task_runs")
            cluster.wait_gone(idle)         # its count is no phase's
        out[phase] = round((total - empty) / n)
    with open(state) as fh:
        claimed = sum(len(runs) for _, runs in json.load(fh)["claimed"])
    if claimed != n:
        raise RuntimeError("%s: claimed %d of %d" % (root, claimed, n))
    return out


def pgqueuer_enqueue(cluster, n, batch):
    """Server instructions per job of PgQueuer's enqueue of `n` jobs, `batch` per call."""
    from bench import pgqueuer_app
    name = "pgqe_%d" % os.getpid()
    url = cluster.database(name)
    pgqueuer_app.install(url)
    counts = []
    for jobs in (0, n):
        idle = cluster.backends()
        cluster.wait_gone(idle)
        before = cluster.written()
        code = ("import sys; from bench import pgqueuer_app; "
                "pgqueuer_app.enqueue(sys.argv[1], int(sys.argv[2]), batch=int(sys.argv[3]))")
        subprocess.run([sys.executable, "-c", code, url, str(jobs), str(batch)], check=True,
                       env=common.child_env(), cwd=common.ROOT, capture_output=True)
        cluster.wait_gone(idle)
        counts.append(cluster.instructions(cluster.written() - before))
    return round((counts[1] - counts[0]) / n)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True)
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--pgqueuer", action="store_true",
                        help="PgQueuer's enqueue too (its drain: server_instructions.py)")
    parser.add_argument("--keep", help="copy each phase's callgrind files under this "
                        "directory (for callgrind_annotate)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root (the cluster runs as the postgres user)")
    common.install_signal_cleanup()
    cluster, scratch = Cluster(), tempfile.mkdtemp(prefix="trbench-phase-")
    results = []
    try:
        for tree in args.tree:
            root = os.path.abspath(tree)
            phases = tree_phases(cluster, root, args.tasks, args.batch, scratch,
                                 args.keep and os.path.abspath(args.keep))
            results.append({"system": "taskrunner", "tree": root, "batch": args.batch,
                            "instructions_per_job": phases})
            print("%-30s batch %d: %s" % (root, args.batch, ", ".join(
                "%s %.1fk" % (k, v / 1000) for k, v in phases.items())), flush=True)
        if args.pgqueuer:
            per_job = pgqueuer_enqueue(cluster, args.tasks, args.batch)
            results.append({"system": "pgqueuer", "batch": args.batch,
                            "instructions_per_job": {"enqueue": per_job}})
            print("%-30s batch %d: enqueue %.1fk" % ("pgqueuer", args.batch, per_job / 1000),
                  flush=True)
    finally:
        cluster.close()
        common.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
    common.write_json(args.json, {"machine": common.machine(), "tasks": args.tasks,
                                  "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
