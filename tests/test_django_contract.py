"""The public contract of a Django Tasks backend, as Django's own test suite (Django 6.0,
``tests/tasks/``: test_tasks.py, test_immediate_backend.py) and django-tasks-db's
(``tests/tests.py``: DatabaseBackendTestCase, DatabaseBackendWorkerTestCase) assert it of
their backends, asserted here of `TaskrunnerBackend`. Written for this project: each test's
docstring names the upstream behaviour it mirrors, and where taskrunner differs on purpose
(retries, ids), says so.

The project of tests/django_project runs once per Django (5.2 with the django-tasks backport,
Django 6's own `django.tasks`) and database (SQLite, PostgreSQL): ``manage.py contract
enqueue`` checks what needs no runner and enqueues the suite's tasks, real runners
(``manage.py taskrunner runner --burst``) run them, ``manage.py contract read`` reads the
results back; the tests judge what was seen."""
import json
import re
import sys
import time

import pytest

from conftest import Database, extra_missing
from test_django import Project, _django6_python, _has

FINISHED = ("SUCCESSFUL", "FAILED")


def _python(param):
    if param == "backport":
        python, check = sys.executable, "import django_tasks, django; " \
                                        "assert django.VERSION < (6,)"
    else:
        python, check = _django6_python(), "import django; assert django.VERSION >= (6,)"
    if not python or not _has(python, check):
        extra_missing("no %s Django in %s (see tests/test_django.py)" % (
            param, python or "$TASKRUNNER_DJANGO6_PYTHON"))
    return python


def _read(project, ids):
    return json.loads(project.manage("contract", "read", json.dumps(ids)).stdout)


@pytest.fixture(scope="module", params=[(django, db) for django in ("backport", "django6")
                                        for db in ("sqlite", "postgresql")],
                ids=lambda p: "-".join(p))
def seen(request, tmp_path_factory):
    """What the project saw: ``before`` (enqueue, and what needs no runner), ``default``
    (after runners serving ``default`` ran what they would), ``all`` (after one serving
    ``emails`` too), ``log`` (the runners' output)."""
    django, backend = request.param
    python = _python(django)
    tmp_path = tmp_path_factory.mktemp("contract")
    database = Database(backend, tmp_path)
    try:
        project = Project(python, database, tmp_path, config="[runner]\nlimit = 2\n")
        project.manage("migrate", "-v0")
        before = json.loads(project.manage("contract", "enqueue").stdout)
        ids = before["ids"]
        log = []
        deadline = time.monotonic() + 120
        while True:
            # A failed run is retried after its backoff; a burst leaves when nothing is due.
            ran = project.manage("taskrunner", "runner", "--burst")
            log.append(ran.stdout + ran.stderr)
            default = _read(project, ids)
            if all(default[name]["status"] in FINISHED for name in default
                   if name not in ("later", "emails", "order")):
                break
            assert time.monotonic() < deadline, default
            time.sleep(0.2)
        ran = project.manage("taskrunner", "runner", "--burst", "--queue", "emails")
        log.append(ran.stdout + ran.stderr)
        yield {"before": before["seen"], "ids": ids, "default": default,
               "all": _read(project, ids), "log": "".join(log)}
    finally:
        database.drop()


def test_the_backend_is_the_configured_one_and_checks_clean(seen):
    """Django test_immediate_backend / django-tasks-db test_using_correct_backend and
    test_check: ``default_task_backend`` is ``task_backends["default"]``, of the configured
    class and alias; its system check finds nothing to report."""
    assert seen["before"]["backend"] == [True, "TaskrunnerBackend", "default"]
    assert seen["before"]["check"] == []


@pytest.mark.parametrize("name", ["noop", "noop_async"])
def test_enqueue_returns_a_ready_result_and_sends_task_enqueued(seen, name):
    """django-tasks-db test_enqueue_task (sync and async task functions): READY, not
    finished, no start, last attempt or finish; return_value raises "Task has not finished
    yet"; the task, args and kwargs as called; no attempt; task_enqueued sent once, by the
    backend's class, with that very result."""
    result = seen["before"]["enqueued_" + name]
    assert (result["status"], result["is_finished"]) == ("READY", False)
    assert result["started_at"] is result["last_attempted_at"] is result["finished_at"] is None
    assert result["enqueued_at"] and result["task_is_the_task"]
    assert result["return_value"] == ["ValueError", "Task has not finished yet"]
    assert (result["args"], result["kwargs"], result["attempts"]) == ([1], {"two": 3}, 0)
    assert result["signal"] == [["TaskrunnerBackend", True]]


