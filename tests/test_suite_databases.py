"""The test suite's own housekeeping: the PostgreSQL and MySQL databases a run creates carry
its process's pid and start time, and a later run drops those whose creator has exited — an
interrupted run (Ctrl-C, kill -9) leaves none behind for long, and a run still going keeps
its own."""
import signal
import subprocess
import sys

import pytest

from conftest import TESTS_DIR, _connect, drop_leftovers, new_database_name, process_env


def databases(admin, backend):
    with admin.cursor() as cur:
        cur.execute("SELECT datname FROM pg_database" if backend == "postgresql"
                    else "SHOW DATABASES")
        return {row[0] for row in cur.fetchall()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["postgresql", "mysql"])
def test_the_databases_of_a_killed_run_are_dropped_by_the_next_and_a_live_runs_kept(backend):
    """A process that took a database from the suite's pool (made and migrated) and was
    killed with SIGKILL, as an interrupted run's worker is: its databases outlive it until
    the next sweep, which leaves the databases of a live process alone."""
    code = ("import sys, time\n"
            "sys.path.insert(0, %r)\n"
            "import conftest\n"
            "print(conftest._pool(%r).take(), flush=True)\n"
            "time.sleep(600)\n" % (TESTS_DIR, backend))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=process_env())
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith("trtest_"), name
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    admin = _connect(backend)
    try:
        mine = new_database_name()
        with admin.cursor() as cur:
            cur.execute("CREATE DATABASE %s" % mine)
        assert name in databases(admin, backend)
        dropped = drop_leftovers(backend, admin)
        assert name in dropped and mine not in dropped
        left = databases(admin, backend)
        assert name not in left and mine in left
        assert not [n for n in left if n.startswith("trtest_%d_" % proc.pid)]
    finally:
        with admin.cursor() as cur:
            cur.execute("DROP DATABASE IF EXISTS %s%s" % (
                mine, " WITH (FORCE)" if backend == "postgresql" else ""))
        admin.close()
