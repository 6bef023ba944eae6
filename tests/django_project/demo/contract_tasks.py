"""The tasks of tests/test_django_contract.py: the kinds of task that Django's and
django-tasks-db's own test suites run through a backend (written here for this project)."""
import asyncio

try:
    from django.tasks import task
except ImportError:         # Django < 6: the backport
    from django_tasks import task


@task
def noop(*args, **kwargs):
    return None


@task
async def noop_async(*args, **kwargs):
    await asyncio.sleep(0)


@task
def meaning_of_life():
    return 42


@task
def fails_with_value_error():
    raise ValueError("this task failed with a ValueError")


@task
def fails_with_nested_exception():
    raise ValueError(ValueError("the inner one"))


@task
def returns_what_json_cannot_hold():
    return {"a set": {1, 2}}


@task(takes_context=True)
def own_id(context):
    return context.task_result.id


@task(takes_context=True)
def attempt_number(context, value):
    return {"attempt": context.attempt, "value": value}


@task(queue_name="emails")
def in_emails():
    return "emails"
