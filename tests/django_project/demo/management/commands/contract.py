"""``manage.py contract enqueue`` / ``manage.py contract read IDS_JSON``: the two halves of
tests/test_django_contract.py, run in the project as an application runs them. `enqueue`
checks what needs no runner and enqueues the tasks a runner then runs; `read` reads their
results back. Each prints what it saw as JSON: facts, not verdicts (the tests judge)."""
import asyncio
import json
from datetime import timedelta

from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

try:
    from django.tasks import default_task_backend, task_backends
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued
except ImportError:
    from django_tasks import default_task_backend, task_backends
    from django_tasks.exceptions import InvalidTaskError as InvalidTask, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued

from demo import contract_tasks as tasks


def raised(call):
    """The class name and message `call()` raised, or None."""
    try:
        call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None


def fresh(result):
    """What Django's suites assert of a result nothing ran yet."""
    return {"status": str(result.status), "is_finished": result.is_finished,
            "started_at": result.started_at, "last_attempted_at": result.last_attempted_at,
            "finished_at": result.finished_at, "enqueued_at": result.enqueued_at is not None,
            "return_value": raised(lambda: result.return_value), "args": result.args,
            "kwargs": result.kwargs, "attempts": result.attempts}


def enqueue():
    backend = default_task_backend
    seen = {"backend": [backend == task_backends["default"],
                        type(task_backends["default"]).__name__, backend.alias],
            "check": [str(message) for message in backend.check()]}
    # refresh() of a result held since enqueue() shows the run, once it ran (first: the
    # in-process run_pending() runs what is due, and only this is yet).
    held = tasks.meaning_of_life.enqueue()
    backend.queue().run_pending()
    seen["before_refresh"] = fresh(held)
    held.refresh()
    seen["refreshed"] = {"status": str(held.status), "return_value": held.return_value,
                         "attempts": held.attempts, "is_finished": held.is_finished,
                         "finished_at": held.finished_at is not None}
    received = []

    def capture(sender, task_result, **kwargs):
        received.append((sender.__name__, task_result))
    task_enqueued.connect(capture, weak=False, dispatch_uid="contract")

    # Enqueued: READY, nothing ran, task_enqueued sent once with the result itself.
    for task in (tasks.noop, tasks.noop_async):
        received.clear()
        result = task.enqueue(1, two=3)
        seen["enqueued_" + task.name] = dict(
            fresh(result), task_is_the_task=result.task == task,
            signal=[(name, sent is result) for name, sent in received])

    async def in_loop():
        received.clear()
        result = await tasks.noop_async.aenqueue()
        stored = await default_task_backend.aget_result(result.id)
        return dict(fresh(result), stored_is_returned=stored == result,
                    signal=[(name, sent is result) for name, sent in received],
                    missing=await missing_async())

    async def missing_async():
        try:
            await default_task_backend.aget_result("424242")
        except TaskResultDoesNotExist:
            return True
        return False
    seen["aenqueued"] = asyncio.run(in_loop())

    result = tasks.meaning_of_life.enqueue()
    seen["get_result_is_returned"] = backend.get_result(result.id) == result
    seen["missing"] = [raised(lambda: backend.get_result(result_id)) for result_id in
                       ("424242", "not-a-number", "")]
    seen["unknown_queue"] = [
        raised(lambda: tasks.noop.using(queue_name="unknown_queue").enqueue()),
        raised(lambda: asyncio.run(tasks.noop.using(queue_name="unknown_queue").aenqueue()))]
    seen["bad_priority"] = [raised(lambda: tasks.noop.using(priority=p).enqueue())
                            for p in (101, -101)]
    seen["naive_run_after"] = raised(lambda: tasks.noop.using(
        run_after=timezone.now().replace(tzinfo=None)).enqueue())

    # Inside the application's transaction: enqueued_at at once; other connections see the
    # task only once it commits (django-tasks-db's DatabaseBackend, which adds it there too).
    outside = backend.queue()
    with transaction.atomic():
        in_transaction = tasks.noop.enqueue()
        seen["in_transaction"] = {"enqueued_at": in_transaction.enqueued_at is not None}
        if outside.store.backend != "sqlite":     # SQLite's writer locks the file meanwhile
            seen["in_transaction"]["seen_outside_before"] = \
                outside_sees(outside, in_transaction.id)
    seen["in_transaction"]["seen_outside_after"] = outside_sees(outside, in_transaction.id)
    task_enqueued.disconnect(dispatch_uid="contract")

    now = timezone.now()
    ids = {"meaning_of_life": result.id, "in_transaction": in_transaction.id,
           "fails": tasks.fails_with_value_error.enqueue().id,
           "nested": tasks.fails_with_nested_exception.enqueue().id,
           "not_json": tasks.returns_what_json_cannot_hold.enqueue().id,
           "own_id": tasks.own_id.enqueue().id,
           "attempt": tasks.attempt_number.enqueue(7).id,
           "async": tasks.noop_async.enqueue().id,
           "emails": tasks.in_emails.enqueue().id,
           "later": tasks.noop.using(run_after=now + timedelta(hours=10)).enqueue().id}
    # The order of a runner's claims: priority first (higher first), then the time each may
    # run, oldest first; what may not run yet waits.
    ordered = [("lower", {"priority": -2}), ("low", {"priority": 2}),
               ("high", {"priority": 10}),
               ("old", {"priority": 20, "run_after": now - timedelta(hours=2)}),
               ("very_old", {"priority": 20, "run_after": now - timedelta(hours=10)})]
    ids["order"] = {name: tasks.noop.using(**options).enqueue().id for name, options in ordered}
    return {"seen": seen, "ids": ids}


def outside_sees(queue, result_id):
    try:
        queue.get_task(int(result_id))
    except Exception:
        return False
    return True


def read(ids):
    backend = default_task_backend
    seen = {}
    for name, result_id in ids.items():
        if name == "order":
            continue
        result = backend.get_result(result_id)
        seen[name] = {
            "status": str(result.status), "is_finished": result.is_finished,
            "return_value": raised(lambda: result.return_value) or [result.return_value],
            "times_in_order": bool(result.started_at and result.finished_at
                                   and result.enqueued_at <= result.started_at
                                   <= result.last_attempted_at <= result.finished_at),
            "started_at": result.started_at is not None, "attempts": result.attempts,
            "worker_ids": len(result.worker_ids), "id": result.id,
            "errors": [{"exception_class": "%s.%s" % (error.exception_class.__module__,
                                                       error.exception_class.__qualname__),
                        "traceback": error.traceback} for error in result.errors]}
    started = {name: backend.get_result(result_id).started_at
               for name, result_id in ids["order"].items()}
    seen["order"] = sorted(started, key=lambda name: (started[name] is None, started[name]))
    return seen


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("phase", choices=("enqueue", "read"))
        parser.add_argument("ids", nargs="?")

    def handle(self, phase, ids, **options):
        seen = enqueue() if phase == "enqueue" else read(json.loads(ids))
        self.stdout.write(json.dumps(seen, default=str))
