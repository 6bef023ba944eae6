"""A task module that does not import where $DEMO_FRAGILE is set (a runner deployed without a
dependency the web process has)."""
import os

try:
    from django.tasks import task
except ImportError:         # Django < 6: the backport
    from django_tasks import task

if os.environ.get("DEMO_FRAGILE"):
    raise ImportError("a dependency of demo.fragile is missing here")


@task
def job():
    return 1
