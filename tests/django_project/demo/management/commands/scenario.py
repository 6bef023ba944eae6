"""``manage.py scenario NAME``: one scenario of tests/test_django.py, run inside the project
as an application would run it; prints what it saw as JSON."""
import asyncio
import copy
import json
import time
from datetime import timedelta

from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

try:
    from django.tasks import default_task_backend
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
except ImportError:
    from django_tasks import default_task_backend
    from django_tasks.exceptions import InvalidTaskError as InvalidTask, TaskResultDoesNotExist

from demo import tasks


class Rollback(Exception):
    pass


def described(result):
    value = None
    if result.status == "SUCCESSFUL":
        value = result.return_value
    return {"id": result.id, "status": str(result.status), "args": result.args,
            "kwargs": result.kwargs, "return_value": value,
            "queue_name": result.task.queue_name, "priority": result.task.priority,
            "run_after": result.task.run_after.isoformat() if result.task.run_after else None,
            "enqueued_at": bool(result.enqueued_at), "started_at": bool(result.started_at),
            "last_attempted_at": bool(result.last_attempted_at),
            "finished_at": bool(result.finished_at),
            "errors": [{"exception_class_path": e.exception_class_path,
                        "traceback": e.traceback} for e in result.errors],
            "worker_ids": result.worker_ids, "backend": result.backend}


def missing(result_id):
    try:
        default_task_backend.get_result(result_id)
    except TaskResultDoesNotExist:
        return True
    return False


def contract():
    backend = default_task_backend
    seen = {"supports": [backend.supports_defer, backend.supports_priority,
                         backend.supports_get_result, backend.supports_async_task]}
    try:
        tasks.add.using(queue_name="nowhere")
        seen["unknown_queue"] = "accepted"
    except InvalidTask as exc:
        seen["unknown_queue"] = str(exc)
    later = timezone.now() + timedelta(hours=1)
    first = tasks.add.enqueue(2, b=(3, 4))
    seen["enqueued"] = described(first)
    seen["read"] = described(tasks.add.get_result(first.id))
    # Django's and django-tasks-db's contract: the result enqueue() returned is the stored
    # one, and refresh() of a task nothing ran changes nothing.
    seen["stored_is_returned"] = tasks.add.get_result(first.id) == first
    before = copy.copy(first)
    first.refresh()
    seen["refresh_changes_nothing"] = first == before
    seen["send"] = described(tasks.send.using(run_after=later).enqueue("a@example.com"))
    seen["missing"] = [missing("999999999"), missing("not-a-number")]
    try:
        with transaction.atomic():
            rolled_back = tasks.add.enqueue(1, 1)
            raise Rollback()
    except Rollback:
        pass
    seen["rolled_back_missing"] = missing(rolled_back.id)
    with transaction.atomic():
        committed = tasks.add.enqueue(5, 5)
    seen["committed"] = described(default_task_backend.get_result(committed.id))
    seen["committed_is_returned"] = default_task_backend.get_result(committed.id) == committed

    async def in_loop():
        result = await tasks.async_add.aenqueue(1, 2)
        stored = await tasks.async_add.aget_result(result.id)
        return dict(described(stored), is_returned=stored == result)
    seen["async"] = asyncio.run(in_loop())
    return seen


def run(timeout):
    """Enqueue one task of each kind and wait for all of them to finish."""
    with transaction.atomic():
        results = {"add": tasks.add.enqueue(2, 3), "send": tasks.send.enqueue("b@example.com"),
                   "fails": tasks.always_fails.enqueue("no"),
                   "fails_once": tasks.fails_once.enqueue(7),
                   "async_add": tasks.async_add.enqueue(20, 22)}
    committed = time.monotonic()
    seen, ready_while_retrying = {}, False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, result in results.items():
            result.refresh()
            if result.status == "READY" and result.errors:
                ready_while_retrying = True
            if result.is_finished and name not in seen:
                seen[name] = dict(described(result), after=time.monotonic() - committed)
        if len(seen) == len(results):
            break
        time.sleep(0.05)
    return {"results": seen, "ready_while_retrying": ready_while_retrying}


