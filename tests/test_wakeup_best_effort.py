"""Same-host wake-ups are best-effort: whatever goes wrong with the directory or a socket
(another user's, a stale one) never reaches add_task nor stops a runner; one database spelled
two ways is one channel; directories are private, configurable and cleaned up."""
import os
import select
import signal
import stat
import subprocess
import tempfile

import pytest
from conftest import Database, spawn, stop_process, wait_for
from local_users import as_user, other_user  # noqa: F401 - other_user: a fixture

from taskrunner import TaskQueue
from taskrunner.host import wakeup
from taskrunner.config import Config
from taskrunner.store.models import RUNNING, SUCCESS, Runner, Task

ECHO = "taskrunner.handlers.Echo"


def _queue(url, **runner):
    return TaskQueue(Config.from_dict({"database": {"url": url}, "runner": runner}), migrate=True)


def _other_spelling(url):
    """The same server and database, written another way."""
    if url.startswith("postgresql://"):
        return url.replace("postgresql://", "postgres://", 1).replace("127.0.0.1:5432", "localhost")
    if url.startswith("mysql://"):
        return url.replace("127.0.0.1:3306", "localhost").replace("root@", "root:@")
    path = url[len("sqlite:///"):]
    return "sqlite:///" + os.path.relpath(path)


