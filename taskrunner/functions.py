"""Function tasks: the face every queue our users come from has — ``@task`` on a plain or
``async`` function, ``fn.enqueue(...)`` with the function's own arguments, a handle to wait
on — over the same engine as class handlers.

- ``@task`` registers nothing in a table of its own: a function task is named by its import
  path (``shop.tasks.send_receipt``), stored in the task's ``handler`` column, and found by a
  runner as any handler is (handler.load_handler, under ``[handlers] allow``): the object at
  that path carries the `TaskHandler` class that runs it (``__taskrunner_handler__``).
- The arguments are bound to the signature and checked for JSON at enqueue; the task's data
  is the bound arguments by parameter name (``{"order_id": 42}``), which reads well in every
  listing and is searchable.
- A function whose first parameter is annotated `RunContext` gets the run (steps,
  checkpoints, sleep, events); it is not one of the arguments given at enqueue.
- Inside a running task, ``enqueue`` (and a workflow's) adds its tasks **exactly once**: in
  the transaction that records it as a step of the running task (`RunContext.add_once`),
  named by the function and a digest of its arguments, so an attempt that replays after a
  crash gets the same handles for the same calls, in whatever order it makes them, and
  adds nothing. A handle's
  ``result()`` there waits durably (`RunContext.wait_for_tasks`), holding no runner.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import sys
import threading
import typing
from typing import (Any, Awaitable, Callable, Coroutine, Dict, Generic, Iterable, List,
                    Mapping, Optional, Sequence, Tuple, TypeVar, Union, overload)

from .chunks import Chunk, ChunkHandler, chunk_options
from .config import check_queue_name, one_count_of_runs
from .errors import InputError, TaskError
from .handler import Queue, RunContext, TaskHandler, current_run

if sys.version_info >= (3, 10):
    from typing import Concatenate, ParamSpec
    P = ParamSpec("P")
else:  # Python 3.9: the annotations are strings; the types are checked on newer Pythons
    P = TypeVar("P")
R = TypeVar("R")

if typing.TYPE_CHECKING:
    from .api import TaskQueue
    from .reads.records import TaskInfo, TaskOutcome
    from .reads.workflows import WorkflowInfo

# The options a task takes on its decorator, each also given per call with ``using``.
TASK_OPTIONS = ("queue", "priority", "max_attempts", "max_retries", "retry", "timeout",
                "max_runtime", "retry_backoff", "concurrency_key", "concurrency_limit",
                "rate_key", "unique_key", "tenant", "debounce", "debounce_key", "debounce_max",
                "debounce_keep")
# The options of a task that takes its tasks in chunks (chunks.py): on the decorator only.
CHUNK_OPTIONS = ("chunk", "chunk_within")
# The options of one call alone.
CALL_OPTIONS = ("delay", "run_after", "after", "on_parent_failure", "connection", "on",
                "queued_by")
# The keys options that take the call's arguments: "order-{order_id}".
FORMATTED = ("concurrency_key", "rate_key", "unique_key", "tenant", "debounce_key")
# Reserved keys of a function task's data: the parameter that gets the result of the task it
# runs after (a chain), or the list of results of the tasks it runs after (a group's `then`).
PREVIOUS, ALL_PARENTS = "$previous", "$parents"


class TaskFailed(TaskError):
    """`TaskHandle.result()` of a task that ended without success (given up or cancelled),
    with how (``status``, ``error_code``, ``error_message``). Inside a task that lets it
    through, no retry can help — a later attempt reads the same ending — so the task gives
    up at once (``retry=False``)."""

    def __init__(self, task_id: int, name: str, status: str, error_code: Optional[str],
                 error_message: Optional[str]) -> None:
        super().__init__("task %d (%s) ended %s%s" % (
            task_id, name, status, ": %s: %s" % (error_code, error_message)
            if error_code else ""), code="TaskFailed", retry=False)
        self.task_id, self.status = task_id, status
        self.error_code, self.error_message = error_code, error_message


# -- which database --------------------------------------------------------------------------

_default_lock = threading.Lock()
_default: Optional["TaskQueue"] = None


def use_queue(queue: Optional["TaskQueue"]) -> Optional["TaskQueue"]:
    """Make `queue` (a `TaskQueue`) where function tasks are enqueued from this process when
    no run is executing and no call names one (``using(on=...)``); returns the one before.
    Without it, the first enqueue opens ``TaskQueue()``: $TASKRUNNER_CONFIG,
    $TASKRUNNER_DATABASE_URL or the defaults, as the ``taskrunner`` command does."""
    global _default
    with _default_lock:
        before, _default = _default, queue
    return before


def _queue_for(on: Optional["TaskQueue"]) -> Tuple[Queue, Optional[RunContext]]:
    """(the TaskQueue to add to, the run whose step records the add, or None)."""
    global _default
    run = current_run()
    if on is None and run is not None and run.queue is not None:
        return run.queue, run
    if on is not None:
        return on, run if run is not None and run.queue is on else None
    with _default_lock:
        if _default is None:
            from .api import TaskQueue
            _default = TaskQueue()
        return _default, None


# -- the decorator ---------------------------------------------------------------------------

class FunctionTask(Generic[P, R]):
    """A function registered by ``@task``: call it as the plain function, or ``enqueue`` it.

    ``name``: its import path, the task's name everywhere (CLI, dashboard, metrics).
    ``using(**options)``: the same task with options for one call (`TASK_OPTIONS` and
    ``delay``, ``run_after``, ``after``, ``on_parent_failure``, ``connection``, ``on``).
    ``s(*args, **kwargs)``: a call for `chain` and `group`."""

    def __init__(self, fn: Callable[..., Any], options: Dict[str, Any]) -> None:
        self.fn = fn
        self.options = options
        self.name = "%s.%s" % (fn.__module__, fn.__qualname__)
        self.takes_context = _takes_context(fn)
        signature = inspect.signature(fn)
        parameters = list(signature.parameters.values())
        self.signature = signature.replace(
            parameters=parameters[1:] if self.takes_context else parameters)
        self.is_async = inspect.iscoroutinefunction(fn)
        # Every parameter may be given by name: the stored arguments are the call's keywords
        # as they are (the runner's path for most functions, without rebuilding the call).
        self.by_name = all(parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                              inspect.Parameter.KEYWORD_ONLY)
                           for parameter in self.signature.parameters.values())
        self.__taskrunner_handler__ = self._handler_class()
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__
        self.__qualname__, self.__module__ = fn.__qualname__, fn.__module__
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return "<function task %s>" % self.name

    def _handler_class(self) -> type:
        return _handler_class(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The plain function, called here and now."""
        return self.fn(*args, **kwargs)

    def using(self, **options: Any) -> "FunctionTask[P, R]":
        """This task with `options` for the calls made through it (the decorator's are
        kept where not given)."""
        unknown = set(options) - set(TASK_OPTIONS) - set(CALL_OPTIONS)
        if unknown:
            raise InputError("%s.using(): unknown option %s" % (self.name, ", ".join(
                sorted(unknown))))
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        inherited = dict(self.options)
        if {"max_attempts", "max_retries"} & set(options):
            # One count by two names: the call's replaces the decorator's, whichever it used.
            inherited.pop("max_attempts", None)
            inherited.pop("max_retries", None)
        other.options = dict(inherited, **options)
        return other

    # -- enqueue --------------------------------------------------------------------------

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> "TaskHandle[R]":
        """Queue a run of the function with these arguments; returns its handle. The
        arguments are checked against the signature and for JSON first: a wrong one is an
        `InputError` naming it, and nothing is stored. Inside a running task, exactly once
        (see the module's docstring)."""
        data = self.data_of(args, kwargs)
        queue, run = _queue_for(self.options.get("on"))
        row = self._row_options(data)
        connection = self.options.get("connection")
        if run is not None and connection is None:
            task_id = run.add_once("%s:%s" % (self.name, _digest([data, row])),
                                   lambda: [queue.add_task(self.name, data, **row)])[0]
        else:
            task_id = queue.add_task(self.name, data, connection=connection, **row)
        return TaskHandle(int(task_id), queue, self.name)

    async def enqueue_async(self, *args: P.args, **kwargs: P.kwargs) -> "TaskHandle[R]":
        """`enqueue`, awaitable: the statements run in the queue's thread (``connection``:
        a psycopg ``AsyncConnection`` whose transaction the task joins)."""
        queue, run = _queue_for(self.options.get("on"))
        if run is not None:
            # A handler's own connection, on the runner's thread: one short write.
            return self.enqueue(*args, **kwargs)
        data = self.data_of(args, kwargs)
        row = self._row_options(data)
        task_id = await queue.add_task_async(self.name, data,
                                             connection=self.options.get("connection"), **row)
        return TaskHandle(int(task_id), queue, self.name)

    def s(self, *args: Any, **kwargs: Any) -> "Call":
        """This task with these arguments, to be added by `chain` or `group` (checked
        there). In a chain it also receives the result of the task before it as its first
        argument, and after a group (``group(...).then(...)``) the list of the group's
        results; ``si`` receives nothing."""
        return Call(self, args, kwargs, receives=True)

    def si(self, *args: Any, **kwargs: Any) -> "Call":
        """As `s`, receiving nothing from the tasks it runs after."""
        return Call(self, args, kwargs, receives=False)

    def data_of(self, args: Sequence[Any], kwargs: Mapping[str, Any],
                receives: Optional[str] = None) -> Dict[str, Any]:
        """The task data of a call: its arguments bound to the signature, by name, each
        checked for JSON; InputError naming what is wrong. `receives` (PREVIOUS or
        ALL_PARENTS): the first argument is left for the parents' results."""
        filler = object()
        try:
            bound = self.signature.bind(*((filler,) + tuple(args) if receives else args),
                                        **kwargs)
        except TypeError as exc:
            raise InputError("%s(): %s" % (self.name, exc)) from None
        data: Dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if value is filler:
                if self.signature.parameters[name].kind not in (
                        inspect.Parameter.POSITIONAL_ONLY,
                        inspect.Parameter.POSITIONAL_OR_KEYWORD):
                    raise InputError("%s(): the result it receives needs a first parameter "
                                     "of its own" % self.name)
                data[receives] = name     # type: ignore[index]
                continue
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:
                raise InputError("%s(): argument %r is not JSON-serialisable: %s"
                                 % (self.name, name, exc)) from None
            data[name] = value
        return data

    def check_data(self, data: Any) -> None:
        """InputError unless `data` is arguments of this function by name (what
        `data_of` makes; ``taskrunner add NAME --data`` must give the same)."""
        if not isinstance(data, dict):
            raise InputError("%s: the task data must be a JSON object of the function's "
                             "arguments by name, not %s" % (self.name, json.dumps(data)))
        given = {key: value for key, value in data.items()
                 if key not in (PREVIOUS, ALL_PARENTS)}
        for key in (PREVIOUS, ALL_PARENTS):
            if key in data:
                if data[key] not in self.signature.parameters:
                    raise InputError("%s: %s names no parameter: %r" % (self.name, key,
                                                                        data[key]))
                given[data[key]] = None
        try:
            args, kwargs = _arguments(self.signature, given)
            self.signature.bind(*args, **kwargs)
        except (InputError, TypeError) as exc:
            raise InputError("%s(): %s" % (self.name, exc)) from None

    def _row_options(self, data: Mapping[str, Any]) -> Dict[str, Any]:
        """add_task's options from this task's and this call's options."""
        options = self.options
        row: Dict[str, Any] = {}
        for key in ("queue", "priority", "max_runtime", "retry_backoff",
                    "concurrency_limit", "on_parent_failure", "queued_by", "delay",
                    "debounce", "debounce_max", "debounce_keep"):
            if options.get(key) is not None:
                row[key] = options[key]
        runs = one_count_of_runs(options.get("max_retries"), options.get("max_attempts"),
                                 "%s: " % self.name)
        if options.get("retry") is False:
            if runs not in (None, 1):
                raise InputError("%s: retry=False and max_attempts=%r contradict each other"
                                 % (self.name, runs))
            runs = 1
        if runs is not None:
            row["max_attempts"] = runs
        if options.get("timeout") is not None:
            row["run_timeout"] = options["timeout"]
        if options.get("run_after") is not None:
            row["scheduled_on"] = options["run_after"]
        for key in FORMATTED:
            value = options.get(key)
            if value is not None:
                row[key] = _formatted(self.name, key, value, data)
        after = options.get("after")
        if after is not None:
            row["after"] = [int(parent) for parent in (
                after if isinstance(after, (list, tuple)) else [after])]
        return row

    # -- the run ----------------------------------------------------------------------------

    def call_in(self, run: RunContext) -> Any:
        """Call the function for `run`: its arguments from the task's data (and its parents'
        results, when it receives them); returns its value or, for an async function, a
        coroutine that stores it."""
        if not isinstance(run.data, dict):
            raise InputError("%s: task data must be the arguments by name, not %r"
                             % (self.name, run.data))
        data = run.data
        if PREVIOUS in data or ALL_PARENTS in data:
            data = dict(data)
            if PREVIOUS in data:
                data[data.pop(PREVIOUS)] = next(iter(run.parent_results.values()), None)
            if ALL_PARENTS in data:
                data[data.pop(ALL_PARENTS)] = list(run.parent_results.values())
        if self.by_name and data.keys() <= self.signature.parameters.keys():
            args: List[Any] = []
            kwargs = data
        else:
            args, kwargs = _arguments(self.signature, data)
        if self.takes_context:
            return self.fn(run, *args, **kwargs)
        return self.fn(*args, **kwargs)


