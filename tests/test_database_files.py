"""The files taskrunner keeps beside a SQLite database — ``<database>-hostlock`` (the host's
writers take turns on it) and ``<database>-sync`` (group commit's counters, mapped into every
runner) — cannot be turned against their user by another local user who can write the
database's directory (DESIGN.md rule 11): a file planted there beforehand (a symlink to a
file of the victim's, or a file of the other user's) is never written, locked or mapped;
the store works without it and says so. Each test runs the other side as a real second
user (tests/local_users.py)."""
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import Database, spawn, stop_process, taskrunner, wait_for
from local_users import as_user, other_user, run_as  # noqa: F401 - other_user: a fixture

from taskrunner.host import groupsync, hostlock, runtimedir
from taskrunner.store.models import SUCCESS, Task

ECHO = "taskrunner.handlers.Echo"


@pytest.fixture
def public(other_user):
    """A directory like /tmp (1777) holding the victim's database."""
    path = tempfile.mkdtemp(prefix="trdb-")
    os.chmod(path, 0o1777)
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


PLANT_FILE = """
path = sys.argv[1]
os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
os.chmod(path, 0o666)
"""

# Truncates the file over and over (a store into a mapping past its end is SIGBUS).
TRUNCATE = """
while True:
    try:
        os.truncate(sys.argv[1], 0)
    except OSError:
        pass
    time.sleep(0.001)
"""


@pytest.mark.timeout(90)
def test_a_sync_file_planted_by_another_user_is_never_mapped(other_user, public, tmp_path):
    """The other user creates ``<database>-sync`` (0666) before the victim's runner starts,
    and truncates it while the runner works: the runner must not write its counters into
    it nor map it (a truncated mapping kills the runner with SIGBUS); its tasks still run."""
    database = Database("sqlite", Path(public))
    sync_path = database.url[len("sqlite:///"):] + groupsync.SUFFIX
    run_as(other_user, PLANT_FILE, sync_path)
    config = database.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.2\n")
    queue = database.queue()
    log_path = tmp_path / "runner.log"
    runner = spawn("runner", config=config, log_path=log_path)
    argv, options = as_user(other_user, TRUNCATE, [sync_path])
    truncating = subprocess.Popen(argv, **options)
    try:
        for _ in range(3):
            ids = [queue.add_task(ECHO) for _ in range(20)]
            wait_for(lambda: all(Task.get_by_id(i).last_status == SUCCESS for i in ids)
                     or runner.poll() is not None, timeout=40, message="the tasks to run")
            assert runner.poll() is None, "the runner died (%s): %s" % (
                runner.returncode, log_path.read_text()[-3000:])
    finally:
        truncating.kill()
        truncating.wait()
        stop_process(runner, signal.SIGTERM)
        queue.close()
    assert os.stat(sync_path).st_size == 0, "the runner wrote into the other user's file"
    assert os.stat(sync_path).st_uid == other_user.pw_uid
    assert "-sync" in log_path.read_text(), "the planted file went unreported"


HOLD_LOCK = """
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_RDONLY, 0o644)
os.chmod(path, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(90)
def test_a_host_lock_planted_by_another_user_blocks_no_writer(other_user, public, tmp_path):
    """The other user creates ``<database>-hostlock`` (readable by all) and holds a lock on
    it: the victim's writers must not wait on it (each write would wait for ever)."""
    database = Database("sqlite", Path(public))
    lock_path = database.url[len("sqlite:///"):] + hostlock.SUFFIX
    argv, options = as_user(other_user, HOLD_LOCK, [lock_path], imports="import fcntl")
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              **options)
    try:
        assert holder.stdout.readline().strip() == "holding"
        result = taskrunner("add", ECHO, url=database.url, process=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert "-hostlock" in result.stderr, "the planted file went unreported"
    finally:
        holder.kill()
        holder.wait()


PLANT_LINK = """
os.symlink(sys.argv[2], sys.argv[1])
"""


@pytest.mark.parametrize("suffix", [groupsync.SUFFIX, hostlock.SUFFIX])
@pytest.mark.timeout(90)
def test_a_planted_symlink_beside_the_database_is_never_followed(other_user, public, tmp_path,
                                                                 suffix):
    """The other user links ``<database>-sync`` or ``-hostlock`` to a file of the victim's:
    a runner must neither write nor create through the link."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious")
    missing = tmp_path / "created-through-a-link"
    database = Database("sqlite", Path(public))
    base = database.url[len("sqlite:///"):]
    run_as(other_user, PLANT_LINK, base + groupsync.SUFFIX,
           str(precious if suffix == groupsync.SUFFIX else missing))
    run_as(other_user, PLANT_LINK, base + hostlock.SUFFIX,
           str(missing if suffix == groupsync.SUFFIX else precious))
    config = database.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 0.2\n")
    queue = database.queue()
    task_id = queue.add_task(ECHO)
    result = taskrunner("runner", "--burst", config=config, timeout=60)
    queue.close()
    assert result.returncode == 0, result.stderr
    assert Task.get_by_id(task_id).last_status == SUCCESS
    assert precious.read_bytes() == b"precious"
    assert not missing.exists()


def test_a_database_in_a_directory_others_may_write_is_reported(public):
    """Whoever may write the database's directory may replace the database or plant its
    -wal and -shm files (which SQLite maps): said once, with what to do."""
    database = Database("sqlite", Path(public))
    result = taskrunner("add", ECHO, url=database.url, process=True)
    assert result.returncode == 0, result.stderr
    assert "writable by other users" in result.stderr, result.stderr


@pytest.mark.parametrize("where, mode, used", [
    ("public", "666", False),     # anyone's directory: another user's file is never used
    ("public", "600", False),
    ("group", "660", True),       # a setgid group directory: a member's file, closed to others
    ("group", "666", False),      # ... but not one everyone may write
])
def test_a_file_beside_the_database_is_used_only_when_trusted(other_user, request, where,
                                                               mode, used):
    """A file another user made beside the database is used only where they are trusted on
    purpose (a setgid group directory, as its group's member), and never when everyone may
    write it."""
    directory = Path(tempfile.mkdtemp(prefix="trdb-"))
    request.addfinalizer(lambda: subprocess.run(["rm", "-rf", str(directory)], check=False))
    if where == "group":
        os.chown(directory, 0, other_user.pw_gid)
        os.chmod(directory, 0o2770)
    else:
        os.chmod(directory, 0o1777)
    path = str(directory / ("queue.db" + groupsync.SUFFIX))
    run_as(other_user, "os.umask(0)\n" + PLANT_FILE.replace("0o666", "0o" + mode), path)
    if used:
        os.close(runtimedir.open_own_file(path, os.O_RDWR))
    else:
        with pytest.raises(runtimedir.RefusedFile):
            runtimedir.open_own_file(path, os.O_RDWR)
    assert os.stat(path).st_size == 0
