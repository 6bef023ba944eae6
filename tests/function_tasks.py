"""Function tasks for tests/test_functions.py."""
from typing import Any, Dict, List

from taskrunner import RunContext, group, results_of, task


@task
def add(a: int, b: int = 0) -> int:
    return a + b


@task(queue="mail", priority=5, max_retries=3, timeout="5min",
      concurrency_key="order-{order_id}")
def send_receipt(order_id: int, *, to: str = "customer@example.com") -> Dict[str, Any]:
    return {"order": order_id, "to": to}


@task(retry=False)
def fails(message: str) -> None:
    raise ValueError(message)


@task
async def shout(text: str) -> str:
    return text.upper()


@task
def gather_args(first: int, *rest: int, scale: int = 1, **named: int) -> Dict[str, Any]:
    return {"sum": (first + sum(rest)) * scale, "named": named}


@task
def collect(results: List[int], label: str) -> Dict[str, Any]:
    return {"label": label, "results": results}


@task
def durable_sum(run: RunContext, values: List[int]) -> int:
    doubled = run.step("double", lambda: [2 * value for value in values])
    return sum(doubled)


@task(retry_backoff=0)
def parent(run: RunContext, count: int) -> int:
    """Adds `count` children, fails its first attempt after adding them (as a crash would),
    and sums their results once they have all ended."""
    handles = [add.enqueue(index, 100) for index in range(count)]
    if run.attempt == 1:
        raise RuntimeError("died after adding its children")
    return sum(results_of(handles))


@task(retry_backoff=0)
def fan_out(run: RunContext, count: int) -> Dict[str, Any]:
    """A group and its fan-in added from inside a handler; waits for the fan-in's result."""
    workflow = group(add.s(index, 1) for index in range(count)).then(collect.s("fan-in"))
    handle = workflow.enqueue()
    if run.attempt == 1:
        raise RuntimeError("died after adding the workflow")
    return handle.result()


@task
def waits_for_a_failure(run: RunContext) -> str:
    handle = fails.enqueue("child broke")
    try:
        handle.result()
    except Exception as exc:    # TaskFailed: how the child ended
        return "%s: %s" % (type(exc).__name__, exc)
    return "no failure"


@task
def twice(run: RunContext) -> List[Any]:
    return [run.wait_for("shipped"), run.wait_for("shipped")]


@task
def sleeps_a_day(run: RunContext, name: str) -> str:
    run.sleep(86400)
    return "rested " + name


@task(max_retries=3, retry_backoff="1h")
def flaky(run: RunContext) -> int:
    if run.attempt < 3:
        raise RuntimeError("not yet")
    return run.attempt


@task(retry_backoff=0)
def pay_and_ship(run: RunContext, order_id: int) -> int:
    """A payment row and the shipping task in one transaction (the step's), then a crash."""
    def pay(connection: Any) -> int:
        mark = "?" if type(connection).__module__.startswith("sqlite3") else "%s"
        cursor = connection.cursor()
        cursor.execute("INSERT INTO payments (order_id) VALUES (%s)" % mark, (order_id,))
        cursor.close()
        return add.enqueue(order_id, 1000).id
    shipping = run.transaction_step("pay", pay)
    if run.attempt == 1:
        raise RuntimeError("died after paying")
    return int(shipping)


@task(max_retries=5, retry_backoff=0)
def lets_a_failure_through(run: RunContext) -> None:
    fails.enqueue("child broke").result()


@task(retry_backoff=0)
def reorders(run: RunContext, items: List[int]) -> List[int]:
    order = items if run.attempt == 1 else list(reversed(items))
    handles = {item: add.enqueue(item, 100) for item in order}
    twice = [add.enqueue(9, 100), add.enqueue(9, 100)]
    if run.attempt == 1:
        raise RuntimeError("died after adding its children")
    return results_of([handles[item] for item in items] + twice)


@task(debounce="30s", debounce_key="search-{user_id}")
def reindex(user_id: int, query: str) -> Dict[str, Any]:
    return {"user": user_id, "query": query}


@task(max_attempts=2)
def two_runs(message: str) -> None:
    raise ValueError(message)
