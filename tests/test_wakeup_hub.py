"""The wake-up hub (hub.py): a new task wakes as many idle runners as it has runs, not all;
only the overseer LISTENs on PostgreSQL, so busy runners hold no notifications; without a
hub (its overseer killed) enqueuers and standalone runners fall back to the runners'
sockets; news from another host reaches the hub through its LISTEN. The hub is a process of
its own: it wakes runners while the overseer is busy, it is started again when it dies, and
its LISTEN connection outlives the overseer's forks."""
import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time

import psutil
import pytest

from conftest import Database, spawn, stop_process, wait_for
from test_overseer import hub_of
from sample_handlers import read_records
from taskrunner import TaskQueue
from taskrunner.host import wakeup
from taskrunner.host.hub import answers
from taskrunner.config import Config
from taskrunner.store.models import MAINTAINER, RUNNING, SUCCESS, Runner, Task

WOKEN = re.compile(r"runner (\d+) woken")
# An idle runner's look for work (queues.claim_order: queue_rows_query with_work), as the
# debug log shows its statement.
LOOK = '"t1"."host_limit", EXISTS('
LISTENING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND query = %s")


@pytest.fixture
def short_dir():
    """A wake-up base directory with a short path (a socket's path holds 107 bytes)."""
    path = tempfile.mkdtemp(prefix="trw")
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def _running():
    """Overseers and runners registered ``running`` (maintainers are not counted)."""
    return Runner.select().where((Runner.status == RUNNING) & (Runner.kind != MAINTAINER)).count()


def _start_overseer(database, tmp_path, base, limit, more=""):
    config = database.write_config(
        tmp_path / "c.toml", '[runner]\npoll_interval = 60\nwakeup_dir = "%s"\nlimit = %d\n'
        '[log]\nlevel = "debug"\n%s' % (base, limit, more))
    log_path = tmp_path / "overseer.log"
    overseer = spawn("overseer", config=config, log_path=log_path)
    hub = os.path.join(wakeup.directory(database.url, base), wakeup.HUB)
    wait_for(lambda: _running() == limit + 1
             and os.path.exists(hub), timeout=60, message="the overseer, its runners and hub")
    return overseer, log_path


def _woken(log_path):
    return WOKEN.findall(log_path.read_text(errors="replace"))