class ChunkTask(FunctionTask[..., Any]):
    """A function task that takes its tasks in chunks (``@task(chunk=N, chunk_within=...)``,
    chunks.py): the function's one parameter receives a `Chunk`, and each task is enqueued
    on its own, with keyword arguments (JSON), which its item's ``args`` holds. Its queue
    is its own: the decorator's ``queue``, else its name."""

    def __init__(self, fn: Callable[..., Any], options: Dict[str, Any]) -> None:
        name = "%s.%s" % (fn.__module__, fn.__qualname__)
        self.chunk_size, self.chunk_within = chunk_options(
            name, options.get("chunk"), options.get("chunk_within"))
        self.queue = check_queue_name(options.get("queue") or name, "%s's queue (a chunk "
                                      "task's own: name one with queue=)" % name)
        if len(inspect.signature(fn).parameters) != 1:
            raise TypeError("@task(chunk=...): %s must take one parameter, the chunk of "
                            "tasks" % name)
        super().__init__(fn, options)
        self.takes_context = False

    def __repr__(self) -> str:
        return "<chunk task %s>" % self.name

    def using(self, **options: Any) -> "ChunkTask":
        if "queue" in options:
            raise InputError("%s.using(): a chunk task's queue is set on @task" % self.name)
        return typing.cast(ChunkTask, super().using(**options))

    def enqueue(self, *args: Any, **kwargs: Any) -> "TaskHandle[Any]":
        """Queue one task of the chunk function, with keyword arguments (each JSON)."""
        return super().enqueue(*args, **kwargs)

    def data_of(self, args: Sequence[Any], kwargs: Mapping[str, Any],
                receives: Optional[str] = None) -> Dict[str, Any]:
        if args or receives:
            raise InputError("%s(): a chunk task takes its arguments by name" % self.name)
        for name, value in kwargs.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as exc:
                raise InputError("%s(): argument %r is not JSON-serialisable: %s"
                                 % (self.name, name, exc)) from None
        return dict(kwargs)

    def check_data(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise InputError("%s: the task data must be a JSON object of arguments by "
                             "name, not %s" % (self.name, json.dumps(data)))

    def _row_options(self, data: Mapping[str, Any]) -> Dict[str, Any]:
        return dict(super()._row_options(data), queue=self.queue)

    def _handler_class(self) -> type:
        chunk_task = self

        class FunctionChunkHandler(ChunkHandler):
            queue = chunk_task.queue
            chunk_size, chunk_within = chunk_task.chunk_size, chunk_task.chunk_within

            @classmethod
            def check_data(cls, data: Any) -> None:
                chunk_task.check_data(data)

            def handle_chunk(self, chunk: Chunk) -> Any:
                return chunk_task.fn(chunk)
        FunctionChunkHandler.__qualname__ = FunctionChunkHandler.__name__ = \
            "FunctionChunkHandler[%s]" % self.name
        FunctionChunkHandler.__module__ = self.fn.__module__
        return FunctionChunkHandler


class _Decorator(typing.Protocol):
    @overload
    def __call__(self, fn: Callable[Concatenate[RunContext, P], Coroutine[Any, Any, R]]
                 ) -> FunctionTask[P, R]: ...

    @overload
    def __call__(self, fn: Callable[Concatenate[RunContext, P], R]) -> FunctionTask[P, R]: ...

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]]) -> FunctionTask[P, R]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> FunctionTask[P, R]: ...


