"""taskrunner as a Django Tasks backend (`django.tasks` on Django 6, the ``django-tasks``
backport before it), and ``python manage.py taskrunner COMMAND``.

Settings::

    INSTALLED_APPS += ["taskrunner.contrib.django"]
    TASKS = {"default": {"BACKEND": "taskrunner.contrib.django.TaskrunnerBackend",
                         "QUEUES": ["default", "emails"],
                         "OPTIONS": {"DATABASE": "default"}}}

`TaskrunnerBackend` is loaded on first use: listing the app imports no tasks framework.
"""
from typing import Any

__all__ = ["TaskrunnerBackend"]


def __getattr__(name: str) -> Any:
    if name == "TaskrunnerBackend":
        from .backend import TaskrunnerBackend
        return TaskrunnerBackend
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
