"""Chunks: a handler that takes up to ``chunk_size`` tasks of its kind in one call — or what
arrived within ``chunk_within`` of the first — and ends each with its own outcome (Oban Pro's
Chunk worker, Celery's batches). One task may fail, and be retried alone under its own
``max_attempts``, while the others succeed.

Not the runner's ``[runner] batch`` (runner/batches.py), which claims several runs and
calls the handler once for each: here the handler is called once for many tasks.

The face: `ChunkHandler` (a class handler with ``handle_chunk(chunk)``), or ``@task(chunk=N,
chunk_within=SPAN)`` on a function that takes the `Chunk` (functions.py builds the
ChunkHandler). What a handler receives: a `Chunk`, a list of `ChunkItem` — one per task,
with its ``task_id``, ``run_id``, ``attempt`` and ``args`` — that can report progress for all
of them and says when to stop. A chunk handler's tasks go to a queue of their own (its
``queue``, by default its name): the runner fills a chunk with a claim of several runs of
that queue (runner/chunks.py says how, and what the rules become).
"""
from typing import Any, Callable, Iterable, List, Optional

from .errors import InputError, TaskError
from .handler import TaskHandler
from .timespan import parse_timespan


class ChunkItem:
    """One task of a chunk: ``task_id``, ``run_id``, ``attempt`` and ``args`` (its data:
    for a function task, its arguments by name). Set ``results`` (any JSON value) to store
    it as this task's result; call ``fail(error)`` to end this task alone as failed."""

    __slots__ = ("run_id", "task_id", "attempt", "args", "results", "failure")

    def __init__(self, run_id: int, task_id: int, attempt: int, args: Any) -> None:
        self.run_id, self.task_id, self.attempt, self.args = run_id, task_id, attempt, args
        self.results: Any = None
        self.failure: Optional[BaseException] = None

    def __repr__(self) -> str:
        return "<chunk item: task %d, run %d>" % (self.task_id, self.run_id)

    def fail(self, error: Any) -> None:
        """End this task's run as if its handler had raised `error` (an exception, or a
        message for a `TaskError`): ``error`` and a retry under its own max_attempts; a
        `TaskError` with ``retry=False`` gives it up, a `Retry` snoozes it. The other tasks of
        the chunk keep their own outcomes."""
        if isinstance(error, str):
            error = TaskError(error)
        if not isinstance(error, BaseException):
            raise TypeError("ChunkItem.fail() takes an exception or a message, not %r"
                            % (error,))
        self.failure = error


class Chunk(List[ChunkItem]):
    """The tasks a chunk handler receives, oldest first in the claim order: a list of
    `ChunkItem`. ``progress(percent)`` stores it for every task of the chunk (and proves
    them alive, as ``run.progress`` does); ``should_stop()`` and ``stop_reason`` as on a
    run."""

    def __init__(self, items: Iterable[ChunkItem],
                 report: Optional[Callable[[int], None]] = None,
                 stop_reason: Optional[Callable[[], Optional[str]]] = None) -> None:
        super().__init__(items)
        self._report, self._stop_reason = report, stop_reason

    def progress(self, percent: float) -> None:
        if self._report is not None:
            self._report(max(0, min(100, int(percent))))

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the handler is asked to stop (``"term"``, ``"hup"``, ``"timeout"``, ...), or
        None."""
        return self._stop_reason() if self._stop_reason is not None else None

    def should_stop(self) -> bool:
        return self.stop_reason is not None


class ChunkHandler(TaskHandler):
    """A handler that takes its tasks in chunks: implement ``handle_chunk(self, chunk)``.

    ``chunk_size``: the most tasks in one call; ``chunk_within`` (seconds): how long a runner
    that has claimed fewer waits for more before it calls with what it has (0: never).
    ``handle_chunk`` returns None (every task succeeds, with the ``results`` set on its item)
    or a list of one result per task, in order; raising fails every task of the chunk (each
    retried under its own max_attempts); ``item.fail(error)`` fails one. ``on_failure(item,
    exc)`` is called for each task that failed.

    ``queue``: its tasks' queue, by default the handler's path — a queue of its own, which
    runners serving ``default`` serve unless it is configured."""

    chunk_size: int = 100
    chunk_within: float = 0.0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("queue") is None:
            cls.queue = "%s.%s" % (cls.__module__, cls.__qualname__)

    def handle_chunk(self, chunk: Chunk) -> Optional[List[Any]]:
        raise NotImplementedError("%s.handle_chunk(chunk) is not implemented"
                                  % type(self).__name__)

    def handle(self, run: Any) -> None:
        raise TaskError("%s takes its tasks in chunks: a runner calls handle_chunk"
                        % type(self).__name__, retry=False)


def chunk_options(name: str, size: Any, within: Any) -> "tuple[int, float]":
    """(size, within in seconds) of a chunk handler, or InputError naming what is wrong."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InputError("%s: chunk must be a whole number of tasks >= 1, not %r"
                         % (name, size))
    try:
        seconds = parse_timespan(within if within is not None else 0)
    except ValueError as exc:
        raise InputError("%s: chunk_within: %s" % (name, exc)) from None
    return size, seconds


def results_of_chunk(chunk: Chunk, value: Any) -> None:
    """Set each item's results from what handle_chunk returned (None: as the items were
    set); InputError when it is neither None nor one result per task."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or len(value) != len(chunk):
        raise InputError("handle_chunk returned %s for a chunk of %d tasks: return None or "
                         "a list of one result per task" % (
                             "%d results" % len(value) if isinstance(value, (list, tuple))
                             else type(value).__name__, len(chunk)))
    for item, result in zip(chunk, value):
        item.results = result


__all__ = ["Chunk", "ChunkItem", "ChunkHandler"]