class _ChunkDecorator(typing.Protocol):
    def __call__(self, fn: Callable[[Chunk], Any]) -> ChunkTask: ...


@overload
def task(fn: Callable[Concatenate[RunContext, P], Coroutine[Any, Any, R]]
         ) -> FunctionTask[P, R]: ...


@overload
def task(*, chunk: int, chunk_within: Union[float, str, None] = None,
         **options: Any) -> _ChunkDecorator: ...


@overload
def task(fn: Callable[Concatenate[RunContext, P], R]) -> FunctionTask[P, R]: ...


@overload
def task(fn: Callable[P, Coroutine[Any, Any, R]]) -> FunctionTask[P, R]: ...


@overload
def task(fn: Callable[P, R]) -> FunctionTask[P, R]: ...


@overload
def task(*, queue: Optional[str] = None, priority: Optional[int] = None,
         max_attempts: Optional[int] = None, max_retries: Optional[int] = None,
         retry: bool = True,
         timeout: Union[float, str, None] = None, max_runtime: Union[float, str, None] = None,
         retry_backoff: Union[float, str, None] = None, concurrency_key: Optional[str] = None,
         concurrency_limit: Optional[int] = None, rate_key: Optional[str] = None,
         unique_key: Optional[str] = None, tenant: Optional[str] = None,
         debounce: Union[float, str, None] = None, debounce_key: Optional[str] = None,
         debounce_max: Union[float, str, None] = None,
         debounce_keep: Optional[str] = None) -> _Decorator: ...


