"""Exceptions. `InputError` and its subclasses are the user's mistakes: the CLI prints them
as one line and exits 2. Anything else reaching the CLI is a runtime failure (exit 1)."""


class TaskRunnerError(Exception):
    """Base class of taskrunner's own errors."""


class InputError(TaskRunnerError):
    """Bad input from the user: a handler, JSON data, an id, an argument."""


def check_text(what, value, max_length=255, empty=True):
    """InputError unless `value` is a str a database can store: UTF-8 text (no lone
    surrogate, which is how Python decodes invalid UTF-8 in arguments and the environment),
    at most `max_length` characters, not empty unless `empty`. None passes."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InputError("%s must be a string, not %s" % (what, type(value).__name__))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError("%s is not valid UTF-8 text" % what) from None
    if "\x00" in value:
        raise InputError("%s contains a NUL character" % what)
    if not empty and not value:
        raise InputError("%s must not be empty" % what)
    if max_length is not None and len(value) > max_length:
        raise InputError("%s is longer than %d characters" % (what, max_length))
    return value


class ConfigError(InputError):
    """A missing, unreadable or invalid configuration file or key."""


class DatabaseUnavailable(InputError):
    """The database cannot be reached; the message shows the URL with its password masked."""


class HandlerError(InputError):
    """A handler path that is not importable, not a TaskHandler, or not allowed."""


class TaskNotFound(InputError):
    """No task with that id."""


class StateError(InputError):
    """The operation does not fit the task's state (cancel a running task, retry a success)."""


class WaitTimeout(TaskRunnerError, TimeoutError):
    """`TaskQueue.wait` gave up: the task was not final within its timeout."""


class RunnerLimitReached(TaskRunnerError):
    """This host already has `[runner] limit` runners running."""


class TaskError(Exception):
    """Raise from a handler to fail the run with a chosen error code.

    ``raise TaskError("mailbox full", code="MAILBOX_FULL")`` stores error_code
    ``MAILBOX_FULL``; any other exception stores its class name as the code. The task is
    retried, as after any failure, until ``max_retries`` failures in a row.

    ``retry=False`` says that no retry can succeed (a refusal, a bad input, a deadline
    passed): the task gives up after this failure, whatever its ``max_retries`` — final,
    with this error kept and ``on_give_up`` called, as any give-up. ``EventTimeout`` is
    raised with it. A run that ends so because its runner was stopping is still handed
    back (it runs again at once and gives up there).
    """

    def __init__(self, message: str, code: "str | None" = None, retry: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.retry = retry


class SchemaBehind(InputError):
    """The database schema is older than this code and the caller did not ask to migrate."""


class Retry(Exception):
    """Raise from a handler to run the task again later without counting a failure
    ("snooze"): ``raise Retry(in_seconds=300, reason="rate limited")``. Without
    `in_seconds` it runs again at once. The run ends ``requeued`` with the reason."""

    def __init__(self, in_seconds: "float | None" = None, reason: "str | None" = None) -> None:
        if in_seconds is not None and (isinstance(in_seconds, bool)
                                       or not isinstance(in_seconds, (int, float))
                                       or not 0 <= in_seconds <= 3153600000):
            raise ValueError("Retry(in_seconds=...) takes a number of seconds, not %r"
                             % (in_seconds,))
        super().__init__(reason or "retry")
        self.in_seconds = in_seconds
        self.reason = reason


class EventTimeout(TaskError):
    """Raised by ``run.wait_for(name, timeout=...)`` when the event did not come in time
    (on that attempt and on every later one: the timeout is recorded like a step). Not
    retried (``retry=False``): uncaught, it gives the task up at once with error code
    ``EventTimeout``; catch it to do something else."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="EventTimeout", retry=False)


class Waiting(BaseException):
    """Raised by ``run.sleep``, ``run.wait_for`` and ``run.wait_for_tasks`` to end the run as
    ``waiting``: the runner stores it (not a failure, no retry used) and the task runs again
    at `until` (naive UTC, this host's clock), when the event `event` is sent, or when the
    last of the tasks `tasks` has ended. A BaseException, so that a
    handler's ``except Exception`` lets it through."""

    def __init__(self, until: "object" = None, event: "str | None" = None,
                 message: str = "waiting", tasks: "list[int] | None" = None) -> None:
        super().__init__(message)
        self.until = until
        self.event = event
        self.tasks = tasks          # run.wait_for_tasks: the ids of tasks not ended yet