def enqueue():
    """One Django task of each of two functions, one whose @task names another backend, and
    one stored as a Django task was before tasks were named by their import path: handler
    `RunDjangoTask`, the path in its data."""
    add = tasks.add.enqueue(2, 3)
    send = tasks.send.enqueue("c@example.com", subject="receipt")
    elsewhere = tasks.elsewhere.using(backend="default").enqueue(21)
    backend = default_task_backend
    stored_before = backend.queue().add_task(
        "taskrunner.contrib.django.handler.RunDjangoTask",
        {"task": "demo.tasks.add", "args": [20, 22], "kwargs": {}, "backend": backend.alias,
         "run_after": None})
    return {"add": add.id, "send": send.id, "elsewhere": elsewhere.id,
            "stored_before": str(stored_before)}


def exits():
    """A sync and an async task that raise SystemExit."""
    return {"exits": tasks.exits.enqueue(3).id, "async_exits": tasks.async_exits.enqueue(4).id}


def hangs():
    """A task whose first attempt runs until its runner is killed."""
    return {"hangs_once": tasks.hangs_once.enqueue().id}


def interrupts():
    """A task that raises KeyboardInterrupt, and one deferred for an hour (to cancel)."""
    later = timezone.now() + timedelta(hours=1)
    return {"interrupts": tasks.interrupts.enqueue().id,
            "deferred": tasks.add.using(run_after=later).enqueue(1, 2).id}


def fragile():
    """A task of a module that the runner cannot import ($DEMO_FRAGILE there)."""
    from demo.fragile import job
    return {"job": job.enqueue().id}


def results(ids):
    """The `TaskResult` of each task id, as Django reads it back."""
    return {result_id: described(default_task_backend.get_result(result_id))
            for result_id in ids}


def dashboard():
    """The mounted dashboard through Django's own request handling (sessions, auth, Django's
    CSRF middleware enforced)."""
    import re
    from django.contrib.auth.models import User
    from django.test import Client
    result = tasks.always_fails.enqueue("for the dashboard")
    staff = User.objects.create(username="ops", is_staff=True)
    clerk = User.objects.create(username="clerk")
    seen = {"anonymous": Client().get("/ops/taskrunner/").status_code}
    client = Client(enforce_csrf_checks=True)
    client.force_login(clerk)
    seen["not_staff"] = client.get("/ops/taskrunner/").status_code
    seen["not_staff_metrics"] = client.get("/ops/taskrunner/metrics").status_code
    client.force_login(staff)
    overview = client.get("/ops/taskrunner/")
    html = overview.content.decode()
    seen["overview"] = overview.status_code
    seen["links"] = sorted(set(re.findall(r'(?:href|src|action|data-parts)="(/[^"?]*)', html)))
    parts = client.get("/ops/taskrunner/api/parts?page=overview").content.decode()
    seen["parts_links"] = sorted(set(re.findall(r'href=\\"(/[^"?\\]*)', parts)))
    seen["css"] = client.get("/ops/taskrunner/static/app.css").status_code
    task_page = client.get("/ops/taskrunner/tasks/%s" % result.id).content.decode()
    seen["task_page_names"] = ["demo.tasks.always_fails" in task_page,
                               "RunDjangoTask" in task_page]
    token = re.search(r'name="csrf" value="([^"]+)"', task_page).group(1)
    action = "/ops/taskrunner/tasks/%s/cancel" % result.id
    form = "application/x-www-form-urlencoded"      # as a browser sends the dashboard's forms
    seen["without_token"] = client.post(action, "", content_type=form).status_code
    seen["wrong_origin"] = client.post(action, "csrf=" + token, content_type=form,
                                       HTTP_ORIGIN="http://evil.example").status_code
    done = client.post(action, "csrf=" + token, content_type=form)
    seen["with_token"] = [done.status_code, done.get("Location", "").split("?")[0]]
    seen["status_after"] = str(default_task_backend.get_result(result.id).status)
    metrics = client.get("/ops/taskrunner/metrics")
    seen["metrics"] = [metrics.status_code, "taskrunner_" in metrics.content.decode()]
    return seen


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("ids", nargs="*")
        parser.add_argument("--timeout", type=float, default=60)

    def handle(self, name, ids, timeout, **options):
        seen = {"contract": contract, "dashboard": dashboard, "enqueue": enqueue,
                "exits": exits, "fragile": fragile, "hangs": hangs,
                "interrupts": interrupts,
                "results": lambda: results(ids)}.get(name, lambda: run(timeout))()
        self.stdout.write(json.dumps(seen))