def task(fn: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
    """Make a module-level function (plain or ``async``) a task, named by its import path.

    Bare (``@task``) or with options, each of which a call may override with ``using``:
    ``queue``; ``priority`` (higher first); ``max_attempts`` (runs in all, the first
    included, before it gives up; ``max_retries`` is the same count by its older name;
    ``retry=False``: one run, never retried); ``timeout`` (seconds or a span like "5min"
    without a sign of life before a run is timed out); ``max_runtime`` (a run's hard limit);
    ``retry_backoff``; ``concurrency_key`` with ``concurrency_limit``; ``rate_key``;
    ``unique_key``; ``tenant``; ``debounce`` (a span: calls within it of each other
    collapse into one task, run once they stop) with ``debounce_key`` (default: the task),
    ``debounce_max`` and ``debounce_keep`` (``"last"`` arguments, the default, or
    ``"first"``). The five keys may name the call's arguments:
    ``concurrency_key="order-{order_id}"``.

    A first parameter annotated `RunContext` receives the run: ``run.step``,
    ``run.checkpoint``, ``run.sleep``, ``run.wait_for``.

    ``chunk=N`` (with ``chunk_within``, a span): the function takes its tasks in chunks —
    its one parameter receives a `Chunk` of up to N tasks, each enqueued on its own with
    keyword arguments (a `ChunkTask`; chunks.py)."""
    unknown = set(options) - set(TASK_OPTIONS) - set(CHUNK_OPTIONS)
    if unknown:
        raise TypeError("@task: unknown option %s (options: %s)" % (
            ", ".join(sorted(unknown)), ", ".join(TASK_OPTIONS + CHUNK_OPTIONS)))
    if "chunk_within" in options and "chunk" not in options:
        raise InputError("@task: chunk_within needs chunk (the most tasks in one call)")

    def decorate(fn: Callable[..., Any]) -> FunctionTask[Any, Any]:
        if not callable(fn) or not hasattr(fn, "__qualname__"):
            raise TypeError("@task decorates a function, not %r" % (fn,))
        if "." in fn.__qualname__:
            raise TypeError("@task: %s is not a module-level function: a runner finds a task "
                            "by its import path, module.function" % fn.__qualname__)
        if "chunk" in options:
            return ChunkTask(fn, dict(options))
        return FunctionTask(fn, dict(options))
    if fn is not None:
        return decorate(fn)
    return decorate


def _takes_context(fn: Callable[..., Any]) -> bool:
    """Whether the function's first parameter is annotated `RunContext`."""
    parameters = list(inspect.signature(fn).parameters.values())
    if not parameters:
        return False
    first = parameters[0]
    annotation = first.annotation
    if isinstance(annotation, str):
        try:
            annotation = typing.get_type_hints(fn).get(first.name, annotation)
        except Exception:  # an annotation that does not resolve: judged by its text
            return annotation.rpartition(".")[2] == "RunContext"
    return isinstance(annotation, type) and issubclass(annotation, RunContext)


def _handler_class(function_task: FunctionTask[Any, Any]) -> type:
    """The TaskHandler that runs `function_task`: its return value becomes the run's
    results; an async function runs to completion in the runner's event loop."""

    class FunctionHandler(TaskHandler):
        queue = function_task.options.get("queue")

        @classmethod
        def check_data(cls, data: Any) -> None:
            function_task.check_data(data)

        def handle(self, run: RunContext) -> Optional[Awaitable[None]]:
            value = function_task.call_in(run)
            if function_task.is_async:
                return _store_result(run, value)
            run.results = value
            return None
    FunctionHandler.__qualname__ = FunctionHandler.__name__ = "FunctionHandler[%s]" % (
        function_task.name)
    FunctionHandler.__module__ = function_task.fn.__module__
    return FunctionHandler


async def _store_result(run: RunContext, coroutine: Awaitable[Any]) -> None:
    run.results = await coroutine


def _arguments(signature: inspect.Signature, data: Mapping[str, Any]
               ) -> Tuple[List[Any], Dict[str, Any]]:
    """(args, kwargs) of a call from its arguments by name (`FunctionTask.data_of`)."""
    args: List[Any] = []
    kwargs: Dict[str, Any] = {}
    positional = True
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            args.extend(data.get(name, ()))
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(data.get(name, {}))
        elif name not in data:
            positional = False
        elif positional and parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            args.append(data[name])
        else:
            kwargs[name] = data[name]
    unknown = set(data) - set(signature.parameters)
    if unknown:
        raise InputError("the task's data names no parameter of the function: %s"
                         % ", ".join(sorted(unknown)))
    return args, kwargs


def _digest(call: Any) -> str:
    """A short digest of a call's arguments and options: what tells one child of a running
    task from another when an attempt comes back to it."""
    text = json.dumps(call, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _formatted(name: str, key: str, value: Any, data: Mapping[str, Any]) -> Any:
    if not isinstance(value, str) or "{" not in value:
        return value
    try:
        return value.format(**data)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise InputError("%s: %s %r does not fit the call's arguments: %s"
                         % (name, key, value, exc)) from None


# -- handles ---------------------------------------------------------------------------------

class TaskHandle(Generic[R]):
    """A task that was enqueued: ``id`` (also its ``int()``), ``status`` (the word every
    face uses: scheduled, running, waiting, retrying, given-up, success, cancelled),
    ``wait(timeout)`` for its outcome and ``result(timeout)`` for its return value."""

    def __init__(self, task_id: int, queue: Queue, name: str = "") -> None:
        self.id, self.queue, self.name = task_id, queue, name

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return "<task %d %s>" % (self.id, self.name)

    def info(self) -> "TaskInfo":
        """The task as `TaskQueue.get_task` reads it."""
        return self.queue.get_task(self.id)

    @property
    def status(self) -> str:
        """Its status word, read from the task's row alone (a poll costs one read)."""
        return self.queue.status_of(self.id)

    def wait(self, timeout: Optional[float] = None) -> "TaskOutcome":
        """Block until the task has ended; its outcome (`TaskQueue.wait`)."""
        return self.queue.wait(self.id, timeout)

    def result(self, timeout: Optional[float] = None) -> R:
        """The function's return value once the task has succeeded; `TaskFailed` when it
        gave up or was cancelled. Outside a task it blocks (`WaitTimeout` after `timeout`
        seconds); inside a running task it waits durably, holding no runner (see
        `RunContext.wait_for_tasks`; `timeout` is not used there)."""
        return results_of([self], timeout)[0]

    def send_event(self, name: str, payload: Any = None) -> bool:
        """Send the event `name` to the task (`TaskQueue.send_event`): its
        ``run.wait_for(name)`` returns `payload`. Returns whether it was woken."""
        return self.queue.send_event(self.id, name, payload)

    async def wait_async(self, timeout: Optional[float] = None) -> "TaskOutcome":
        """`wait`, awaitable."""
        return await self.queue.wait_async(self.id, timeout)

    async def result_async(self, timeout: Optional[float] = None) -> R:
        """`result`, awaitable (outside a task)."""
        outcome = await self.queue.wait_async(self.id, timeout)
        return typing.cast(R, _value(self, outcome.status, outcome.results,
                                     outcome.error_code, outcome.error_message))


def results_of(handles: Iterable[TaskHandle[R]], timeout: Optional[float] = None) -> List[R]:
    """The return values of the tasks of `handles`, in order, once all have ended (a
    `TaskFailed` for the first that did not succeed). Inside a running task, one durable
    wait for all of them (`RunContext.wait_for_tasks`)."""
    handles = list(handles)
    if not handles:
        return []
    run = current_run()
    if run is not None and run.queue is not None and all(
            handle.queue is run.queue for handle in handles):
        ended = run.wait_for_tasks([handle.id for handle in handles])
        return [typing.cast(R, _value(handle, end["status"], end["results"],
                                      end["error_code"], end["error_message"]))
                for handle, end in zip(handles, ended)]
    values = []
    for handle in handles:
        outcome = handle.wait(timeout)
        values.append(typing.cast(R, _value(handle, outcome.status, outcome.results,
                                            outcome.error_code, outcome.error_message)))
    return values


def _value(handle: TaskHandle[Any], status: str, results: Any, code: Optional[str],
           message: Optional[str]) -> Any:
    if status != "success":
        raise TaskFailed(handle.id, handle.name or "task", status, code, message)
    return results


# -- workflows of function tasks -------------------------------------------------------------

class Call:
    """A function task with its arguments (`FunctionTask.s`), not added yet."""

    def __init__(self, task: FunctionTask[Any, Any], args: Sequence[Any],
                 kwargs: Mapping[str, Any], receives: bool) -> None:
        self.task, self.args, self.kwargs, self.receives = task, tuple(args), dict(kwargs), \
            receives

    def spec(self, receives: Optional[str]) -> Dict[str, Any]:
        """add_workflow's spec of this call; `receives`: what it gets from its parents."""
        data = self.task.data_of(self.args, self.kwargs,
                                 receives if self.receives else None)
        return dict(self.task._row_options(data), handler=self.task.name, data=data)


class Workflow:
    """Function tasks to add together, as one workflow (`chain`, `group`): ``enqueue()``
    adds them in one transaction and returns a `WorkflowHandle`."""

    def __init__(self, specs: List[Tuple[Call, List[int], Optional[str]]]) -> None:
        self.specs = specs       # (call, indexes of the calls it runs after, what it receives)

    def then(self, call: Call) -> "Workflow":
        """This workflow, then `call` after its last tasks: the last of a chain, or every
        task of a group (receiving the list of their results)."""
        if self.specs and self.specs[-1][2] == "group":
            last = list(range(len(self.specs)))
            return Workflow([(c, a, None) for c, a, _ in self.specs] + [
                (call, last, ALL_PARENTS)])
        return Workflow(self.specs + [(call, [len(self.specs) - 1] if self.specs else [],
                                       PREVIOUS if self.specs else None)])

    def enqueue(self, name: Optional[str] = None, on: Optional["TaskQueue"] = None
                ) -> "WorkflowHandle":
        """Add the tasks, checked first (nothing is stored when one is wrong); inside a
        running task, exactly once."""
        specs = []
        for index, (call, after, receives) in enumerate(self.specs):
            spec = call.spec(receives if receives in (PREVIOUS, ALL_PARENTS) else None)
            spec.pop("after", None)
            spec["key"] = "#%d" % index
            if after:
                spec["after"] = ["#%d" % parent for parent in after]
            specs.append(spec)
        queue, run = _queue_for(on)

        def add() -> List[int]:
            added = queue.add_workflow(specs, name=name)
            return [added.id] + list(added.task_ids)
        ids = run.add_once("workflow:%s" % _digest([specs, name]), add) if run is not None \
            else add()
        return WorkflowHandle(ids[0], [TaskHandle(task_id, queue, call.task.name)
                                       for task_id, (call, _, _) in zip(ids[1:], self.specs)],
                              queue)


class WorkflowHandle:
    """A workflow added (`Workflow.enqueue`): ``id``, ``tasks`` (a `TaskHandle` each, in
    the order given), ``wait(timeout)`` for its state, ``result()`` of its last task."""

    def __init__(self, workflow_id: int, tasks: List[TaskHandle[Any]],
                 queue: Queue) -> None:
        self.id, self.tasks, self.queue = workflow_id, tasks, queue

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return "<workflow %d: %d tasks>" % (self.id, len(self.tasks))

    def wait(self, timeout: Optional[float] = None) -> "WorkflowInfo":
        return self.queue.wait_workflow(self.id, timeout)

    def result(self, timeout: Optional[float] = None) -> Any:
        """The return value of its last task (a chain's end, a group's ``then``)."""
        return self.tasks[-1].result(timeout)


def chain(*calls: Call) -> Workflow:
    """Tasks run one after another, each receiving the result of the one before it as its
    first argument (unless added with ``si``); a failure cancels the rest."""
    workflow = Workflow([])
    for call in calls:
        workflow = workflow.then(_call(call))
    return workflow


def group(*calls: Union[Call, Iterable[Call]]) -> Workflow:
    """Tasks run side by side; ``.then(call)`` adds one after all of them (fan-in) that
    receives the list of their results, in the order given, as its first argument."""
    flat: List[Call] = []
    for item in calls:
        flat.extend([item] if isinstance(item, Call) else list(item))
    if not flat:
        raise InputError("a group needs at least one task")
    return Workflow([(_call(call), [], "group") for call in flat])


def _call(call: Any) -> Call:
    if not isinstance(call, Call):
        raise InputError("expected a task with its arguments (fn.s(...)), not %r" % (call,))
    return call


__all__ = ["task", "FunctionTask", "ChunkTask", "TaskHandle", "TaskFailed", "Call", "Workflow",
           "WorkflowHandle", "chain", "group", "results_of", "use_queue"]
