"""The bench's own instruments: CPU accounting of a process tree (bench/cpu.py), the
taskrunner options and variants passed into the configs it writes, and its command line's
refusals; the peers PgQueuer and DBOS (a tiny run each on PostgreSQL), the class tables and
bench/durable.py's commit counter and its report of a missing API. (The bench itself runs
in CI as `bench/run.py --quick`.)"""
import json
import os
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402
from conftest import databases_required, extra_missing  # noqa: E402
from bench.cpu import tree_seconds  # noqa: E402
from taskrunner.config import Config  # noqa: E402

# A parent with two children that each burn 0.3 s of CPU: one it has reaped, one still alive.
TREE = """
import os, sys, time

def child(then_exit):
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    if not then_exit:
        sys.stdin.read()
    os._exit(0)

reaped = os.fork()
if reaped == 0:
    child(True)
os.waitpid(reaped, 0)
if os.fork() == 0:
    child(False)
print("ready", flush=True)
sys.stdin.read()
"""


def test_cpu_of_a_tree_counts_live_and_reaped_children():
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        live = psutil.Process(proc.pid).children()[0]
        deadline = time.monotonic() + 60
        while sum(live.cpu_times()[:2]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        # 0.6 s burnt; /proc counts in clock ticks, so a little less may show. Without the
        # reaped child it would be about 0.3.
        assert tree_seconds([proc.pid]) >= 0.5
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_options_and_variants_reach_the_written_config(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "_workdir", str(tmp_path))
    monkeypatch.setattr(common, "TASKRUNNER_OPTIONS", {"runner": {"poll_interval": 0.5,
                                                                  "limit": 99}})
    url = "sqlite:///" + str(tmp_path / "q.db")
    path = common.write_config(url, 3, "variant", log={"level": "warning"},
                               runner={"heartbeat_interval": 2.0})
    config = Config.load(path)
    assert (config.runner.limit, config.runner.poll_interval, config.runner.heartbeat_interval,
            config.log.level) == (3, 0.5, 2.0, "warning")


@pytest.mark.parametrize("argv, message", [
    (["--taskrunner-option", "runner.batch"], "is not SECTION.KEY=VALUE"),
    (["--variants", "default,batch=16"], "is not SECTION.KEY=VALUE"),
    (["--workers", "1,x"], "--workers: '1,x' is not a list of positive integers"),
    (["--log-level", "warning,loud"], "is not warning, info or both"),
    (["--db", "sqlite,oracle"], "is not sqlite, postgresql, mysql, all or a list of them"),
])
def test_bench_refuses_bad_options_without_a_traceback(argv, message):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py")] + argv,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_the_bench_imports_no_test_module_and_its_server_harness_needs_no_pytest():
    """bench/ runs where only the bench extra is installed: the throwaway servers it borrows
    (tests/servers.py) import without pytest, and no bench module imports a test module
    (a test module imports pytest and conftest)."""
    import ast
    for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "bench", name)) as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for module in modules:
                assert not module.startswith(("test_", "conftest")), \
                    "bench/%s:%d imports %s" % (name, node.lineno, module)
    code = ("import sys; sys.modules['pytest'] = None\n"
            "sys.path.insert(0, %r)\n"
            "from servers import MariaDBInstance, PgBouncer, PostgresCluster, ServerMissing\n"
            % os.path.join(ROOT, "tests"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_child_of_a_tree_comparison_imports_that_tree_even_from_this_checkout(tmp_path,
                                                                                monkeypatch):
    """bench/ab.py's run_in_tree: started from this checkout's root (as the docs say to run
    the bench), a child of another tree imports that tree's taskrunner. bench/instructions.py
    ran its children in the caller's directory, which `python -m` puts ahead of PYTHONPATH,
    so both of its "trees" were this checkout."""
    from bench.ab import run_in_tree
    other = tmp_path / "other"
    (other / "taskrunner").mkdir(parents=True)
    (other / "taskrunner" / "__init__.py").write_text("")
    monkeypatch.chdir(ROOT)
    done = run_in_tree(str(other), [sys.executable, "-c",
                                    "import taskrunner; print(taskrunner.__file__)"],
                       capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == str(other / "taskrunner" / "__init__.py")


# -- the peers of issue 32 and bench/durable.py --------------------------------------------

def _postgres_or_skip():
    why = common.server_available("postgresql")
    if why:
        if databases_required():
            pytest.fail("PostgreSQL is required: %s" % why)
        pytest.skip("PostgreSQL not reachable: %s" % why)


def _peer_or_skip(name, backend):
    """The peer `name` of bench/systems.py, or the test skipped saying what to install (the
    bench extra), failed where every extra is required."""
    from bench import systems
    peer = next(p for p in systems.PEERS if p.name == name)
    why = peer.available(backend)
    if why:
        extra_missing("%s: %s" % (name, why))
    return peer


def test_the_new_peers_say_where_they_are_compared_and_what_they_need():
    from bench.systems import CLASSES, PEERS, Dbos, PgQueuer
    names = [p.name for p in PEERS]
    assert {"pgqueuer batch=1", "pgqueuer batch=100", "dbos"} <= set(names)
    assert set(CLASSES) == set(names)
    for peer in (PgQueuer(1), PgQueuer(100), Dbos()):
        assert "PostgreSQL only" in peer.available("sqlite")
        why = peer.available("postgresql")
        assert why is None or why.startswith("not installed (pip install '.[bench]')")


@pytest.mark.parametrize("which", ["pgqueuer batch=1", "pgqueuer batch=100", "dbos"])
def test_a_tiny_run_of_each_new_peer_on_postgresql(which, monkeypatch, tmp_path):
    """50 no-op jobs, W = 2, against the real server: every job counted once, finish times,
    CPU and shares measured."""
    from bench import systems
    peer = _peer_or_skip(which, "postgresql")
    _postgres_or_skip()
    monkeypatch.setattr(common, "_workdir", str(tmp_path))
    try:
        result = systems.measure(peer, "postgresql", systems.Job(n=50, workers=2, timeout=120))
    finally:
        common.cleanup()
    assert result["jobs"] == 50 and result["jobs_per_s"] > 0
    assert result["cpu_s"] > 0 and result["db_cpu_s"] is not None
    assert abs(sum(result["shares"]) - 1) < 0.01


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_pickup_times_each_system_from_its_enqueue_to_its_handler(backend, monkeypatch,
                                                                  tmp_path):
    """bench/compare.py's pickup, tiny (2 jobs each after 0.2 s idle, W = 1): taskrunner
    and the peer it is held to (Huey on SQLite, PgQueuer on PostgreSQL) each timed by its
    handler's mark, and the targets read from it."""
    from bench import compare
    from bench.report import evaluate
    from bench.scenarios import Settings
    peer = "huey" if backend == "sqlite" else "pgqueuer batch=1"
    _peer_or_skip(peer, backend)
    if backend == "postgresql":
        _postgres_or_skip()
    monkeypatch.setattr(common, "_workdir", str(tmp_path))
    try:
        result = compare.pickup(backend, Settings.make(True, sweep=(1,), pickup_rounds=2,
                                                       pickup_idle=0.2))
    finally:
        common.cleanup()
    assert "skipped" not in result, result
    assert result["peer"] == peer and set(result["systems"]) == {"taskrunner", peer}
    for times in result["systems"].values():
        # Run after the call returned (a handler may start a hair before the caller sees the
        # commit: not by a second), and within the minute wait_until allows.
        assert -1000 < times["p50_ms"] <= times["max_ms"] < 60_000, result
    targets = [t["target"] for t in evaluate({"pickup": {backend: result}})]
    assert len(targets) == 2 and all(t.startswith("pickup p") for t in targets), targets


def test_the_class_tables_put_taskrunner_beside_each_peer_of_its_class():
    from bench.report import class_rows, evaluate

    def entry(rate, **extra):
        summary = {"median": rate, "min": rate, "max": rate}
        return dict({"jobs_per_s": summary, "steady_jobs_per_s": summary,
                     "cpu_s_per_1000": 0.5, "db_cpu_s_per_1000": 0.25, "shares": [[0.5, 0.5]]},
                    **extra)
    names = ("floor", "procrastinate", "pgqueuer batch=1", "pgqueuer batch=100", "dbos")
    over = {name: {"jobs_per_s": 2.0, "steady_jobs_per_s": 1.0} for name in names}
    cell = {"workers": 2, "log_level": "warning", "peer": "procrastinate", "systems": {
        "taskrunner": entry(1000, over=over, over_peer=over["procrastinate"]),
        "taskrunner runner.batch=16": entry(3000, over=over, over_peer=over["procrastinate"]),
        **{name: entry(500) for name in names}}}
    cell["systems"]["floor"]["taskrunner_over"] = 2.0
    durable = [row[0] for row in class_rows("postgresql", cell, "durable")]
    batched = [row[0] for row in class_rows("postgresql", cell, "batched")]
    assert durable == ["taskrunner", "floor", "procrastinate", "pgqueuer batch=1", "dbos"]
    assert batched == ["taskrunner runner.batch=16", "floor", "pgqueuer batch=100"]
    targets = {t["target"]: t["met"] for t in evaluate({"throughput": {"postgresql": {"cells": [cell]}}})}
    assert targets["durable class: taskrunner ≥ 1.5 × DBOS (W=2)"] is True
    assert targets["batched class: taskrunner runner.batch=16 ≥ 1.2 × PgQueuer (batch 100), steady (W=2)"] is False


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_durable_counts_every_write_transaction_of_another_process(journal, tmp_path):
    """The commit counter of bench/durable.py: WAL commit frames kept from a reset by the
    bench's read transaction (checkpoints forced between the commits), or the rollback
    journal's file change counter; read-only transactions are not counted."""
    from bench.durable import Commits
    path = str(tmp_path / "c.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=%s" % journal)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    commits = Commits("sqlite:///" + path)
    commits.start()
    writer = ("import sqlite3, sys\n"
              "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "for i in range(7):\n"
              "    c.execute('BEGIN IMMEDIATE'); c.execute('INSERT INTO t VALUES (?)', (i,))\n"
              "    c.execute('COMMIT'); c.execute('SELECT count(*) FROM t').fetchall()\n"
              "    c.execute('PRAGMA wal_checkpoint(RESTART)') if i % 2 else None\n")
    subprocess.run([sys.executable, "-c", writer, path], check=True, timeout=60)
    try:
        assert commits.finish()["commits"] == 7
    finally:
        commits.close()


def test_durable_reports_a_missing_taskrunner_api_and_runs_what_it_can(tmp_path):
    """On a tree without the durable-handler or workflow API, the taskrunner side of a
    scenario says so in one line and the run still exits 0; with the API, it runs."""
    from bench.durable import taskrunner_missing
    out = tmp_path / "d.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "durable.py"), "--quick",
                           "--db", "sqlite", "--systems", "taskrunner", "--only", "chain",
                           "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    why = taskrunner_missing("chain")
    if why:
        assert why.startswith("not available in this tree: TaskQueue.add_task(after=...)")
        assert report["skipped"]["sqlite"]["taskrunner chain"] == why
        assert why in done.stdout
    else:
        cell = report["results"]["sqlite"][0]
        assert cell["systems"]["taskrunner"]["commits_per_task"] > 0


def test_wal_counts_what_a_drain_writes_per_job_beside_pgqueuer(tmp_path):
    """bench/wal.py, tiny (30 jobs, batch 1, a throwaway cluster): a drain by this tree
    writes 3 row versions of a job's rows per job (the claim writes the run alone; the end,
    the run and the task: issue 41; 4 before, which `--tree` of 59cc138 shows), and WAL
    with full-page images apart; PgQueuer beside it when the bench extra is installed."""
    import shutil
    if os.geteuid() != 0 or not shutil.which("pg_createcluster"):
        reason = "bench/wal.py makes a cluster of its own: root and pg_createcluster"
        if databases_required():
            pytest.fail(reason + " (required in CI)")
        pytest.skip(reason)
    out = tmp_path / "wal.json"
    done = subprocess.run([sys.executable, "-m", "bench.wal", "--tree", ROOT, "--tasks", "30",
                           "--batch", "1", "--pgqueuer", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WAL and row versions per job" in done.stdout
    results = {r["system"].split()[0]: r for r in json.loads(out.read_text())["results"]}
    drain = results["taskrunner"]["drain"]
    tables = drain["tables"]
    assert (tables["task_queue"]["n_tup_upd"], tables["task_runs"]["n_tup_upd"]) == (30, 60)
    assert not any(tables[t][c] for t in ("task_queue", "task_runs")
                   for c in ("n_tup_ins", "n_tup_del"))
    assert drain["wal_bytes"] > drain["wal_bytes_without_fpi"] > 0
    assert drain["wal_bytes"] == pytest.approx(drain["wal_bytes_without_fpi"] + drain["fpi_bytes"])
    assert results["taskrunner"]["add"]["row_versions"] == 2
    if "pgqueuer" not in results:
        _peer_or_skip("pgqueuer batch=1", "postgresql")
        pytest.fail("bench/wal.py --pgqueuer left PgQueuer out: " + done.stderr)
    peer = results["pgqueuer"]["drain"]
    assert peer["row_versions"] >= 3 and peer["wal_bytes"] > 0


# -- instructions per job beside the peers (issue 41) --------------------------------------

@pytest.mark.parametrize("module, argv, message", [
    ("bench.instructions", ["--huey", "--db", "postgresql"],
     "--huey: Huey is compared on SQLite only"),
    ("bench.instructions", ["--workers", "0"], "--tasks and --workers must be positive"),
    ("bench.instructions", ["--tree", "/nonexistent"], "--tree /nonexistent: no taskrunner"),
    ("bench.server_instructions", ["--batch", "0", "--pgqueuer"],
     "--tasks and --batch must be positive"),
])
def test_the_instruction_counts_refuse_bad_options_without_a_traceback(module, argv, message):
    argv = (["--tree", ROOT] if "--tree" not in argv else []) + argv
    done = subprocess.run([sys.executable, "-m", module] + argv, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def _valgrind_or_skip():
    import shutil
    if not shutil.which("valgrind"):
        pytest.skip("valgrind is not installed (.ci/run installs it for the bench's counts)")


# A parent that forks a child doing the work, and one that runs until it is interrupted.
FORKS = ("import os\npid = os.fork()\nif not pid:\n    sum(i * i for i in range(200000))\n"
         "    os._exit(0)\nos.waitpid(pid, 0)\n")
# Like Huey's consumer, it sets its own SIGINT handler: an ignored SIGINT is inherited through
# exec (a CI shell's background job has one), and Python then installs none of its own.
UNTIL_INTERRUPTED = ("import signal, sys, time\n"
                     "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                     "open(sys.argv[1], 'w').close()\ntry:\n"
                     "    time.sleep(600)\nexcept KeyboardInterrupt:\n    pass\n")


def test_callgrind_counts_every_process_of_a_command_and_interrupts_one_that_runs_on(tmp_path):
    """bench/instructions.py's counted(): a forked child's instructions are counted apart
    (Huey's workers are forked by its consumer), and a command that runs until stopped (Huey's
    consumer) is interrupted once its condition holds."""
    _valgrind_or_skip()
    from bench.instructions import counted
    env = common.child_env()
    counts, (parent,) = counted([[sys.executable, "-c", FORKS]], env, str(tmp_path), "forks")
    assert len(counts) == 2 and parent in counts
    child = next(pid for pid in counts if pid != parent)
    # The child's count holds what its parent ran before the fork, and its own loop.
    assert counts[child] > 0.9 * counts[parent] and counts[child] > counts[parent] - 10 ** 6
    ready = tmp_path / "ready"
    counts, (pid,) = counted([[sys.executable, "-c", UNTIL_INTERRUPTED, str(ready)]], env,
                             str(tmp_path), "until", until=ready.exists)
    assert list(counts) == [pid] and counts[pid] > 0


def test_a_tiny_count_of_huey_beside_the_runner(tmp_path):
    """bench/instructions.py --huey, tiny (10 tasks, W = 2): Huey's consumer counted in every
    process, its workers' share apart, none lost; taskrunner's runners beside it, the ratio."""
    _valgrind_or_skip()
    _peer_or_skip("huey", "sqlite")
    out = tmp_path / "instructions.json"
    done = subprocess.run([sys.executable, "-m", "bench.instructions", "--tree", ROOT, "--tasks",
                           "10", "--workers", "2", "--huey", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["workers"] == 2 and report["machine"]["cores"]
    runner, huey = report["results"]
    assert (runner["system"], huey["system"], huey["lost"]) == ("taskrunner", "huey", 0)
    assert huey["by_process"]["workers"] > 0 and huey["instructions_per_job"] > 0
    assert runner["over_huey"] == common.ratio(runner["instructions_per_job"],
                                               huey["instructions_per_job"])


def test_a_tiny_count_of_pgqueuers_server_work_beside_the_runners(tmp_path):
    """bench/server_instructions.py --pgqueuer, tiny (10 jobs, batch 2, a throwaway cluster
    under callgrind): PgQueuer's server instructions per job beside the runner's with
    [runner] batch = 2, and the ratio."""
    import shutil
    _valgrind_or_skip()
    if os.geteuid() != 0 or not shutil.which("pg_createcluster"):
        reason = "bench/server_instructions.py makes a cluster: root and pg_createcluster"
        if databases_required():
            pytest.fail(reason + " (required in CI)")
        pytest.skip(reason)
    _peer_or_skip("pgqueuer batch=1", "postgresql")
    out = tmp_path / "server.json"
    done = subprocess.run([sys.executable, "-m", "bench.server_instructions", "--tree", ROOT,
                           "--tasks", "10", "--batch", "2", "--pgqueuer", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    runner, peer = json.loads(out.read_text())["results"]
    assert (runner["system"], runner["batch"], peer["system"], peer["batch"]) == (
        "taskrunner", 2, "pgqueuer", 2)
    assert runner["instructions_per_job"] > 0 and peer["instructions_per_job"] > 0
    assert runner["over_pgqueuer"] == common.ratio(runner["instructions_per_job"],
                                                   peer["instructions_per_job"])


# -- where the workers spend their time (bench/waits.py) -----------------------------------

# Each child says "ready" once it is about to block (or spin) and then does so for good.
WAITERS = {
    "busy_sleep": ("import sqlite3, sys\n"
                   "c = sqlite3.connect(sys.argv[1], timeout=120, isolation_level=None)\n"
                   "print('ready', flush=True)\n"
                   "c.execute('BEGIN IMMEDIATE')\n"),
    "sleep": "import time\nprint('ready', flush=True)\ntime.sleep(120)\n",
    "host_lock": ("import fcntl, sys\n"
                  "fd = open(sys.argv[1] + '-hostlock', 'a')\n"
                  "print('ready', flush=True)\n"
                  "fcntl.flock(fd, fcntl.LOCK_EX)\n"),
    "file_lock": ("import fcntl, sys\n"
                  "fd = open(sys.argv[1] + '-other', 'a')\n"
                  "print('ready', flush=True)\n"
                  "fcntl.lockf(fd, fcntl.LOCK_EX)\n"),
    "running": "print('ready', flush=True)\nwhile True:\n    pass\n",
    # As a runner takes a contended host lock: a thread of its own blocks in flock, the main
    # thread waits for it in a futex.
    "host_lock, by a thread": ("import fcntl, sys, threading\n"
                               "fd = open(sys.argv[1] + '-hostlock', 'a')\n"
                               "granted = threading.Lock()\n"
                               "granted.acquire()\n"
                               "threading.Thread(target=lambda: (fcntl.flock(fd, fcntl.LOCK_EX),"
                               " granted.release())).start()\n"
                               "print('ready', flush=True)\n"
                               "granted.acquire()\n"),
}


def test_the_wait_sampler_tells_a_busy_sleep_a_lock_wait_a_sleep_and_a_running_process(tmp_path):
    """Real processes in real system calls: one in SQLite's busy handler behind the test's
    write transaction, one in Python's time.sleep, one blocked in flock on a held host
    lock file (and one whose thread is, its main thread waiting for that thread), one in a
    record lock of another held file, one spinning; the sampler puts
    each in its class, and counts the lock waits as waits while the writer was held."""
    from conftest import wait_for

    from bench import waits
    db = str(tmp_path / "w.db")
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("PRAGMA journal_mode=wal")
    writer.execute("CREATE TABLE t (x)")
    writer.execute("BEGIN IMMEDIATE")
    held = [open(db + suffix, "a") for suffix in ("-hostlock", "-other")]
    import fcntl
    fcntl.flock(held[0], fcntl.LOCK_EX)
    fcntl.lockf(held[1], fcntl.LOCK_EX)
    procs = {}
    try:
        for kind, code in WAITERS.items():
            procs[kind] = subprocess.Popen([sys.executable, "-c", code, db], stdout=subprocess.PIPE,
                                           text=True)
        for kind, proc in procs.items():
            assert proc.stdout.readline() == "ready\n"
            wait_for(lambda: (waits.classify(proc.pid) or ("gone",))[0] == kind.split(",")[0],
                     timeout=60, message="%s classified as %s" % (proc.pid, kind))
        assert waits.sqlite_writer_held(waits.held_locks(), waits._file_key(db + "-shm"))
        sampler = waits.Sampler("sqlite:///" + db,
                                [procs[k].pid for k in ("busy_sleep", "host_lock", "file_lock")],
                                children=False)
        wait_for(lambda: sampler.ticks >= 3, timeout=60, message="3 ticks of the sampler")
        sampler.stop()
        summary = sampler.summary()
        # The busy handler wakes up to poll now and then (a sample may find it running).
        assert summary["shares"]["host_lock"] == summary["shares"]["file_lock"] == round(1 / 3, 3)
        assert summary["shares"]["busy_sleep"] > 0
        assert summary["writer_wait_while_free"] == 0.0
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(30)
        writer.close()


def test_a_quick_bench_run_reports_where_the_runners_spend_their_time(tmp_path):
    """The shares reach the JSON (each run and the cell's median), the printed table and
    bench/markdown.py's."""
    out = tmp_path / "q.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--quick",
                           "--db", "sqlite", "--only", "throughput", "--workers", "2",
                           "--tasks", "1000", "--json", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    cell = json.loads(out.read_text())["throughput"]["sqlite"]["cells"][0]
    waits = cell["systems"]["taskrunner"]["waits"]
    assert waits["samples"] > 0 and abs(sum(waits["shares"].values()) - 1) < 0.02
    assert waits["writer_wait"] is not None and waits["on_cpu"] is not None
    assert cell["systems"]["taskrunner"]["runs"][0]["waits"]["samples"] > 0
    assert "where the workers spend their time" in done.stdout
    table = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "markdown.py"), str(out)],
                           capture_output=True, text=True, timeout=60)
    assert "| where the workers spend their time" in table.stdout, table.stdout + table.stderr
