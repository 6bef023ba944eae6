"""For the tests of applications that use taskrunner: a queue in a file of the test's own,
where function tasks go, and `run_all`, which runs what was enqueued — and what that adds —
in-process, through the real store, with durable sleeps, retry backoffs and event timeouts
fast-forwarded (docs: "Testing your tasks")::

    from taskrunner.testing import run_all, task_queue

    def test_receipt(tmp_path):
        with task_queue(tmp_path / "tasks.db") as queue:
            handle = send_receipt.enqueue(42)
            run_all(queue)
            assert handle.result() == {"sent": 42}
"""
import contextlib
import os
from datetime import datetime, timedelta, timezone
from typing import Iterator, Optional, Union

from .api import TaskQueue
from .config import Config
from .functions import use_queue
from .store.models import as_utc

# run_all's bound on passes (each runs everything due, then moves the clock on): a task that
# sleeps in a loop for ever ends the test instead of hanging it.
MAX_PASSES = 1000


@contextlib.contextmanager
def task_queue(path: Union[str, "os.PathLike[str]"], **config: dict) -> Iterator[TaskQueue]:
    """A `TaskQueue` on a new SQLite database at `path` (a file in the test's temporary
    directory), migrated, and where function tasks are enqueued while the block runs.
    `config`: sections of the configuration, e.g. ``task={"max_retries": 2}``."""
    sections = {key: dict(value) for key, value in config.items()}
    sections["database"] = dict(sections.get("database", {}), url="sqlite:///%s" % os.fspath(
        path))
    queue = TaskQueue(Config.from_dict(sections, source="taskrunner.testing"), migrate=True)
    before = use_queue(queue)
    try:
        yield queue
    finally:
        use_queue(before)
        queue.close()


def run_all(queue: TaskQueue, now: Optional[datetime] = None,
            max_passes: int = MAX_PASSES) -> int:
    """Run every task that is due — and the tasks they add, their retries, and the tasks
    that wait for them — in this process, until nothing is left but tasks that wait for an
    event nobody sent (send it, then call this again); returns how many runs were executed.
    Time is fast-forwarded: a durable sleep, a retry's backoff, a delay or an event's
    timeout ends at once, as if the clock had moved to it (`now`: where the clock starts,
    aware; the present by default). Runs exactly as a runner would, through the real
    store: steps, checkpoints and the rules hold as in production."""
    clock = as_utc(now or datetime.now(timezone.utc))
    done = 0
    for _ in range(max_passes):
        ran = queue.run_pending(now=clock.replace(tzinfo=timezone.utc))
        done += ran
        if ran:
            continue
        following = _next_due(queue)
        if following is None:
            return done
        clock = max(clock, following) + timedelta(microseconds=1)
    raise RuntimeError("run_all: still running after %d passes (a task that never ends?)"
                       % max_passes)


def _next_due(queue: TaskQueue) -> Optional[datetime]:
    """When the next unfinished task becomes due (naive UTC), or None."""
    Task = queue.store.Task
    row = (Task.select(Task.next_run_on).where(Task.finished_on.is_null()
                                               & Task.next_run_on.is_null(False))
           .order_by(Task.next_run_on).first())
    return None if row is None else row.next_run_on


__all__ = ["task_queue", "run_all"]
