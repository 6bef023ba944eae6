"""Which Django Tasks the project uses: `django.tasks` (Django 6 and later) or the
``django-tasks`` backport (``django_tasks``, Django 4.2 / 5.x). Both have the same classes
under the same names but one exception (``InvalidTask`` / ``InvalidTaskError``); a Task
made by one is not valid for the other, so one of them is chosen for the whole process: the
backport when it is in INSTALLED_APPS (a Django 6 project that keeps it), else
`django.tasks` where it exists."""
import importlib
from types import SimpleNamespace

from django.conf import settings


def _load():
    modules = ["django.tasks", "django_tasks"]
    if "django_tasks" in settings.INSTALLED_APPS:
        modules.reverse()
    for name in modules:
        try:
            package = importlib.import_module(name)
        except ImportError:
            continue
        base = importlib.import_module(name + ".base")
        backends = importlib.import_module(name + ".backends.base")
        exceptions = importlib.import_module(name + ".exceptions")
        signals = importlib.import_module(name + ".signals")
        normalize = (importlib.import_module("django_tasks.utils") if name == "django_tasks"
                     else importlib.import_module("django.utils.json")).normalize_json
        return SimpleNamespace(
            name=name, package=package, Task=base.Task, TaskResult=base.TaskResult,
            TaskResultStatus=base.TaskResultStatus, TaskError=base.TaskError,
            TaskContext=base.TaskContext, BaseTaskBackend=backends.BaseTaskBackend,
            InvalidTask=getattr(exceptions, "InvalidTask", None)
            or exceptions.InvalidTaskError,
            TaskResultDoesNotExist=exceptions.TaskResultDoesNotExist,
            task_enqueued=signals.task_enqueued, task_started=signals.task_started,
            task_finished=signals.task_finished, normalize_json=normalize)
    raise ImportError("neither django.tasks (Django 6) nor the django-tasks backport is "
                      "installed: pip install 'taskrunner-db[django]'")


tasks = _load()