def _run_one_by_one(queue, log, count):
    """Add `count` tasks one at a time, each started at once although runners poll every
    60 s."""
    done = len(read_records(log))
    for n in range(done + 1, done + count + 1):
        started = time.monotonic()
        queue.add_task("sample_handlers.Record", data={"log": log})
        wait_for(lambda: len(read_records(log)) == n, timeout=10, message="task %d to run" % n)
        assert time.monotonic() - started < 5       # woken: the poll interval is 60 s


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_new_task_wakes_one_idle_runner_not_all(database_sp, tmp_path, short_dir):
    queue = database_sp.queue(runner={"wakeup_dir": short_dir})
    overseer, log_path = _start_overseer(database_sp, tmp_path, short_dir, limit=4)
    try:
        log = str(tmp_path / "records")
        wait_for(lambda: log_path.read_text(errors="replace").count(LOOK) >= 4,
                 message="the runners to look once and go idle")
        since = len(log_path.read_text(errors="replace"))
        _run_one_by_one(queue, log, 6)
        # Looks for work (the query is in the debug log): per task, the woken runner's, and
        # its look as it goes idle again after the task (plus a re-read of the claim order
        # now and then); before the hub, all four runners woke for each task and raced
        # (30 to 50 looks).
        looks = log_path.read_text(errors="replace")[since:].count(LOOK)
        assert looks <= 18, looks
        # One runner woken per task (fewer when a runner found the task by itself before
        # it went idle).
        woken = _woken(log_path)
        assert 1 <= len(woken) <= 6, woken
        # A batch of 3 wakes 3 of the idle runners.
        before = len(_woken(log_path))
        queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}] * 3)
        wait_for(lambda: len(read_records(log)) == 9, timeout=10, message="the batch to run")
        wait_for(lambda: len(_woken(log_path)) - before >= 2, timeout=5, message="wake-ups")
        assert len(_woken(log_path)) - before <= 3
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.timeout(120)
def test_a_runner_the_hub_wakes_claims_without_looking_first(database_sp, tmp_path, short_dir):
    """The hub wakes one idle runner per run added, so a woken runner has work: it claims at
    once, guarded, without its look for work first (a round trip less between the enqueue
    and the handler: bench/run.py --only pickup). Without a hub every runner is woken, and
    each looks (a read) before it claims."""
    queue = database_sp.queue(runner={"wakeup_dir": short_dir})
    overseer, log_path = _start_overseer(database_sp, tmp_path, short_dir, limit=1)
    try:
        log = str(tmp_path / "records")
        wait_for(lambda: LOOK in log_path.read_text(errors="replace"),
                 message="the runner to look once and go idle")
        checked = 0
        for n in range(1, 7):
            since = len(log_path.read_text(errors="replace"))
            task_id = queue.add_task("sample_handlers.Record", data={"log": log})
            wait_for(lambda: len(read_records(log)) == n, timeout=10, message="the run")
            text = log_path.read_text(errors="replace")[since:]
            started = text.index("of task %d started" % task_id)
            found = WOKEN.search(text[:started])
            if found is None:
                continue     # added while the runner still looked after its last run
            assert LOOK not in text[found.end():started], text[found.end():started]
            checked += 1
            if checked == 2:
                break
        assert checked == 2, "the runner was woken for %d of %d tasks" % (checked, n)
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


def _idle_with_its_order_read(database, tmp_path, short_dir):
    """An overseer with one runner that looked and waits: its claim order stays what
    that look read (poll interval 60 s), and counts as fresh for a minute (check_interval:
    a busy runner re-reads it no sooner)."""
    overseer, log_path = _start_overseer(database, tmp_path, short_dir, limit=1,
                                         more="[overseer]\ncheck_interval = 60\n")
    # Its first look is for its first claim, unguarded: a pause committed after that look
    # and before the claim does not stop it (CI). Its second is as it goes idle.
    wait_for(lambda: log_path.read_text(errors="replace").count(LOOK) >= 2,
             message="the runner to look for its first claim, then as it goes idle")
    return overseer, log_path


@contextlib.contextmanager
def _mail_paused_after_the_look(database, tmp_path, short_dir):
    """(queue, the overseer's log, a records file for sample_handlers.Record): the queue
    "mail" is in the claim order the idle runner read (_idle_with_its_order_read), then
    paused, which wakes nobody. The overseer is stopped on leaving."""
    queue = database.queue(runner={"wakeup_dir": short_dir})
    queue.pause_queue("mail", create=True)
    queue.resume_queue("mail")
    overseer, log_path = _idle_with_its_order_read(database, tmp_path, short_dir)
    try:
        assert queue.pause_queue("mail"), "mail was paused already"
        yield queue, log_path, str(tmp_path / "records")
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


def _scheduled(task_id):
    return Task.get_by_id(task_id).last_status == "scheduled"


@pytest.mark.timeout(120)
def test_a_claim_without_a_look_leaves_a_queue_paused_since_alone(database_sp, tmp_path,
                                                                  short_dir):
    """The runner the hub woke claims on the claim order of its last look, however old: a
    queue paused since is still in it, so the claim itself leaves that queue alone
    (sql.CLAIM_GUARD). The runner then looks and claims what may be claimed. And the
    claims it makes while busy after that one use a claim order read after it, not that
    old one (CI: a busy runner's claim of its next run took the paused queue's tasks).
    (PostgreSQL and SQLite: on MySQL a runner always looks first.)"""
    paused = _mail_paused_after_the_look(database_sp, tmp_path, short_dir)
    with paused as (queue, log_path, log):
        mail = queue.add_task("sample_handlers.Record", data={"log": log}, queue="mail")
        wait_for(lambda: _woken(log_path), message="the hub to wake the runner")
        plain = queue.add_task("sample_handlers.Record", data={"log": log})
        wait_for(lambda: read_records(log), timeout=10, message="the default task to run")
        assert [task for task, _, _ in read_records(log)] == [plain]
        assert _scheduled(mail)


