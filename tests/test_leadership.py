"""The maintenance lease (leadership.py): one holder at a time, taken and renewed on the
database's clock, overseers before standalone runners, released at a clean stop and when its
holder's row ends; and, with real overseer processes on one database, the fleet's work done
by the holder alone, a kill -9 of the holder's process group taken over within seconds, and a
holder cut off from the database for longer than the lease doing nothing on its return.

Lease expiry is reached, in the in-process tests, by moving ``expires_on`` into the past on
the server's clock (what waiting out the lease would do); the process tests wait for real.
"""
import json
import os
import signal
import socket
import threading
from datetime import datetime, timedelta, timezone

import psutil
import pytest

from conftest import Database, runs_of, spawn, taskrunner, wait_for
from taskrunner.fleet import leadership, liveness
from taskrunner.store.models import OVERSEER, RUNNER, RUNNING, SUCCESS, PeriodicTask, Runner

MACHINE_SLACK = 4.0     # a shared two-core machine: processes may wait that long for a CPU


def lease_row(store):
    return store.Lease.get_or_none(store.Lease.name == leadership.MAINTENANCE)


def expire(store):
    """The lease's time is up, by the database's clock."""
    store.Lease.update(expires_on=store.server_time(-1)).where(
        store.Lease.name == leadership.MAINTENANCE).execute()


# -- the lease, in process, on every backend ----------------------------------------------

def test_one_holder_at_a_time_and_a_renewal_keeps_taken_on(queue):
    store = queue.store
    first = leadership.Lease(store, 101, OVERSEER)
    second = leadership.Lease(store, 102, OVERSEER)
    assert first.renew() and not second.renew()
    taken = lease_row(store)
    assert (taken.holder_id, taken.holder_kind, taken.host) == (101, OVERSEER,
                                                                liveness.host_id(store))
    assert first.renew() and first.held() and not second.held()
    renewed = lease_row(store)
    assert renewed.taken_on == taken.taken_on and renewed.expires_on >= taken.expires_on
    assert not second.renew()


def test_an_expired_lease_is_taken_over_and_its_old_holder_finds_it_lost(queue):
    store = queue.store
    old, new = leadership.Lease(store, 201, OVERSEER), leadership.Lease(store, 202, OVERSEER)
    assert old.renew()
    before = lease_row(store)
    expire(store)
    assert not old.held()           # by the database's clock, before any fleet step
    assert new.renew()
    after = lease_row(store)
    assert after.holder_id == 202 and after.taken_on >= before.taken_on
    assert not old.renew() and not old.held()


def test_an_overseer_takes_the_lease_from_a_standalone_runner_not_the_reverse(queue):
    store = queue.store
    runner, overseer = leadership.Lease(store, 301, RUNNER), leadership.Lease(store, 302, OVERSEER)
    assert runner.renew()
    assert overseer.renew()
    assert not runner.renew() and lease_row(store).holder_id == 302


def test_a_released_lease_is_free_at_once_and_not_taken_back(queue):
    store = queue.store
    first, second = leadership.Lease(store, 401, OVERSEER), leadership.Lease(store, 402, OVERSEER)
    assert first.renew()
    first.release()
    assert [lease["held"] for lease in leadership.leases(store)] == [False]
    assert second.renew()
    second.release()
    assert not first.renew()        # a stopping holder does not take it again


def test_the_lease_of_a_runner_marked_dead_is_free_at_once(queue):
    store = queue.store
    row = liveness.register(store, kind=OVERSEER)
    assert leadership.Lease(store, row.id, OVERSEER).renew()
    liveness.mark_runner_dead(store, row.id, "pid gone")
    assert not leadership.leases(store)[0]["held"]
    assert leadership.Lease(store, row.id + 1, OVERSEER).renew()


def test_racing_connections_take_a_free_lease_exactly_once(database):
    """Eight connections (threads, each its own store) UPDATE at the same instant."""
    stores = [database.queue().store for _ in range(8)]
    for store in stores:
        store.connect()
    barrier, won = threading.Barrier(len(stores)), []

    def take(i):
        barrier.wait()
        if leadership.Lease(stores[i], 500 + i, OVERSEER).renew():
            won.append(i)
    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and lease_row(stores[0]).holder_id == 500 + won[0]
    for store in stores:
        store.close()


def test_status_shows_who_holds_the_lease_and_until_when(queue, database):
    store = queue.store
    assert "maintenance lease: not held" in taskrunner("status", url=database.url,
                                                       check=True).stdout
    assert leadership.Lease(store, 601, OVERSEER).renew()
    text = taskrunner("status", url=database.url, check=True).stdout
    assert "maintenance lease: held by overseer 601 on %s until" % liveness.host_id(store) in text
    result = taskrunner("status", "--json", url=database.url, check=True).stdout
    [lease] = json.loads(result)["leases"]
    assert lease["held"] and lease["holder_id"] == 601 and lease["expires_on"].endswith("+00:00")


