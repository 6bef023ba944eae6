"""The Django app: ``manage.py migrate`` also brings taskrunner's tables up to date in each
database that a `TaskrunnerBackend` keeps them in (Django's test databases too)."""
from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class TaskrunnerConfig(AppConfig):
    name = "taskrunner.contrib.django"
    label = "taskrunner"
    verbose_name = "taskrunner"

    def ready(self) -> None:
        post_migrate.connect(migrate_tables, sender=self)
        # Importing the Tasks framework registers its system checks, which call each
        # backend's check() (Django 6 imports django.tasks only when something uses it).
        from . import compat  # noqa: F401
        # task_finished for the ends no runner's handler saw (a runner's death, a timeout, a
        # cancel), from whichever process records them: wired here, at Django's boot, so
        # every process with this project's receivers (the overseer of ``manage.py
        # taskrunner``, its maintainer and runners, the web processes) sends it.
        from ...runs import lifecycle
        from .signals import finished_elsewhere
        lifecycle.after_failure(finished_elsewhere)


def migrate_tables(using: str = "default", **kwargs: Any) -> None:
    from .backend import TaskrunnerBackend
    from .compat import tasks
    for backend in tasks.package.task_backends.all():
        if isinstance(backend, TaskrunnerBackend) and backend.database == using:
            backend.queue(migrate=True)
