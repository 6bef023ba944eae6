"""Handlers of test_group_sync.py: they look at the runner's shared WAL sync from inside a
run, or hold its locks the way a runner in the middle of a sync does."""
import fcntl
import json
import os
import signal

from taskrunner import TaskHandler
from taskrunner.host.groupsync import SUFFIX


def _append(path, record):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


class SyncedAtStart(TaskHandler):
    """Records, as the run starts, the ticket of its runner's latest commit (the claim of
    this run) and how far the WAL is known durable."""

    def handle(self, run):
        sync = run.queue.store.group_sync
        written, synced, _ = sync.counters()
        _append(run.data["log"], {"task": run.task_id, "pid": os.getpid(),
                                  "ticket": sync.last_ticket, "synced": synced,
                                  "written": written})


class HoldSyncLocks(TaskHandler):
    """Takes the shared sync's flush lock and counters' lock on a descriptor of its own (as
    a runner does in the middle of an fdatasync), says so, and waits to be killed."""

    def handle(self, run):
        fd = os.open(run.queue.store.db.database + SUFFIX, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
        _append(run.data["log"], {"held_by": os.getpid()})
        while True:
            signal.pause()