# -- real overseers on one database --------------------------------------------------------

CHECK = 0.2


def fleet_toml(host, heartbeat_timeout=3):
    return ('[runner]\nlimit = 1\npoll_interval = 0.2\nheartbeat_interval = 0.5\n'
            'host_id = "%s"\n[overseer]\ncheck_interval = %s\nheartbeat_timeout = %s\n'
            'graceful_timeout = 5\n[task]\nretry_backoff = 0\n[log]\nlevel = "debug"\n'
            % (host, CHECK, heartbeat_timeout))


class Fleet:
    """Overseers on one database, each its own host (``[runner] host_id``), each logging
    to a file of its own."""

    def __init__(self, database, tmp_path):
        self.database, self.tmp_path, self.procs = database, tmp_path, {}

    def start(self, host, url=None, command="overseer"):
        config = self.database.write_config(self.tmp_path / ("%s.toml" % host), fleet_toml(host))
        if url is not None:
            text = open(config).read().replace(self.database.url, url)
            open(config, "w").write(text)
        log_path = self.tmp_path / ("%s.log" % host)
        proc = spawn(command, config=config, log_path=log_path)
        proc.log_path, proc.host = log_path, host
        self.procs[host] = proc
        return proc

    def log(self, host):
        path = self.procs[host].log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self):
        return "\n".join("--- %s:\n%s" % (h, self.log(h)[-3000:]) for h in self.procs)

    def holder(self, store):
        """The host holding the lease now (by the database's clock), or None."""
        [lease] = leadership.leases(store) or [{"held": False}]
        return lease["host"] if lease["held"] else None

    def fleet_passes(self, host):
        return self.log(host).count("fleet maintenance pass")

    def kill(self, host, sig=signal.SIGKILL):
        proc = self.procs[host]
        for pgid in [proc.pid] + [c.pid for c in _children(proc.pid)]:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            proc.wait(timeout=10)

    def kill_all(self):
        for host in self.procs:
            self.kill(host)


