"""Function tasks for tests/test_tracing.py: an order that charges in a step, fans out to a
group of children with a fan-in, and waits for it; a child that fails its first attempt; a
chunk task whose item named "broken" fails alone."""
from typing import Any, Dict, List

from taskrunner import RunContext, TaskError, group, task
from taskrunner.chunks import Chunk


@task(retry_backoff=0, max_retries=3)
def pack(run: RunContext, item: str) -> str:
    if item == "glass" and run.attempt == 1:
        raise RuntimeError("dropped the glass")
    return "box of " + item


@task
def summary(boxes: List[str], order_id: int) -> Dict[str, Any]:
    return {"order": order_id, "boxes": boxes}


@task
def checkout(run: RunContext, order_id: int, items: List[str]) -> Dict[str, Any]:
    run.step("charge", lambda: {"charged": order_id})
    workflow = group(pack.s(item) for item in items).then(summary.s(order_id))
    return workflow.enqueue().result()


@task(chunk=3, retry=False)
def label(chunk: Chunk) -> List[Dict[str, str]]:
    for item in chunk:
        if item.args["name"] == "broken":
            item.fail(TaskError("no label for it", code="NoLabel"))
    return [{"label": item.args["name"].upper()} for item in chunk]
