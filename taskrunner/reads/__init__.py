"""The operators' reads: one module of records and queries (`records`) feeding the CLI's
JSON, the dashboard and the metrics, the summaries built on them (`summaries`), and why a
task is not running (`blockers`).

``taskrunner.reads.TaskInfo``, ``list_periodic`` and the other records, documented under this
name before the package existed, are loaded from `records` on first use."""
import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in ("records", "summaries", "blockers"):
        raise AttributeError(name)   # a submodule: the import system loads it
    value = getattr(importlib.import_module(".records", __name__), name)
    globals()[name] = value
    return value
