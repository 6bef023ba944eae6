"""Periodic tasks, rule 9: the scheduler that submits due tasks (`scheduler`), definitions
from the config (`definitions`) and timers (`timers`, on top of `taskrunner.calendar`).

``taskrunner.periodic.add_periodic`` and the scheduler's other functions, documented under
this name before the package existed, are loaded on first use (the CLI's `calendar` command
imports `timers` without paying for the database layer)."""
import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__") or name in ("scheduler", "definitions", "timers"):
        raise AttributeError(name)   # a submodule: the import system loads it
    value = getattr(importlib.import_module(".scheduler", __name__), name)
    globals()[name] = value
    return value
