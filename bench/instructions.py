"""User-space instructions per job of a runner, counted by valgrind's callgrind, for one or
more source trees and the raw-SQL floor: ``python -m bench.instructions --tree /work/base
--tree . [--tasks 2000] [--floor]``.

Times on a shared machine swing by +-20 % between identical runs; an instruction count of
the same program on the same input repeats within about 1 %, whatever else the machine
does. So a difference of a few percent in a runner's own work per job is settled here, not
by timing it. Per tree: its own ``init-db`` of a SQLite database in tmpfs (``/dev/shm``:
the disk's waits are not instructions, and its syncs cost nothing there), N no-op tasks
(bench/backlog.py), then ``taskrunner runner --burst`` under callgrind, minus the same run
with no task (start-up and exit); ``--floor``: bench/floor.py on the same backlog, likewise.
``--db postgresql``: the same on a new PostgreSQL database per run (bench/common.py's
server): the runner's side only, as the server's work is another process's.
The two runs of a tree go side by side (two cores). Only user space is counted: the kernel's
work for a system call (a lock, a sync, an open) is not, so count those with ``strace -c``.
Needs valgrind; about a minute per tree at the default N.
"""
import argparse
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench import common
from bench.ab import run_in_tree, tree_env
from bench.backlog import add_backlog

# A memory limit valgrind's own RSS cannot reach ([runner] memory_limit, in MB).
CONFIG = "[runner]\nmemory_limit = 100000\n"
COLLECTED = re.compile(r"Collected : (\d+)")


def collected(root, argv, env, out):
    """Instructions callgrind counted running `argv` of the tree at `root`."""
    done = run_in_tree(root, ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out]
                       + argv, env=env, capture_output=True, text=True)
    found = COLLECTED.search(done.stderr)
    if done.returncode or found is None:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(argv), done.returncode,
                                                   done.stderr[-2000:]))
    return int(found.group(1))


# What the backlog's tasks are (--handler): a class handler, or a function task (@task).
HANDLERS = {"class": (common.NOOP, None), "function": ("bench.function_tasks.noop", {})}


def per_job(root, tasks, floor, scratch, backend="sqlite", handler="class"):
    """(instructions per job, of the runner or the floor) of the tree at `root`."""
    env = dict(tree_env(root), PYTHONHASHSEED="0")
    config = os.path.join(scratch, "runner.toml")
    with open(config, "w") as fh:
        fh.write(CONFIG)

    def prepared(count):
        url = ("sqlite:///" + os.path.join(scratch, "%d.db" % count) if backend == "sqlite"
               else common.create_database(backend, "instr"))
        run_in_tree(root, [sys.executable, "-m", "taskrunner", "--database", url, "init-db"],
                    env=env, check=True, capture_output=True)
        if count:
            path, data = HANDLERS[handler]
            add_backlog(url, count, path, data)
        if floor:
            return [sys.executable, "-m", "bench.floor", url, "1"]
        return [sys.executable, "-m", "taskrunner", "--config", config, "--database", url,
                "--log-level", "warning", "runner", "--burst"]
    runs = [prepared(0), prepared(tasks)]
    with ThreadPoolExecutor(2) as pool:
        empty, full = pool.map(lambda item: collected(root, item[1], env, os.path.join(
            scratch, "callgrind-%d.out" % item[0])), enumerate(runs))
    return (full - empty) / tasks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree's root (repeatable)")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--floor", action="store_true", help="the raw-SQL floor too")
    parser.add_argument("--db", default="sqlite", choices=("sqlite", "postgresql"))
    parser.add_argument("--handler", action="append", choices=sorted(HANDLERS),
                        help="the tasks: a class handler (the default) or a function task "
                             "(@task); repeat for both")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handlers = args.handler or ["class"]
    sides = [(os.path.abspath(tree), False, handler) for tree in args.tree
             for handler in handlers]
    if args.floor:
        sides.append((os.path.abspath(args.tree[-1]), True, "class"))
    try:
        for root, floor, handler in sides:
            scratch = tempfile.mkdtemp(prefix="trbench-instr-", dir=base)
            try:
                count = per_job(root, args.tasks, floor, scratch, args.db, handler)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            print("%-40s %s: %.0fk instructions per job" % (
                root, "floor" if floor else "runner, %s tasks" % handler, count / 1000),
                flush=True)
    finally:
        common.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
