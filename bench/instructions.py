"""User-space instructions per job of a runner, counted by valgrind's callgrind, for one or
more source trees, the raw-SQL floor and Huey's consumer: ``python -m bench.instructions
--tree /work/base --tree . [--tasks 2000] [--workers W] [--floor] [--huey] [--json FILE]``.

Times on a shared machine swing by +-20 % between identical runs; an instruction count of
the same program on the same input repeats within about 1 %, whatever else the machine
does. So a difference of a few percent in a runner's own work per job is settled here, not
by timing it. Per tree: its own ``init-db`` of a SQLite database in tmpfs (``/dev/shm``:
the disk's waits are not instructions, and its syncs cost nothing there), N no-op tasks
(bench/backlog.py), then W ``taskrunner runner --burst`` processes under callgrind, minus
the same run with no task (start-up and exit); ``--floor``: W bench/floor.py processes on
the same backlog, likewise. ``--db postgresql``: the same on a new PostgreSQL database per
run (bench/common.py's server): the runner's side only, as the server's work is another
process's.

``--huey`` (SQLite; the bench extra): Huey's consumer as the timed bench runs it
(bench/systems.py: ``huey_consumer bench.huey_app.huey -k process -w W -q``, SqliteHuey with
synchronous=full) on its own file in tmpfs holding N no-op tasks (bench/huey_app.py's
enqueue), interrupted (SIGINT, its graceful stop) once N tasks have finished, minus the same
run with no task, interrupted once its W workers have started. It counts every process:
the consumer's main process, its scheduler process and the W workers (callgrind's
``--trace-children=yes``, one count per process, summed; a forked process's count includes
what its parent ran before the fork, the same in both runs, so the difference is exact).
The consumer runs until stopped, so its time-driven work (the main process's 0.1 s loop, the
scheduler's pass every second) over the longer of the two runs is in its figure; the JSON
gives each role's share. Taskrunner's side stays W ``runner --burst`` processes (no
overseer: it runs no more per job than its runners do). Tasks Huey lost (its bookkeeping
met "database is locked") are reported, and the figure is per finished task.

The two runs of a side go side by side (two cores). Only user space is counted: the
kernel's work for a system call (a lock, a sync, an open) is not, so count those with
``strace -c``. Needs valgrind; about a minute per side at the default N and W = 1.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from bench import common
from bench.ab import tree_env
from bench.backlog import add_backlog
from bench.systems import huey_queued

# A memory limit valgrind's own RSS cannot reach ([runner] memory_limit, in MB).
CONFIG = "[runner]\nmemory_limit = 100000\n"
# A callgrind file's total ("summary:" in older versions).
SUMMARY = re.compile(r"^(?:summary|totals): (\d+)", re.M)
# How long Huey may make no progress, its queue empty, before its missing tasks count as lost.
STALLED = 30.0
# How long a command interrupted by `counted` may take to stop under callgrind.
STOPPING = 120


def totals(directory, prefix):
    """{pid: instructions} of the callgrind files `prefix`.<pid> in `directory`."""
    counts = {}
    for name in os.listdir(directory):
        if name.startswith(prefix + "."):
            with open(os.path.join(directory, name)) as fh:
                found = SUMMARY.search(fh.read())
            counts[int(name.rsplit(".", 1)[1])] = int(found.group(1)) if found else 0
    return counts


def counted(commands, env, scratch, tag, until=None):
    """({pid: instructions} of every process of `commands` (argv lists, each started under
    callgrind with its children traced), the pids of the commands themselves) once all have
    exited: on their own, or, with `until` (a predicate), interrupted (SIGINT) once it
    holds. A command that fails raises, with the end of its output."""
    procs = []
    for i, argv in enumerate(commands):
        with open(os.path.join(scratch, "%s-%d.log" % (tag, i)), "w") as log:
            procs.append(subprocess.Popen(
                ["valgrind", "--tool=callgrind", "--trace-children=yes",
                 "--callgrind-out-file=" + os.path.join(scratch, tag + ".%p")] + argv,
                env=env, cwd=common.workdir(), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
    try:
        if until is not None:
            common.wait_until(until, 3600, tag, interval=0.1, procs=procs)
            for proc in procs:
                os.kill(proc.pid, signal.SIGINT)
            for i, proc in enumerate(procs):
                try:
                    proc.wait(STOPPING)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        "%s did not stop within %ds of SIGINT (a command that runs until "
                        "stopped must set its own SIGINT handler: an ignored SIGINT is "
                        "inherited through exec)" % (" ".join(commands[i]), STOPPING)) from None
        for proc in procs:
            proc.wait(3600)
    finally:
        for proc in procs:   # a process group each: a forked worker goes with its parent
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for i, proc in enumerate(procs):
        if proc.returncode:
            with open(os.path.join(scratch, "%s-%d.log" % (tag, i))) as log:
                raise RuntimeError("%s failed (%d): %s" % (" ".join(commands[i]),
                                                           proc.returncode, log.read()[-2000:]))
    return totals(scratch, tag), [proc.pid for proc in procs]


# What the backlog's tasks are (--handler): a class handler, or a function task (@task).
HANDLERS = {"class": (common.NOOP, None), "function": ("bench.function_tasks.noop", {})}


def per_job(root, tasks, floor, scratch, backend="sqlite", handler="class", workers=1):
    """Instructions per job of W runners (or floors) of the tree at `root`."""
    env = dict(tree_env(root), PYTHONHASHSEED="0")
    config = os.path.join(scratch, "runner.toml")
    with open(config, "w") as fh:
        fh.write(CONFIG)

    def prepared(count):
        url = ("sqlite:///" + os.path.join(scratch, "%d.db" % count) if backend == "sqlite"
               else common.create_database(backend, "instr"))
        subprocess.run([sys.executable, "-m", "taskrunner", "--database", url, "init-db"],
                       env=env, cwd=common.workdir(), check=True, capture_output=True)
        if count:
            path, data = HANDLERS[handler]
            add_backlog(url, count, path, data)
        if floor:
            return [[sys.executable, "-m", "bench.floor", url, str(i + 1)]
                    for i in range(workers)]
        return [[sys.executable, "-m", "taskrunner", "--config", config, "--database", url,
                 "--log-level", "warning", "runner", "--burst"]] * workers
    runs = [prepared(0), prepared(tasks)]
    with ThreadPoolExecutor(2) as pool:
        empty, full = pool.map(lambda item: sum(counted(item[1], env, scratch, "cg%d" % item[0])
                                                [0].values()), enumerate(runs))
    return (full - empty) / tasks


def _lines(path):
    try:
        with open(path) as fh:
            return fh.read().split()
    except FileNotFoundError:
        return []


def huey_run(count, workers, scratch):
    """(processes' instructions by role, tasks finished) of Huey's consumer with W process
    workers draining `count` no-op tasks from a file of its own, as bench/systems.py runs it."""
    base = os.path.join(scratch, "huey-%d" % count)
    env = dict(common.child_env(), PYTHONHASHSEED="0", BENCH_HUEY_DB=base + ".db",
               BENCH_MARKS=base + ".marks", BENCH_HUEY_STARTED=base + ".started",
               BENCH_SQLITE_SYNCHRONOUS=common.SQLITE_SYNCHRONOUS)
    # Its tables made (and the tasks queued) before the counted run, in both runs alike.
    subprocess.run([sys.executable, "-c", "from bench.huey_app import enqueue; enqueue(%d)"
                    % count], env=env, cwd=common.workdir(), check=True, capture_output=True)
    progress = {"done": -1, "since": time.monotonic()}

    def finished():
        if len(_lines(base + ".started")) < workers:
            return False
        done = len(_lines(base + ".marks")) // 2
        if done >= count:
            return True
        if done != progress["done"]:
            progress.update(done=done, since=time.monotonic())
            return False
        return time.monotonic() - progress["since"] > STALLED and huey_queued(base + ".db") == 0
    consumer = [sys.executable, "-m", "huey.bin.huey_consumer", "bench.huey_app.huey",
                "-k", "process", "-w", str(workers), "-q"]
    counts, (main,) = counted([consumer], env, scratch, "huey%d" % count, until=finished)
    workers_pids = {int(pid) for pid in _lines(base + ".started")}
    # The main process (valgrind keeps its pid), the workers, and the rest: the scheduler.
    roles = {"main": counts[main],
             "workers": sum(n for pid, n in counts.items() if pid in workers_pids),
             "scheduler": sum(n for pid, n in counts.items()
                              if pid != main and pid not in workers_pids)}
    return roles, len(_lines(base + ".marks")) // 2


def huey_per_job(tasks, workers, scratch):
    """(instructions per finished task, by role and in all; tasks lost) of Huey's consumer."""
    with ThreadPoolExecutor(2) as pool:
        (empty, _), (full, done) = pool.map(lambda n: huey_run(n, workers, scratch),
                                            (0, tasks))
    if not done:
        raise RuntimeError("Huey finished no task")
    roles = {role: (full[role] - empty[role]) / done for role in full}
    return dict(roles, all=sum(roles.values())), tasks - done


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree's root (repeatable)")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=1,
                        help="W runner (and floor, and Huey worker) processes")
    parser.add_argument("--floor", action="store_true", help="the raw-SQL floor too")
    parser.add_argument("--huey", action="store_true",
                        help="Huey's consumer too (SQLite; skipped, saying why, without the "
                             "bench extra)")
    parser.add_argument("--db", default="sqlite", choices=("sqlite", "postgresql"))
    parser.add_argument("--handler", action="append", choices=sorted(HANDLERS),
                        help="the tasks: a class handler (the default) or a function task "
                             "(@task); repeat for both")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.workers < 1:
        parser.error("--tasks and --workers must be positive")
    if args.huey and args.db != "sqlite":
        parser.error("--huey: Huey is compared on SQLite only")
    for tree in args.tree:
        if not os.path.isdir(os.path.join(tree, "taskrunner")):
            parser.error("--tree %s: no taskrunner package there" % tree)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed")
    huey = args.huey
    if huey:
        from bench.systems import Huey
        why = Huey().available("sqlite")
        if why:
            print("huey skipped: %s" % why, file=sys.stderr)
            huey = False
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handlers = args.handler or ["class"]
    sides = [(os.path.abspath(tree), False, handler) for tree in args.tree
             for handler in handlers]
    if args.floor:
        sides.append((os.path.abspath(args.tree[-1]), True, "class"))
    results = []
    try:
        for root, floor, handler in sides:
            scratch = tempfile.mkdtemp(prefix="trbench-instr-", dir=base)
            try:
                count = per_job(root, args.tasks, floor, scratch, args.db, handler, args.workers)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            results.append({"system": "floor" if floor else "taskrunner", "tree": root,
                            "handler": handler, "instructions_per_job": round(count)})
            print("%-40s %s, W = %d: %.0fk instructions per job" % (
                root, "floor" if floor else "runner, %s tasks" % handler, args.workers,
                count / 1000), flush=True)
        if huey:
            scratch = tempfile.mkdtemp(prefix="trbench-instr-", dir=base)
            try:
                roles, lost = huey_per_job(args.tasks, args.workers, scratch)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            results.append({"system": "huey", "instructions_per_job": round(roles["all"]),
                            "by_process": {k: round(v) for k, v in roles.items() if k != "all"},
                            "lost": lost})
            print("%-40s consumer, W = %d: %.0fk instructions per job (workers %.0fk, main "
                  "%.0fk, scheduler %.0fk; %d lost)" % (
                      "huey", args.workers, roles["all"] / 1000, roles["workers"] / 1000,
                      roles["main"] / 1000, roles["scheduler"] / 1000, lost), flush=True)
    finally:
        common.cleanup()
    peer = next((r for r in results if r["system"] == "huey"), None)
    if peer:
        for r in results:
            if r["system"] == "taskrunner":
                r["over_huey"] = common.ratio(r["instructions_per_job"],
                                              peer["instructions_per_job"])
                print("%-40s taskrunner / huey at W = %d: %.3f" % (
                    r["tree"], args.workers, r["over_huey"]))
    common.write_json(args.json, {"machine": common.machine(), "tasks": args.tasks,
                                  "workers": args.workers, "db": args.db,
                                  "valgrind": _valgrind_version(),
                                  "huey": common.package_version("huey"),
                                  "load_average": os.getloadavg(), "results": results})
    return 0


def _valgrind_version():
    return subprocess.run(["valgrind", "--version"], capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
