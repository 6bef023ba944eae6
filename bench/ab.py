"""Two source trees of taskrunner side by side with the peer: ``python -m bench.ab --base DIR``
drains the same no-op backlog with `taskrunner overseer` from DIR (e.g. an unpacked
``git archive`` of main) and from this checkout, and with the peer (Huey on SQLite,
Procrastinate on PostgreSQL with ``--db postgresql``) — alternating,
the order rotated every round — and reports the median of the per-round ratios, as
bench/compare.py does for configurations of one tree. Each side's schema is made by its own
``init-db`` (a migration of one tree does not reach the other); the backlog is the same
set-based INSERT for both.
"""
import argparse
import os
import subprocess
import sys

from bench import common
from bench.backlog import add_backlog
from bench.common import OverseerProcess, create_database, spawn, wait_until
from bench.compare import cell_of, measure_rounds
from bench.systems import Floor, Huey, Job, Procrastinate, Taskrunner


def tree_env(root):
    """The children's environment with taskrunner imported from `root`."""
    env = common.child_env()
    env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"]
    return env


def run_in_tree(root, argv, env=None, **kwargs):
    """subprocess.run of `argv` with taskrunner imported from `root`: `env` (default
    tree_env(root)) and a working directory outside every tree. ``python -m`` and ``-c``
    put the working directory first on sys.path, ahead of PYTHONPATH: started from a
    checkout's root, the child imported that checkout's taskrunner whatever `root` was."""
    return subprocess.run(argv, env=env or tree_env(root), cwd=common.workdir(), **kwargs)


class TreeOverseer(OverseerProcess):
    def __init__(self, root, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.root = root

    def start(self):
        import time
        self.launched = time.time()
        self.proc = spawn([sys.executable, "-m", "taskrunner", "--config", self.config,
                           "overseer"], self.label + ".log", env=tree_env(self.root))
        return self


class TaskrunnerAt(Taskrunner):
    """taskrunner from the source tree `root`, named `name`."""

    def __init__(self, name, root):
        super().__init__()
        self.name, self.root = name, root

    def prepare(self, backend, job):
        url = create_database(backend, "ab")
        proc = spawn([sys.executable, "-m", "taskrunner", "--database", url, "init-db"],
                     "ab-init.log", env=tree_env(self.root))
        wait_until(lambda: proc.poll() is not None, 120, "init-db", procs=())
        if proc.returncode:
            raise RuntimeError("init-db of %s failed (log: %s)" % (self.root, common.workdir()))
        add_backlog(url, job.n)
        return url

    def start(self, url, job, label="throughput"):
        sections = common.merge_sections({"log": {"level": job.log_level}}, self.sections)
        return TreeOverseer(self.root, url, job.workers, self.name.replace(" ", "-"),
                            **sections).start()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the other source tree (its root)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--workers", default="1", help="W, or a list: 1,2,8")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--floor", action="store_true", help="the raw-SQL floor too")
    parser.add_argument("--db", default="sqlite", choices=("sqlite", "postgresql"))
    parser.add_argument("--taskrunner-option", action="append", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="into both trees' configs (repeatable), e.g. runner.batch=16")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        common.TASKRUNNER_OPTIONS = common.merge_sections(*map(common.parse_option,
                                                               args.taskrunner_option))
    except ValueError as exc:
        parser.error(str(exc))
    peer = Huey() if args.db == "sqlite" else Procrastinate()
    systems = [peer, TaskrunnerAt("taskrunner base", os.path.abspath(args.base)),
               TaskrunnerAt("taskrunner", common.ROOT)] + ([Floor()] if args.floor else [])
    cells = []
    try:
        for workers in [int(w) for w in args.workers.split(",")]:
            job = Job(args.tasks, workers, args.log_level)
            runs = measure_rounds(args.db, [(job, s) for s in systems], args.rounds)
            cell = cell_of(job, {name: v for (_, name), v in runs.items()}, args.rounds)
            cell["load_average"] = os.getloadavg()
            base, new = (cell["systems"][n]["runs"] for n in ("taskrunner base", "taskrunner"))
            cell["branch_over_base"] = [common.ratio(b["jobs_per_s"], a["jobs_per_s"])
                                        for a, b in zip(base, new)]
            cells.append(cell)
            for name, entry in cell["systems"].items():
                print("W=%d %-18s jobs/s %s  / %s %s" % (
                    workers, name, entry["jobs_per_s"], peer.name,
                    entry.get("over_peer", {}).get("jobs_per_s")))
            print("W=%d taskrunner / base per round: %s, load %s" % (
                workers, cell["branch_over_base"], cell["load_average"]), flush=True)
    finally:
        common.cleanup()
    common.write_json(args.json, cells[0] if len(cells) == 1 else cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