def test_aenqueue_and_aget_result(seen):
    """django-tasks-db test_enqueue_task_async, test_get_result_async and
    test_async_get_missing_result: aenqueue() returns a READY result, task_enqueued is sent
    with it, aget_result() of its id equals it, aget_result() of an unknown id raises
    TaskResultDoesNotExist."""
    result = seen["before"]["aenqueued"]
    assert (result["status"], result["args"], result["kwargs"]) == ("READY", [], {})
    assert result["stored_is_returned"] and result["missing"]
    assert result["signal"] == [["TaskrunnerBackend", True]]


def test_get_result_equals_the_enqueued_result(seen):
    """django-tasks-db test_get_result: get_result(result.id) == result."""
    assert seen["before"]["get_result_is_returned"] is True


def test_get_result_of_an_unknown_or_malformed_id_raises_does_not_exist(seen):
    """django-tasks-db test_get_missing_result and test_invalid_uuid: an id no task has,
    and one that is not an id at all, raise TaskResultDoesNotExist (ids are taskrunner's
    task ids here, not UUIDs)."""
    assert [error[0] if error else None for error in seen["before"]["missing"]] == \
        ["TaskResultDoesNotExist"] * 3


def test_refresh_shows_the_run(seen):
    """django-tasks-db test_refresh_result: the result held since enqueue() still says READY
    with nothing started, and refresh() brings the run's outcome: SUCCESSFUL, finished,
    return_value 42, one attempt."""
    assert seen["before"]["before_refresh"]["status"] == "READY"
    assert seen["before"]["before_refresh"]["attempts"] == 0
    assert seen["before"]["refreshed"] == {"status": "SUCCESSFUL", "return_value": 42,
                                           "attempts": 1, "is_finished": True,
                                           "finished_at": True}


def test_an_unknown_queue_is_refused_at_enqueue(seen):
    """Django test_validate_on_enqueue / test_validate_on_aenqueue (and django-tasks-db's):
    a queue the backend's QUEUES does not name raises InvalidTask "Queue 'unknown_queue' is
    not valid for backend.", from enqueue() and aenqueue()."""
    for error in seen["before"]["unknown_queue"]:
        assert error[0] in ("InvalidTask", "InvalidTaskError")
        assert error[1] == "Queue 'unknown_queue' is not valid for backend."


def test_priority_out_of_range_and_a_naive_run_after_are_refused(seen):
    """Django test_tasks (test_invalid_priority, test_naive_datetime): a priority outside
    -100..100 and, with USE_TZ, a naive run_after raise InvalidTask when enqueued."""
    for error in seen["before"]["bad_priority"]:
        assert "priority must be a whole number between -100 and 100" in error[1]
    assert seen["before"]["naive_run_after"][1] == "run_after must be an aware datetime."


def test_enqueue_inside_a_transaction_commits_with_it(seen):
    """django-tasks-db test_doesnt_wait_until_transaction_commit: inside
    ``transaction.atomic()`` the result has its enqueued_at at once, and the task is written
    in that transaction: another connection sees it only after the commit (on PostgreSQL;
    SQLite's writer holds the file meanwhile, as upstream skips it too)."""
    seen_here = seen["before"]["in_transaction"]
    assert seen_here["enqueued_at"] is True
    assert seen_here.get("seen_outside_before", False) is False
    assert seen_here["seen_outside_after"] is True


def test_a_runner_runs_an_enqueued_task(seen):
    """django-tasks-db test_run_enqueued_task (and Django test_result): after a worker ran
    it, the result refreshed is SUCCESSFUL with its return value, started, last attempted
    and finished in order after it was enqueued, one attempt by one worker."""
    result = seen["default"]["meaning_of_life"]
    assert (result["status"], result["return_value"]) == ("SUCCESSFUL", [42])
    assert result["times_in_order"] and result["is_finished"]
    assert (result["attempts"], result["worker_ids"], result["errors"]) == (1, 1, [])


