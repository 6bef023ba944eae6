"""A FastAPI application for tests/test_async.py: each request adds a task and awaits its
outcome; a watchdog coroutine measures how late the event loop wakes it (the loop's lag)."""
import asyncio
import gc
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI

from taskrunner import TaskQueue

queue = TaskQueue(os.environ["APP_DATABASE_URL"])
TICK = 0.005
lag = {"max": 0.0}
waiting = {"now": 0}


async def watchdog():
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(TICK)
        lag["max"] = max(lag["max"], loop.time() - started - TICK)


@asynccontextmanager
async def lifespan(app):
    # What the imports made (FastAPI, pydantic, peewee, psycopg: some 70,000 objects) is
    # moved out of the collector's reach, as a server is advised to do once it has started
    # (docs: "Using it with FastAPI"): a full collection that walks them all stalled the loop
    # 30-60 ms in the middle of the 200 requests, on this machine under load — the collector,
    # not taskrunner. A full collection of what the requests make still counts as lag.
    gc.freeze()
    watching = asyncio.get_running_loop().create_task(watchdog())
    yield
    watching.cancel()


app = FastAPI(lifespan=lifespan)


@app.post("/sum")
async def add_and_wait(a: int, b: int):
    task_id = await queue.add_task_async("async_handlers.Sum", {"numbers": [a, b]})
    waiting["now"] += 1
    try:
        outcome = await queue.wait_async(task_id, timeout=120)
    finally:
        waiting["now"] -= 1
    return {"task": task_id, "status": outcome.status, "results": outcome.results}


@app.get("/lag")
async def loop_lag(reset: bool = False):
    seen = dict(lag, waiting=waiting["now"])
    if reset:
        lag["max"] = 0.0
    return seen

