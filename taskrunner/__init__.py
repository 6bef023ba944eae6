"""taskrunner: a durable, database-backed task queue and calendar scheduler.

The names below are loaded on first use: ``import taskrunner`` (and the CLI's commands that
need no database) must not pay for peewee and the database drivers it imports.
"""
import importlib
from typing import TYPE_CHECKING, Any

from .errors import (ConfigError, DatabaseUnavailable, EventTimeout, HandlerError, InputError,
                     Retry, SchemaBehind, StateError, TaskError, TaskNotFound, TaskRunnerError,
                     WaitTimeout)
from .handler import RunContext, TaskHandler

if TYPE_CHECKING:
    from .config import Config
    from .chunks import Chunk, ChunkHandler, ChunkItem
    from .functions import (Call, ChunkTask, FunctionTask, TaskFailed, TaskHandle, Workflow,
                            WorkflowHandle, chain, group, results_of, task, use_queue)
    from .api import TaskQueue
    from .reads.records import (PeriodicTaskInfo, RerunInfo, RunInfo, RunnerInfo, StepInfo,
                                TaskInfo, TaskOutcome)

__version__ = "0.1.0"

_LAZY = {"TaskQueue": "api", "Config": "config", "TaskInfo": "reads.records",
         "RunInfo": "reads.records", "RunnerInfo": "reads.records",
         "PeriodicTaskInfo": "reads.records", "TaskOutcome": "reads.records",
         "StepInfo": "reads.records", "RerunInfo": "reads.records", "task": "functions", "FunctionTask": "functions",
         "TaskHandle": "functions", "TaskFailed": "functions", "Call": "functions",
         "Workflow": "functions", "WorkflowHandle": "functions", "chain": "functions",
         "group": "functions", "results_of": "functions", "use_queue": "functions",
         "ChunkTask": "functions", "Chunk": "chunks", "ChunkItem": "chunks",
         "ChunkHandler": "chunks"}

__all__ = ["task", "TaskHandle", "TaskFailed", "FunctionTask", "Call", "Workflow",
           "WorkflowHandle", "chain", "group", "results_of", "use_queue", "TaskQueue", "TaskHandler", "RunContext", "TaskError", "Retry", "Config", "TaskInfo",
           "RunInfo", "RunnerInfo", "PeriodicTaskInfo", "TaskRunnerError", "InputError",
           "ConfigError", "DatabaseUnavailable", "HandlerError", "StateError", "TaskNotFound",
           "SchemaBehind", "TaskOutcome", "WaitTimeout", "EventTimeout", "StepInfo",
           "RerunInfo", "Chunk", "ChunkItem", "ChunkHandler", "ChunkTask"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module("." + _LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
