"""PostgreSQL through PgBouncer in transaction pooling mode (`[database] pooler = "pgbouncer"`):
every transaction may get another server connection, so nothing may outlive one.

- a query run many times on several client connections sharing one server connection
  works (psycopg's automatic server-side prepared statements are off: PgBouncer 1.18
  cannot route them, and two clients' "_pg3_0" collide on one server connection);
- a runner does not LISTEN through the pooler (the LISTEN would stay on a server
  connection that other clients then get);
- a fleet of runners — 400 in bench/pgbouncer.py, 120 here — shares a PgBouncer of 40
  server connections (and 12 here): every task done exactly once, and PostgreSQL's
  pg_stat_activity, sampled all along, never shows more server connections than the cap.

Each test starts its own PgBouncer (tests/servers.py) on a free port. The whole suite can
also run through one: TASKRUNNER_TEST_PGBOUNCER=1 (tests/conftest.py).
"""
import os
import signal
import threading

import psycopg
import pytest

from conftest import SERVERS, Database, START_TIMEOUT, databases_required, spawn, wait_for
from sample_handlers import read_records
from servers import PgBouncer, pgbouncer_available
from taskrunner import Config, TaskQueue
from taskrunner.store.models import RUNNER, RUNNING, SUCCESS
from taskrunner.runner import loop

RECORD = "sample_handlers.Record"


@pytest.fixture
def bouncers():
    """Start PgBouncers with `bouncers(pool_size=..., ...)`; all are stopped at teardown."""
    if not pgbouncer_available():
        reason = "pgbouncer is not installed (apt-get install pgbouncer)"
        if databases_required():
            pytest.fail(reason + " (required in CI)")
        pytest.skip(reason)
    started = []

    def start(**options):
        started.append(PgBouncer(SERVERS["postgresql"], **options))
        return started[-1]
    yield start
    for bouncer in started:
        bouncer.stop()


@pytest.fixture
def pg(tmp_path):
    db = Database("postgresql", tmp_path)
    yield db
    db.drop()


def pooled(bouncer, database, **sections):
    data = {"database": {"url": bouncer.url(database.name), "pooler": "pgbouncer"}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return Config.from_dict(data)


def test_queries_repeated_by_clients_sharing_one_server_connection_work(pg, bouncers):
    bouncer = bouncers(pool_size=1)
    first, second = TaskQueue(pooled(bouncer, pg)), TaskQueue(pooled(bouncer, pg))
    try:
        # psycopg would prepare each statement at its 5th execution, as "_pg3_0"...
        for round in range(8):
            for queue in (first, second):
                task_id = queue.add_task("taskrunner.handlers.Echo", data=round)
                assert queue.get_task(task_id).data == round
        assert len(first.tasks(limit=None)) == 16
    finally:
        first.close()
        second.close()


def test_a_runner_does_not_listen_through_the_pooler(pg, bouncers):
    """A pool of one server connection: what a runner LISTENs on is what everyone gets."""
    bouncer = bouncers(pool_size=1)
    queue = TaskQueue(pooled(bouncer, pg, runner={"poll_interval": 0.05}))
    waited = threading.Event()

    class Observed(loop.Runner):
        def _wait(self, timeout):
            super()._wait(timeout)
            waited.set()

    worker = Observed(queue.store, install_signals=False)
    thread = threading.Thread(target=worker.work)
    thread.start()
    try:
        assert waited.wait(START_TIMEOUT), "the runner never went idle"
        with psycopg.connect(bouncer.url(pg.name), autocommit=True) as conn:
            channels = conn.execute("SELECT pg_listening_channels()").fetchall()
        assert channels == []
    finally:
        worker.stop_reason = "the test is over"
        thread.join(30)
        queue.close()
    assert not thread.is_alive()


def server_connections(admin, name):
    with admin.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,))
        return cur.fetchone()[0]


class Sampler(threading.Thread):
    """The most server connections to database `name` seen in pg_stat_activity, sampled
    every 20 ms on a direct connection until `stop()`."""

    def __init__(self, admin, name):
        super().__init__(daemon=True)
        self.admin, self.name = admin, name
        self.samples, self.most = 0, 0
        self.stopping = threading.Event()

    def run(self):
        while not self.stopping.wait(0.02):
            self.most = max(self.most, server_connections(self.admin, self.name))
            self.samples += 1

    def stop(self):
        self.stopping.set()
        self.join(10)


def run_fleet(pg, bouncer, tmp_path, hosts, runners_each, tasks):
    """`hosts` overseers (host ids of their own, so the host limit is each one's) of
    `runners_each` runners through `bouncer`; `tasks` Record tasks added once all runners
    are up. Returns (most server connections seen, samples, runs, task ids, records, how many
    runners ran one)."""
    log = str(tmp_path / "records")
    overseers = []
    sampler = Sampler(pg.admin, pg.name)
    sampler.start()
    queue = TaskQueue(pooled(bouncer, pg))
    try:
        for host in range(hosts):
            path = tmp_path / ("host-%d.toml" % host)
            path.write_text('[database]\nurl = "%s"\npooler = "pgbouncer"\n'
                            '[runner]\nlimit = %d\nhost_id = "pgbouncer-host-%d"\n'
                            % (bouncer.url(pg.name), runners_each, host))
            overseers.append(spawn("overseer", config=str(path),
                                   log_path=tmp_path / ("overseer-%d.log" % host)))
        Runner = queue.store.Runner
        wait_for(lambda: Runner.select().where(Runner.kind == RUNNER, Runner.status == RUNNING)
                 .count() >= hosts * runners_each, timeout=START_TIMEOUT + hosts * runners_each,
                 interval=0.5, message="%d runners up" % (hosts * runners_each))
        ids = []
        for start in range(0, tasks, 1000):
            ids += queue.add_tasks([{"handler": RECORD, "data": {"log": log}}
                                    for _ in range(min(1000, tasks - start))])
        Task = queue.store.Task
        wait_for(lambda: Task.select().where(Task.last_status == SUCCESS).count() == tasks,
                 timeout=120 + tasks / 20, interval=0.5, message="every task done")
        Run = queue.store.Run
        runs = Run.select().count()
        ran = Run.select(Run.runner_id).distinct().count()
        for proc in overseers:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in overseers:
            assert proc.wait(timeout=60) == 0, (tmp_path / "overseer-0.log").read_text()[-3000:]
    finally:
        sampler.stop()
        for proc in overseers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        queue.close()
    return sampler.most, sampler.samples, runs, ids, read_records(log), ran


@pytest.mark.slow
def test_a_fleet_shares_a_few_server_connections(pg, bouncers, tmp_path):
    """120 runners, 12 server connections (bench/pgbouncer.py: 400 through 40)."""
    cap = 12
    bouncer = bouncers(pool_size=cap, max_db_connections=cap)
    most, samples, runs, ids, records, ran = run_fleet(pg, bouncer, tmp_path, hosts=3,
                                                       runners_each=40, tasks=1200)
    assert sorted(task for task, _, _ in records) == sorted(ids)        # each exactly once
    assert runs == 1200
    assert samples > 20 and 1 < most <= cap, (most, samples)
    assert ran > cap                  # more runners worked than there are server connections
