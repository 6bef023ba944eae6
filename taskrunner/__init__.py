"""taskrunner: a durable, database-backed task queue and calendar scheduler."""
from .config import Config
from .errors import (ConfigError, DatabaseUnavailable, HandlerError, InputError, StateError,
                     TaskError, TaskNotFound, TaskRunnerError)
from .handler import RunContext, TaskHandler
from .queue import TaskQueue

__version__ = "0.1.0"

__all__ = ["TaskQueue", "TaskHandler", "RunContext", "TaskError", "Config", "TaskRunnerError",
           "InputError", "ConfigError", "DatabaseUnavailable", "HandlerError", "StateError",
           "TaskNotFound"]