def _children(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(params=("sqlite", "postgresql", "mysql"))
def fleet(request, tmp_path):
    database = Database(request.param, tmp_path)
    group = Fleet(database, tmp_path)
    group.queue = database.queue()
    yield group
    group.kill_all()
    group.queue.close()
    database.drop()


def wait_holder(fleet, timeout, not_host=None):
    return wait_for(lambda: fleet.holder(fleet.queue.store) not in (None, not_host)
                    and fleet.holder(fleet.queue.store), timeout=timeout,
                    message="a holder of the maintenance lease" + (
                        " other than %s" % not_host if not_host else "") + "\n" + fleet.logs())


@pytest.mark.slow
def test_three_overseers_one_does_the_fleet_work_and_a_killed_holder_is_replaced(fleet):
    store = fleet.queue.store
    records = str(fleet.tmp_path / "records")
    taskrunner("periodic", "add", "tick", "sample_handlers.Record", "every 1s", "--data",
               json.dumps({"log": records}), url=fleet.database.url, check=True)
    for host in ("host-a", "host-b", "host-c"):
        fleet.start(host)
    wait_for(lambda: Runner.select().where((Runner.kind == RUNNER)
                                           & (Runner.status == RUNNING)).count() == 3,
             timeout=60, message="3 runners\n" + fleet.logs())
    holder = wait_holder(fleet, timeout=30)
    before = {host: fleet.fleet_passes(host) for host in fleet.procs}
    wait_for(lambda: fleet.fleet_passes(holder) >= before[holder] + 10, timeout=30,
             message="ten fleet passes by the holder %s\n%s" % (holder, fleet.logs()))
    others = [host for host in fleet.procs if host != holder]
    assert fleet.holder(store) == holder
    assert [fleet.fleet_passes(host) for host in others] == [before[h] for h in others] == [0, 0]
    assert all("took the maintenance lease" not in fleet.log(host) for host in others)

    submitted = PeriodicTask.get(PeriodicTask.name == "tick").submitted_count
    assert submitted >= 1
    fleet.kill(holder)
    duration = leadership.duration(fleet.database.config(overseer={"check_interval": CHECK}),
                                   OVERSEER)
    successor = wait_holder(fleet, timeout=duration + CHECK + MACHINE_SLACK, not_host=holder)
    assert successor in others
    # The fleet's work goes on: a delayed task comes due and runs; the dead host's runner
    # rows are swept by heartbeat (heartbeat_timeout 3 s) by the new holder.
    task_id = fleet.queue.add_task("sample_handlers.Record", {"log": records},
        scheduled_on=datetime.now(timezone.utc) + timedelta(seconds=1))
    wait_for(lambda: any(run.status == SUCCESS for run in runs_of(task_id)), timeout=30,
             message="the delayed task to run\n" + fleet.logs())
    wait_for(lambda: not Runner.select().where((Runner.host == holder)
                                               & (Runner.status == RUNNING)).exists(),
             timeout=30, message="the dead host's rows swept\n" + fleet.logs())
    assert fleet.fleet_passes(successor) > 0
    # The periodic scheduler moved with the lease.
    wait_for(lambda: PeriodicTask.get(PeriodicTask.name == "tick").submitted_count
             >= submitted + 2, timeout=30, message="the periodic task to go on\n" + fleet.logs())


@pytest.mark.slow
def test_a_cleanly_stopped_holder_hands_the_lease_over_at_once(fleet):
    store = fleet.queue.store
    for host in ("host-a", "host-b"):
        fleet.start(host)
    holder = wait_holder(fleet, timeout=60)
    os.killpg(fleet.procs[holder].pid, signal.SIGTERM)   # its group, as supervisord stops it
    assert fleet.procs[holder].wait(timeout=30) == 0
    # Free (or already taken by the other) as the holder exits, not when it would expire:
    # released at the stop's first check, or with the overseer's row as it retires.
    assert fleet.holder(store) != holder, fleet.logs()
    assert wait_holder(fleet, timeout=30, not_host=holder) != holder


@pytest.mark.slow
@pytest.mark.parametrize("fleet", ["sqlite", "postgresql"], indirect=True)
def test_idle_standalone_runners_share_the_lease_and_yield_it_to_an_overseer(fleet):
    store = fleet.queue.store
    for host in ("runner-a", "runner-b"):
        fleet.start(host, command="runner")
    holder = wait_holder(fleet, timeout=60)
    other = ({"runner-a", "runner-b"} - {holder}).pop()
    wait_for(lambda: fleet.fleet_passes(holder) >= 5, timeout=30,
             message="fleet passes by %s\n%s" % (holder, fleet.logs()))
    assert fleet.fleet_passes(other) == 0, fleet.logs()
    assert leadership.leases(store)[0]["holder_kind"] == RUNNER
    fleet.start("host-c")
    assert wait_holder(fleet, timeout=60, not_host=holder) == "host-c"
    passes = fleet.fleet_passes(holder)
    wait_for(lambda: fleet.fleet_passes("host-c") >= 5, timeout=30,
             message="fleet passes by the overseer\n" + fleet.logs())
    assert fleet.fleet_passes(holder) <= passes + 1     # one pass may have been under way
    assert fleet.fleet_passes(other) == 0 and fleet.holder(store) == "host-c"


class Proxy:
    """A TCP forwarder to the database that can cut every connection through it, and
    refuse new ones, until restored: one host losing the database while others keep it."""

    def __init__(self, port):
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut_off, self.sockets, self.lock = False, [], threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off:
                client.close()
                continue
            server = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self.cut_off = True
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.sockets = []

    def restore(self):
        self.cut_off = False

    def close(self):
        self.cut()
        self.listener.close()


@pytest.mark.slow
@pytest.mark.parametrize("fleet", ["postgresql", "mysql"], indirect=True)
def test_a_holder_cut_off_longer_than_the_lease_does_nothing_on_return_before_renewing(fleet):
    store = fleet.queue.store
    server_port = 5432 if fleet.database.backend == "postgresql" else 3306
    proxy = Proxy(server_port)
    try:
        url = fleet.database.url.replace(":%d/" % server_port, ":%d/" % proxy.port)
        assert url != fleet.database.url
        fleet.start("host-a", url=url)
        assert wait_holder(fleet, timeout=60) == "host-a"
        fleet.start("host-b")
        wait_for(lambda: "started (pid" in fleet.log("host-b"),
                 timeout=60, message="host-b up\n" + fleet.logs())
        proxy.cut()
        assert wait_holder(fleet, timeout=30, not_host="host-a") == "host-b"
        passes = fleet.fleet_passes("host-a")
        proxy.restore()
        # Back, host-a finds the lease lost: its maintainer's renewal fails, or its overseer
        # finds its own row declared dead first and replaces that maintainer (whichever of
        # the two checks comes first on a loaded machine).
        wait_for(lambda: "lost the maintenance lease" in fleet.log("host-a")
                 or "was declared dead; registered again" in fleet.log("host-a"), timeout=30,
                 message="host-a back, finding the lease lost\n" + fleet.logs())
        wait_for(lambda: fleet.log("host-a").count("database reachable again") >= 1,
                 timeout=30, message="host-a back\n" + fleet.logs())
        assert fleet.fleet_passes("host-a") == passes, fleet.log("host-a")[-3000:]
        assert fleet.holder(store) == "host-b"
    finally:
        fleet.kill_all()
        proxy.close()