@pytest.mark.timeout(120)
def test_after_a_claim_without_a_look_the_next_claim_reads_the_claim_order_again(
        database_sp, tmp_path, short_dir):
    """The claims a runner makes while busy use its claim order until check_interval has
    passed since it was read: after a claim without a look, that order is the old one, which
    still has a queue paused since. So the claim of the next run, made with the outcome,
    reads the claim order first (CI: a busy runner took the paused queue's tasks)."""
    paused = _mail_paused_after_the_look(database_sp, tmp_path, short_dir)
    with paused as (queue, log_path, log):
        mail, plain = queue.add_tasks([
            {"handler": "sample_handlers.Record", "data": {"log": log}, "queue": "mail"},
            {"handler": "sample_handlers.Record", "data": {"log": log}}])
        wait_for(lambda: read_records(log), timeout=10, message="the default task to run")
        with_outcome = "of task %d finished" % plain
        wait_for(lambda: with_outcome in log_path.read_text(errors="replace"), timeout=10,
                 message="its outcome, and the claim made with it")
        wait_for(lambda: LOOK in log_path.read_text(errors="replace").split(with_outcome)[1],
                 timeout=10, message="the runner to look after it")
        assert [task for task, _, _ in read_records(log)] == [plain]
        assert _scheduled(mail)


