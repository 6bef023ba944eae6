"""Durable function tasks for tests/test_rerun.py: each step appends its name to a log file,
so a test counts what ran; `load` fails while the file `<log>.broken` exists."""
import os
from typing import Any, Dict

from taskrunner import RunContext, task


def ran(log: str, name: str, value: Any) -> Any:
    with open(log, "a") as out:
        out.write(name + "\n")
    return value


def load(log: str, rows: int) -> int:
    if os.path.exists(log + ".broken"):
        raise RuntimeError("the warehouse refused the rows")
    return ran(log, "load", rows)


@task(retry=False)
def pipeline(run: RunContext, log: str) -> Dict[str, Any]:
    rows = run.step("fetch", lambda: ran(log, "fetch", 3))
    run.checkpoint({"fetched": rows})
    doubled = run.step("transform", lambda: ran(log, "transform", rows * 2))
    loaded = run.step("load", lambda: load(log, doubled))
    return {"loaded": loaded, "resumed_from": run.resumed_from}


@task
def notify(loaded: Dict[str, Any], log: str) -> str:
    """After `pipeline` in a chain: its result comes first."""
    return ran(log, "notify", "sent %d" % loaded["loaded"])
