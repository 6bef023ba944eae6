"""A full disk, a read-only database and a missing directory each get an error that names
the cause, and nothing acknowledged is lost. The full disk is a real one: a 1 MB tmpfs
(mounting needs root; outside CI the test is skipped when mounting is not permitted)."""
import os
import subprocess

import pytest

from taskrunner import TaskQueue

from conftest import databases_required, taskrunner, usage_error

ECHO = "taskrunner.handlers.Echo"


def _mount(*args):
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs, unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        result = _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where))
    except OSError as exc:
        result = subprocess.CompletedProcess([], 1, "", str(exc))
    if result.returncode != 0:
        reason = "cannot mount a tmpfs here: %s" % result.stderr.strip()
        if databases_required():
            pytest.fail(reason + " (required in CI)")
        pytest.skip(reason)
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory):
    """Write a file until the file system is full."""
    with open(directory / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                fh.write(b"\0" * 512)
        except OSError:
            pass


def test_a_full_disk_names_the_cause_and_loses_nothing_acknowledged(small_disk):
    url = "sqlite:///%s" % (small_disk / "taskrunner.db")
    queue = TaskQueue(url, migrate=True)     # stays open: its -wal and -shm files stay too
    acknowledged = [queue.add_task(ECHO, data={"n": n}) for n in range(3)]
    fill(small_disk)
    refused = 0
    for n in range(40):     # until a write needs a page the disk no longer has
        try:
            acknowledged.append(queue.add_task(ECHO, data={"n": n, "pad": "x" * 20000}))
        except Exception as exc:  # the database error, whatever class the driver gives it
            assert "database or disk is full" in str(exc), repr(exc)
            refused += 1
            break
    assert refused, "the disk never filled up"
    result = taskrunner("add", ECHO, "--data", '{"pad": "%s"}' % ("y" * 20000), url=url)
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "no space left on the file system of %s" % small_disk in lines[0]
    assert result.stdout == ""
    os.unlink(small_disk / "filler")
    stored = sorted(task.id for task in queue.tasks(limit=1000))
    assert stored == sorted(acknowledged)
    assert queue.store.db.execute_sql("PRAGMA integrity_check").fetchone()[0] == "ok"
    queue.add_task(ECHO)           # and it works again once there is room
    queue.close()


def test_a_read_only_database_names_the_cause(small_disk):
    url = "sqlite:///%s" % (small_disk / "taskrunner.db")
    with TaskQueue(url, migrate=True) as queue:
        task_id = queue.add_task(ECHO)
    assert _mount("-o", "remount,ro", str(small_disk)).returncode == 0
    try:
        usage_error(taskrunner("add", ECHO, url=url), "%s is read-only" % (small_disk / "taskrunner.db"))
    finally:
        assert _mount("-o", "remount,rw", str(small_disk)).returncode == 0
    assert [t.id for t in TaskQueue(url).tasks()] == [task_id]


def test_a_missing_directory_names_it(tmp_path):
    url = "sqlite:///%s" % (tmp_path / "no" / "such" / "taskrunner.db")
    usage_error(taskrunner("add", ECHO, url=url),
                "the directory %s does not exist" % (tmp_path / "no" / "such"))
    assert not (tmp_path / "no").exists()


def test_a_directory_where_the_file_should_be_names_it(tmp_path):
    usage_error(taskrunner("check", url="sqlite:///%s" % tmp_path),
                "%s is a directory" % tmp_path)

