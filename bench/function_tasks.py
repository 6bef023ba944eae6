"""The function-task side of the benchmarks: a no-op `@task`, beside the class handler
`taskrunner.handlers.Echo` with data null (bench/common.NOOP)."""
from taskrunner import task


@task
def noop() -> None:
    """Nothing but the bookkeeping: no arguments (data ``{}``), no result."""


FUNCTION_NOOP = "bench.function_tasks.noop"