@pytest.mark.timeout(120)
def test_a_claim_without_a_look_keeps_a_rate_limit_set_since(database_sp, tmp_path, short_dir):
    """No rate key had a limit at the runner's last look, so its claims read no bucket; a
    limit set since must still hold for the claim the hub's wake-up makes without a look."""
    queue = database_sp.queue(runner={"wakeup_dir": short_dir})
    overseer, log_path = _idle_with_its_order_read(database_sp, tmp_path, short_dir)
    try:
        log = str(tmp_path / "records")
        queue.set_rate_limit("api", "1/min")
        first, second = queue.add_tasks([{"handler": "sample_handlers.Record",
                                          "data": {"log": log}, "rate_key": "api"}] * 2)
        wait_for(lambda: read_records(log), timeout=10, message="one keyed task to run")
        plain = queue.add_task("sample_handlers.Record", data={"log": log})
        wait_for(lambda: len(read_records(log)) == 2, timeout=10,
                 message="the task without a key to run")
        ran = [task for task, _, _ in read_records(log)]
        assert ran[1] == plain and ran[0] in (first, second), ran
        assert _scheduled(second if ran[0] == first else first)
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_busy_runner_holds_no_notifications(tmp_path, short_dir, request):
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    queue = database.queue()
    queue.pause_queue("parked", create=True)
    overseer, log_path = _start_overseer(database, tmp_path, short_dir, limit=1)
    try:
        # Only the hub LISTENs, whatever the runner did while idle.
        with database.admin.cursor() as cur:
            cur.execute(LISTENING, (database.name, "LISTEN %s" % wakeup.CHANNEL))
            assert cur.fetchone()[0] == 1
        task_id = queue.add_task("wake_handlers.HeldNotifications", data={"adds": 200})
        wait_for(lambda: Task.get_by_id(task_id).last_status == SUCCESS, timeout=30,
                 message="the handler to report")
        assert queue.get_task(task_id).results == {"channels": [], "held": 0}
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_with_the_hub_killed_enqueuers_and_standalone_runners_fall_back(sqlite_db, tmp_path,
                                                                       short_dir):
    queue = sqlite_db.queue(runner={"wakeup_dir": short_dir})
    overseer, _ = _start_overseer(sqlite_db, tmp_path, short_dir, limit=1)
    standalone_config = tmp_path / "standalone.toml"
    standalone_config.write_text('[database]\nurl = "%s"\n[runner]\npoll_interval = 60\n'
                                 'wakeup_dir = "%s"\n' % (sqlite_db.url, short_dir))
    runner = spawn("runner", config=str(standalone_config), log_path=tmp_path / "runner.log")
    try:
        wait_for(lambda: _running() == 3,
                 message="the standalone runner too")
        log = str(tmp_path / "records")
        _run_one_by_one(queue, log, 2)
        # Overseer and hub killed at once: the hub's socket stays behind, dead.
        os.kill(overseer.pid, signal.SIGSTOP)     # so it does not start the hub again
        hub = hub_of(overseer.pid)
        os.kill(hub.pid, signal.SIGKILL)
        stop_process(overseer, signal.SIGKILL)
        wait_for(lambda: _running() <= 2,
                 message="the overseer's runner to go with it")
        assert os.path.exists(os.path.join(queue.store.wakeup_directory, wakeup.HUB))
        _run_one_by_one(queue, log, 2)
        assert {pid for _, _, pid in read_records(log)[-2:]} == {runner.pid}
    finally:
        stop_process(overseer)
        stop_process(runner)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_task_added_on_another_host_wakes_a_runner_through_the_hubs_listen(
        tmp_path, short_dir, request, monkeypatch):
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    database.queue().close()
    overseer, log_path = _start_overseer(database, tmp_path, short_dir, limit=2)
    monkeypatch.delenv("TASKRUNNER_WAKEUP_DIR", raising=False)
    elsewhere = os.path.join(short_dir, "other-host")
    os.mkdir(elsewhere)
    # Another host: its own wake-up directory, so no datagram reaches this host's hub.
    queue = TaskQueue(Config.from_dict({"database": {"url": database.url},
                                        "runner": {"wakeup_dir": elsewhere}}))
    try:
        log = str(tmp_path / "records")
        _run_one_by_one(queue, log, 3)
        assert 1 <= len(_woken(log_path)) <= 3
        # The hub's connection is the one that LISTENs, not each runner's.
        with database.admin.cursor() as cur:
            cur.execute(LISTENING, (database.name, "LISTEN %s" % wakeup.CHANNEL))
            assert cur.fetchone()[0] == 1
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("listen", [False, True])
def test_behind_a_pooler_only_listen_url_listens(tmp_path, short_dir, request, listen):
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    queue = database.queue(runner={"wakeup_dir": short_dir})
    config = tmp_path / "c.toml"
    config.write_text('[database]\nurl = "%s"\npooler = "pgbouncer"\n%s[runner]\n'
                      'poll_interval = 60\nlimit = 2\nwakeup_dir = "%s"\n'
                      % (database.url, 'listen_url = "%s"\n' % database.url if listen else "",
                         short_dir))
    overseer = spawn("overseer", config=str(config), log_path=tmp_path / "overseer.log")
    try:
        hub = os.path.join(queue.store.wakeup_directory, wakeup.HUB)
        wait_for(lambda: _running() == 3
                 and os.path.exists(hub), timeout=60, message="the overseer and its runners")

        def listeners():
            with database.admin.cursor() as cur:
                cur.execute(LISTENING, (database.name, "LISTEN %s" % wakeup.CHANNEL))
                return cur.fetchone()[0]
        if listen:
            wait_for(lambda: listeners() == 1, message="the hub to LISTEN on listen_url")
        # This host's runners are woken by the hub either way.
        _run_one_by_one(queue, str(tmp_path / "records"), 2)
        assert listeners() == (1 if listen else 0)
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hub_listens_again_after_its_connection_was_terminated(tmp_path, short_dir, request,
                                                                    monkeypatch):
    """A restart or a network cut ends the hub's LISTEN session: the overseer carries on,
    reconnects, and news from another host wakes its runner again."""
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    database.queue().close()
    overseer, _ = _start_overseer(database, tmp_path, short_dir, limit=1)

    def hub_backends():
        with database.admin.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND query = %s "
                        "AND application_name = %s",
                        (database.name, "LISTEN %s" % wakeup.CHANNEL, "taskrunner-hub"))
            return [row[0] for row in cur.fetchall()]
    monkeypatch.delenv("TASKRUNNER_WAKEUP_DIR", raising=False)
    queue = TaskQueue(Config.from_dict({"database": {"url": database.url},
                                        "runner": {"wakeup_dir": os.path.join(short_dir, "b")}}))
    try:
        [first] = wait_for(hub_backends, message="the hub to LISTEN")
        with database.admin.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", (first,))
        wait_for(lambda: [pid for pid in hub_backends() if pid != first],
                 message="the hub to LISTEN on a new connection")
        assert overseer.poll() is None
        _run_one_by_one(queue, str(tmp_path / "records"), 2)
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