@pytest.fixture
def short_dir():
    """A directory with a short path: a Unix socket's path holds at most 107 bytes."""
    path = tempfile.mkdtemp(prefix="trw")
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def test_one_database_spelled_two_ways_shares_one_channel(database, tmp_path, monkeypatch,
                                                          short_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TASKRUNNER_WAKEUP_DIR", short_dir)
    spelled = _other_spelling(database.url)
    assert spelled != database.url
    listener = wakeup.Listener(wakeup.directory(database.url))
    queue = _queue(spelled)
    try:
        queue.add_task(ECHO)
        ready, _, _ = select.select([listener], [], [], 5)
        assert ready == [listener]
    finally:
        listener.close()
        queue.close()


def test_channel_key_ignores_user_password_options_and_default_port():
    spellings = ["postgresql://postgres@127.0.0.1/test", "postgresql://postgres@localhost:5432/test",
                 "postgres://app:secret@LOCALHOST/test?sslmode=disable"]
    assert len({wakeup.channel_key(url) for url in spellings}) == 1
    assert "secret" not in wakeup.channel_key(spellings[2])
    assert wakeup.channel_key("postgresql://localhost/other") != wakeup.channel_key(spellings[0])
    assert wakeup.channel_key("mysql://root@localhost/test") != wakeup.channel_key(spellings[0])


def test_database_file_and_wakeup_files_are_private(tmp_path, monkeypatch, short_dir):
    monkeypatch.setenv("TASKRUNNER_WAKEUP_DIR", short_dir)
    url = "sqlite:///%s" % (tmp_path / "private.db")
    queue = _queue(url)
    listener = wakeup.Listener(queue.store.wakeup_directory)
    try:
        queue.add_task(ECHO)
        for name in ("private.db", "private.db-wal", "private.db-shm"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
        assert stat.S_IMODE(os.stat(listener.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(listener.path).st_mode) == 0o600
    finally:
        listener.close()
        queue.close()


def test_a_setgid_group_directory_shares_wakeups_with_its_group(short_dir):
    base = os.path.join(short_dir, "shared")
    os.mkdir(base)
    os.chmod(base, 0o2770)
    listener = wakeup.Listener(wakeup.directory("sqlite:////x.db", str(base)))
    try:
        assert stat.S_IMODE(os.stat(listener.directory).st_mode) & 0o777 == 0o770
        assert stat.S_IMODE(os.stat(listener.path).st_mode) == 0o660
    finally:
        listener.close()


def test_the_directory_comes_from_the_environment_then_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("TASKRUNNER_WAKEUP_DIR", raising=False)
    url = "sqlite:///%s" % (tmp_path / "q.db")
    queue = _queue(url, wakeup_dir=str(tmp_path / "from-config"))
    assert queue.store.wakeup_directory.startswith(str(tmp_path / "from-config") + os.sep)
    queue.close()
    monkeypatch.setenv("TASKRUNNER_WAKEUP_DIR", str(tmp_path / "from-env"))
    queue = _queue(url, wakeup_dir=str(tmp_path / "from-config"))
    assert queue.store.wakeup_directory.startswith(str(tmp_path / "from-env") + os.sep)
    queue.close()


def test_without_a_setting_a_sqlite_databases_directory_is_beside_its_file(tmp_path,
                                                                         monkeypatch):
    """Where only who may write the database's directory can plant anything; a server's
    goes to $XDG_RUNTIME_DIR (the user's own), else the temporary directory."""
    monkeypatch.delenv("TASKRUNNER_WAKEUP_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    queue = _queue("sqlite:///%s" % (tmp_path / "q.db"))
    try:
        assert queue.store.wakeup_directory == str(tmp_path / "q.db") + wakeup.BESIDE
        listener = wakeup.Listener(queue.store.wakeup_directory)
        assert stat.S_IMODE(os.stat(listener.directory).st_mode) == 0o700
        listener.close()
    finally:
        queue.close()
    assert not os.path.exists(str(tmp_path / "q.db") + wakeup.BESIDE)
    assert wakeup.directory("postgresql://localhost/x").startswith(
        str(tmp_path / "runtime") + os.sep)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert wakeup.directory("postgresql://localhost/x").startswith(tempfile.gettempdir())


@pytest.mark.timeout(60)
def test_sockets_of_killed_runners_and_empty_directories_are_removed(sqlite_db, tmp_path,
                                                                   short_dir):
    config = sqlite_db.write_config(tmp_path / "c.toml", '[runner]\npoll_interval = 60\n'
                                    'wakeup_dir = "%s"\n' % short_dir)
    directory = wakeup.directory(sqlite_db.url, short_dir)
    runner = spawn("runner", config=config, log_path=tmp_path / "runner.log")
    try:
        wait_for(lambda: os.path.isdir(directory) and os.listdir(directory), message="its socket")
        stop_process(runner, signal.SIGKILL)
        assert len(os.listdir(directory)) == 1    # a killed runner cannot remove its socket
        wakeup.notify_local(directory)            # whoever sends next finds it dead
        assert not os.path.exists(directory)
        listener = wakeup.Listener(directory)     # a runner leaving normally cleans up after itself
        listener.close()
        assert not os.path.exists(directory)
    finally:
        stop_process(runner)


# -- another user on the same host ------------------------------------------------------------

@pytest.fixture
def shared_base():
    """A wake-up base directory every user may use, as /tmp is."""
    base = tempfile.mkdtemp(prefix="trwake-")
    os.chmod(base, 0o1777)
    yield base
    subprocess.run(["rm", "-rf", base], check=False)


# What the other user's process imports as root, before it becomes that user and touches a
# wake-up file (tests/local_users.py).
IMPORTS = """
import logging, select, socket
import psycopg, psycopg.pq, psycopg.types, peewee, psutil
import taskrunner, taskrunner.cli, taskrunner.runner.loop, taskrunner.handlers, taskrunner.api
from taskrunner import TaskQueue
from taskrunner.config import Config
"""


def _as_user(user, code, base, argv=()):
    return as_user(user, code, argv, imports=IMPORTS, env={"TASKRUNNER_WAKEUP_DIR": base})


ADD_TWICE = """
logging.basicConfig(level=logging.WARNING)
queue = TaskQueue(Config.load(database_url=sys.argv[1]))
print(queue.add_task("taskrunner.handlers.Echo"), queue.add_task("taskrunner.handlers.Echo"))
"""

RUNNER = """
sys.exit(taskrunner.cli.main(sys.argv[1:]))
"""


@pytest.mark.timeout(90)
def test_add_task_as_another_user_never_raises_and_adds_once(other_user, shared_base, tmp_path):
    database = Database("postgresql", tmp_path)
    root_runner_side = wakeup.Listener(wakeup.directory(database.url, shared_base))
    try:
        assert stat.S_IMODE(os.stat(root_runner_side.directory).st_mode) == 0o700
        argv, options = _as_user(other_user, ADD_TWICE, shared_base, [database.url])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                              **options)
        assert done.returncode == 0, done.stderr
        ids = [int(i) for i in done.stdout.split()]
        warnings = [line for line in done.stderr.splitlines() if "wake-ups" in line]
        assert len(warnings) == 1 and "runners poll" in warnings[0]
        assert "Traceback" not in done.stderr
        queue = database.queue()
        assert sorted(t.id for t in Task.select()) == sorted(ids) and len(ids) == 2
        queue.close()
    finally:
        root_runner_side.close()
        database.drop()


@pytest.mark.timeout(90)
def test_a_runner_of_another_user_starts_and_polls(other_user, shared_base, tmp_path):
    database = Database("postgresql", tmp_path)
    root_runner_side = wakeup.Listener(wakeup.directory(database.url, shared_base))
    argv, options = _as_user(other_user, RUNNER, shared_base, ["--database", database.url,
                                                               "runner"])
    log_path = tmp_path / "runner.log"
    runner = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"),
                              start_new_session=True, **options)
    queue = database.queue()
    try:
        wait_for(lambda: Runner.select().where(Runner.status == RUNNING).count() == 1
                 or runner.poll() is not None, message="the runner to register")
        assert runner.poll() is None, log_path.read_text()
        task_id = queue.add_task(ECHO)
        wait_for(lambda: Task.get_by_id(task_id).last_status == SUCCESS, timeout=20,
                 message="the task to run by polling")
        assert "runners poll instead" in log_path.read_text()
    finally:
        stop_process(runner)
        queue.close()
        root_runner_side.close()
        database.drop()
