"""Chunk tasks of test_chunks: each call appends one line to a file (the pid, the ids of its
chunk, the time), outside the database, so a test counts calls and what each one took."""
import json
import os
import time

from taskrunner import TaskError
from taskrunner.chunks import Chunk, ChunkHandler
from taskrunner.functions import task


def record(path, line):
    with open(path, "a") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def calls(path):
    """[(pid, [task ids], time.time() of the call)] of the calls recorded in `path`."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [tuple(json.loads(line)) for line in fh if line.strip()]


@task(chunk=5, chunk_within="1s", max_attempts=3, retry_backoff=0)
def index(chunk: Chunk) -> list:
    """Records the call; an item with fail=true fails alone (on its first attempt), an item
    with gate=PATH holds the call until that file exists."""
    log = chunk[0].args["log"]
    record(log, json.dumps([os.getpid(), [item.task_id for item in chunk], time.time()]))
    for item in chunk:
        gate = item.args.get("gate")
        if gate:
            record(gate + ".started", str(os.getpid()))
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        if item.args.get("fail") and item.attempt == 1:
            item.fail(TaskError("no such document", code="NoDocument"))
    record(log + ".done", json.dumps([os.getpid(), [item.task_id for item in chunk
                                                     if item.failure is None]]))
    return [{"n": item.args.get("n")} for item in chunk]


@task(chunk=3)
def failing(chunk: Chunk) -> None:
    raise ValueError("the index is down")


class Count(ChunkHandler):
    """A class handler: each task's result is the chunk's size."""
    chunk_size = 4

    def handle_chunk(self, chunk):
        for item in chunk:
            item.results = len(chunk)


class TwoResults(ChunkHandler):
    """Returns two results whatever the chunk's size."""
    chunk_size = 3

    def handle_chunk(self, chunk):
        return [1, 2]
