"""Django tasks of the test project."""
import asyncio
import os
import time

try:
    from django.tasks import task
except ImportError:         # Django < 6: the backport
    from django_tasks import task


class Boom(Exception):
    pass


@task
def add(a, b):
    return a + b


@task(queue_name="emails", priority=50)
def send(to, subject=""):
    from demo.apps import SETUP_PID
    return {"to": to, "subject": subject, "pid": os.getpid(), "setup_pids": SETUP_PID}


@task
def always_fails(message):
    raise Boom(message)


@task(takes_context=True)
def fails_once(context, value):
    if context.attempt == 1:
        raise Boom("first attempt")
    return {"value": value, "attempt": context.attempt}


@task
async def async_add(a, b):
    await asyncio.sleep(0)
    return a + b


@task(backend="elsewhere")
def elsewhere(a):
    """A task of another backend: taskrunner runs it when enqueued with .using(backend=...)."""
    return a * 2


@task
def exits(code):
    """Ends as sys.exit() would: Django reports it as a failure with SystemExit."""
    raise SystemExit(code)


@task
async def async_exits(code):
    await asyncio.sleep(0)
    raise SystemExit(code)


@task(takes_context=True)
def hangs_once(context):
    """Its first attempt runs until its runner is killed; the next returns."""
    if context.attempt == 1:
        time.sleep(600)
    return context.attempt


@task
def interrupts():
    """Ends as a Ctrl-C in the runner's terminal would."""
    raise KeyboardInterrupt