def test_an_async_task_runs(seen):
    """Django test_enqueue_task with noop_task_async (an ``async def`` task, which the
    backend supports: supports_async_task): run to SUCCESSFUL, returning None."""
    assert (seen["default"]["async"]["status"], seen["default"]["async"]["return_value"]) == \
        ("SUCCESSFUL", [None])


def test_a_failing_task_is_failed_with_its_exception_and_traceback(seen):
    """Django test_catches_exception / django-tasks-db test_failing_task: FAILED, finished,
    return_value raises "Task failed", errors[0].exception_class is ValueError and its
    traceback ends with the exception's line. taskrunner retries a failed run
    (``MAX_ATTEMPTS``, 2 in this project) before the task fails: one error per attempt."""
    result = seen["default"]["fails"]
    assert (result["status"], result["is_finished"]) == ("FAILED", True)
    assert result["return_value"] == ["ValueError", "Task failed"]
    assert result["times_in_order"] and result["attempts"] == 2
    assert [e["exception_class"] for e in result["errors"]] == ["builtins.ValueError"] * 2
    assert result["errors"][0]["traceback"].endswith(
        "ValueError: this task failed with a ValueError\n")


def test_a_nested_exception_keeps_its_traceback(seen):
    """Django and django-tasks-db test_complex_exception: a ValueError wrapping another is
    recorded as ValueError with the whole exception in its traceback."""
    result = seen["default"]["nested"]
    assert result["status"] == "FAILED"
    assert result["errors"][0]["exception_class"] == "builtins.ValueError"
    assert "ValueError: the inner one" in result["errors"][0]["traceback"]


def test_a_return_value_json_cannot_hold_fails_the_task(seen):
    """Django and django-tasks-db test_complex_return_value: a task returning what JSON
    cannot hold fails with a TypeError, and has no return value."""
    result = seen["default"]["not_json"]
    assert result["status"] == "FAILED"
    assert result["return_value"] == ["ValueError", "Task failed"]
    assert result["errors"][0]["exception_class"] == "builtins.TypeError"


def test_a_task_taking_its_context_sees_its_result_and_attempt(seen):
    """Django test_takes_context / test_context: context.task_result.id is the result's id;
    context.attempt counts from 1."""
    own = seen["default"]["own_id"]
    assert own["return_value"] == [seen["ids"]["own_id"]]
    assert seen["default"]["attempt"]["return_value"] == [{"attempt": 1, "value": 7}]


def test_run_after_is_honoured(seen):
    """django-tasks-db test_run_after: a task to run ten hours from now is left READY by
    the worker."""
    later = seen["all"]["later"]
    assert (later["status"], later["started_at"], later["attempts"]) == ("READY", False, 0)


def test_runs_follow_priority_then_run_after(seen):
    """django-tasks-db test_run_after_priority: higher priority first (Django's order is
    taskrunner's: -100..100, higher first); between equal priorities, the one that could run
    earliest (its run_after) first."""
    assert seen["default"]["order"] == ["very_old", "old", "high", "low", "lower"]


def test_a_worker_of_one_queue_leaves_another_queue_alone(seen):
    """django-tasks-db test_doesnt_process_different_queue: a task in another of the
    backend's QUEUES is not run by a worker of ``default``; a worker of that queue runs it
    (``runner --queue emails``)."""
    assert seen["default"]["emails"]["status"] == "READY"
    assert (seen["all"]["emails"]["status"], seen["all"]["emails"]["return_value"]) == \
        ("SUCCESSFUL", ["emails"])


def test_task_started_and_task_finished_are_logged_by_the_runner(seen):
    """Django test_enqueue_logs / test_failed_logs: Django's own receivers of
    task_started and task_finished log each task's RUNNING, then SUCCESSFUL or FAILED,
    with its id: here in the runner that ran it."""
    for name, final in (("meaning_of_life", "SUCCESSFUL"), ("fails", "FAILED")):
        states = re.findall(r"Task id=%s path=\S+ state=(\w+)" % seen["ids"][name],
                            seen["log"])
        assert states[:2] == ["RUNNING", final], (name, states)