def test_pooler_and_listen_url_are_checked_and_decide_who_listens():
    from taskrunner.errors import ConfigError
    for bad in ({"pooler": "pgpool"}, {"listen_url": "mysql://root@localhost/x"}):
        with pytest.raises(ConfigError, match=r"\[database\] %s" % list(bad)[0]):
            Config.from_dict({"database": dict(bad, url="postgresql://localhost/x")})

    def who(**database):
        config = Config.from_dict({"database": dict(database, url="postgresql://h/db")})
        return (wakeup.listen_url(config.database),
                wakeup.listen_url(config.database, standalone=True))
    assert who() == ("postgresql://h/db", "postgresql://h/db")
    assert who(pooler="pgbouncer") == ("", "")
    assert who(pooler="pgbouncer", listen_url="postgresql://direct/db") == (
        "postgresql://direct/db", "")
    assert wakeup.listen_url(Config.from_dict({}).database) == ""


def _another_hub(overseer, first):
    """The overseer's hub process once it is another one than `first`."""
    def other():
        hub = hub_of(overseer.pid)
        return hub if hub is not None and hub.pid != first.pid else None
    return wait_for(other, timeout=20, message="a new hub")


def _exited(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _hub_backends(database):
    """Backend pids of the hub's LISTEN connections."""
    with database.admin.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND query = %s "
                    "AND application_name = %s",
                    (database.name, "LISTEN %s" % wakeup.CHANNEL, "taskrunner-hub"))
        return [row[0] for row in cur.fetchall()]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_wake_up_does_not_wait_for_the_overseer(database_sp, tmp_path, short_dir):
    """The overseer may be busy with its database work (a check of 200 runners takes tens of
    milliseconds, an outage seconds): here it is stopped outright, and a new task is still
    picked up at once (the runners poll every 60 s)."""
    queue = database_sp.queue(runner={"wakeup_dir": short_dir})
    overseer, _ = _start_overseer(database_sp, tmp_path, short_dir, limit=2)
    log = str(tmp_path / "records")
    try:
        _run_one_by_one(queue, log, 1)
        os.kill(overseer.pid, signal.SIGSTOP)
        _run_one_by_one(queue, log, 3)
    finally:
        os.kill(overseer.pid, signal.SIGCONT)
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_dead_hub_is_started_again_and_gone_after_a_group_stop(sqlite_db, tmp_path, short_dir):
    queue = sqlite_db.queue(runner={"wakeup_dir": short_dir})
    overseer, log_path = _start_overseer(sqlite_db, tmp_path, short_dir, limit=2)
    path = os.path.join(queue.store.wakeup_directory, wakeup.HUB)
    log = str(tmp_path / "records")
    try:
        first = wait_for(lambda: hub_of(overseer.pid), message="the hub process")
        assert first.name() == "tr-hub" and os.getpgid(first.pid) == first.pid
        os.kill(first.pid, signal.SIGKILL)
        second = _another_hub(overseer, first)
        wait_for(lambda: answers(path), message="the new hub to bind its socket")
        _run_one_by_one(queue, log, 3)
        assert "wake-up hub pid %d exited with signal 9" % first.pid in log_path.read_text()
        # A supervisor's stop signals the overseer's group; the hub, in a group of its own,
        # is stopped by the overseer after its runners, and removes its socket.
        os.killpg(overseer.pid, signal.SIGTERM)
        assert overseer.wait(timeout=30) == 0
        wait_for(lambda: _exited(second.pid), message="the hub to exit")
        assert not os.path.exists(path)
    finally:
        stop_process(overseer, signal.SIGKILL)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hubs_listen_connection_outlives_runner_spawns(tmp_path, short_dir, request):
    """Forking a runner used to close the hub's LISTEN connection (it lived in the overseer),
    so each spawn cost a reconnect and a gap in which another host's news was missed."""
    database = Database("postgresql", tmp_path)
    request.addfinalizer(database.drop)
    database.queue().close()
    overseer, _ = _start_overseer(database, tmp_path, short_dir, limit=2)
    try:
        [listening] = wait_for(lambda: _hub_backends(database), message="the hub to LISTEN")
        for _ in range(3):          # a runner killed is replaced: a fork each time
            before = {r.pid for r in Runner.select().where(
                (Runner.status == RUNNING) & (Runner.kind == "runner"))}
            os.killpg(sorted(before)[0], signal.SIGKILL)
            wait_for(lambda: {r.pid for r in Runner.select().where(
                (Runner.status == RUNNING) & (Runner.kind == "runner"))} - before,
                timeout=30, message="a new runner")
        assert _hub_backends(database) == [listening]
    finally:
        stop_process(overseer, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_reload_starts_a_new_hub_with_the_new_queues(sqlite_db, tmp_path, short_dir):
    """HUP may change the queues configured (whom a task of a queue wakes): the old hub is
    stopped, a new one started, and the new runners are woken through it."""
    queue = sqlite_db.queue(runner={"wakeup_dir": short_dir})
    overseer, log_path = _start_overseer(sqlite_db, tmp_path, short_dir, limit=2)
    log = str(tmp_path / "records")
    try:
        first = wait_for(lambda: hub_of(overseer.pid), message="the hub process")
        config = tmp_path / "c.toml"
        config.write_text(config.read_text() + '[queues.mail]\nlimit = 1\n')
        os.kill(overseer.pid, signal.SIGHUP)
        second = _another_hub(overseer, first)
        assert not psutil.pid_exists(first.pid)          # stopped and reaped
        wait_for(lambda: "config reloaded" in log_path.read_text(), message="the reload")
        path = os.path.join(queue.store.wakeup_directory, wakeup.HUB)
        wait_for(lambda: answers(path), message="the new hub to bind its socket")
        for n in range(1, 4):
            started = time.monotonic()
            queue.add_task("sample_handlers.Record", data={"log": log}, queue="mail")
            wait_for(lambda: len(read_records(log)) == n, timeout=10, message="mail task %d" % n)
            assert time.monotonic() - started < 5
        assert second.is_running()
    finally:
        stop_process(overseer, signal.SIGTERM)
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hub_dies_with_its_overseer(sqlite_db, tmp_path, short_dir):
    """kill -9 of the overseer alone (its hub leads a process group of its own, so the
    signal does not reach it): the hub exits all the same and leaves no process behind."""
    queue = sqlite_db.queue(runner={"wakeup_dir": short_dir})
    overseer, _ = _start_overseer(sqlite_db, tmp_path, short_dir, limit=1)
    try:
        hub = wait_for(lambda: hub_of(overseer.pid), message="the hub process")
        os.kill(overseer.pid, signal.SIGKILL)
        overseer.wait(timeout=10)
        wait_for(lambda: _exited(hub.pid), timeout=15,
                 message="the hub to exit after its overseer")
    finally:
        stop_process(overseer, signal.SIGKILL)
        queue.close()
