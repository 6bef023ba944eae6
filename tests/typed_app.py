"""A small application on taskrunner's public API, type-checked by `mypy --strict` in
test_api.py: it must pass without a cast or an ignore."""
from datetime import datetime, timedelta, timezone
from typing import List, Optional

from taskrunner import (Chunk, ChunkHandler, ChunkTask, RunContext, RunInfo, TaskError,
                        TaskHandle, TaskHandler, TaskInfo, TaskOutcome, TaskQueue, WaitTimeout,
                        task)


class SendDigest(TaskHandler):
    def handle(self, run: RunContext) -> None:
        users = run.data["users"]
        for index, user in enumerate(users):
            if run.should_stop():
                raise TaskError("stopped at user %s" % user, code="Stopped")
            run.progress(100 * index / len(users))
        run.results = {"sent": len(users)}
        run.queue.add_task("typed_app.SendDigest", {"users": []}, queued_by="task %d" % run.task_id)
        deadline: Optional[datetime] = run.deadline
        if deadline is not None and deadline < datetime.now(timezone.utc):
            raise TaskError("too late")


class Notify(TaskHandler):
    async def handle(self, run: RunContext) -> None:
        run.results = {"notified": run.data["who"]}

    def on_failure(self, run: RunContext, exc: BaseException) -> None:
        print("run %d failed: %r" % (run.id, exc))

    def on_give_up(self, task: TaskInfo) -> None:
        print("task %d gave up: %s" % (task.id, task.last_traceback))


@task(chunk=50, chunk_within="2s", max_attempts=3)
def index_documents(chunk: Chunk) -> None:
    for item in chunk:
        if item.args["doc_id"] < 0:
            item.fail(TaskError("no such document", code="NoDocument"))
        item.results = {"indexed": item.args["doc_id"], "attempt": item.attempt}
    chunk.progress(100)


class CountChunk(ChunkHandler):
    chunk_size = 10

    def handle_chunk(self, chunk: Chunk) -> List[int]:
        return [len(chunk) for _ in chunk] if not chunk.should_stop() else [0] * len(chunk)


def index_one(doc_id: int) -> int:
    chunked: ChunkTask = index_documents
    handle: TaskHandle[object] = chunked.enqueue(doc_id=doc_id)
    return handle.id


def outcome_of(queue: TaskQueue, task_id: int) -> str:
    try:
        outcome: TaskOutcome = queue.wait(task_id, timeout=1.5)
    except WaitTimeout:
        return "still going"
    return "%s %r %s" % (outcome.status, outcome.results, outcome.ok)


def queue_digest(queue: TaskQueue, users: List[int]) -> int:
    later = datetime.now(timezone.utc) + timedelta(minutes=5)
    return queue.add_task("typed_app.SendDigest", {"users": users}, scheduled_on=later,
                          priority=5, max_retries=3, unique_key="digest", queued_by="web",
                          queue="mail")


def report(queue: TaskQueue, task_id: int) -> str:
    task: TaskInfo = queue.get_task(task_id)
    runs: List[RunInfo] = queue.runs_of(task_id)
    finished = task.finished_on.isoformat() if task.finished_on else "not yet"
    last = runs[-1].results if runs else None
    return "%s %s %s %r" % (task.handler, task.status, finished, last)


def main() -> None:
    with TaskQueue("sqlite:///app.db", migrate=True) as queue:
        task_id = queue_digest(queue, [1, 2, 3])
        ids: List[int] = queue.add_tasks([{"handler": "typed_app.SendDigest",
                                           "data": {"users": [n]}} for n in range(3)])
        paused: bool = queue.pause_queue("mail")
        lags = [(q.name, q.paused, q.lag) for q in queue.queues()]
        queue.resume_queue("mail")
        done: int = queue.run_pending(max_runs=10, now=datetime.now(timezone.utc))
        print(paused, lags, outcome_of(queue, task_id))
        print(report(queue, task_id), ids, done, queue.tasks(status="given-up", limit=5))
        if queue.get_task(task_id).given_up:
            queue.retry(task_id)
        else:
            stopping: Optional[int] = queue.cancel(task_id)
            print(stopping)
