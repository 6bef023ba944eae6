import json
import os

from django.apps import AppConfig

# The process that set Django up: under `manage.py taskrunner overseer`, the overseer, before
# it forked the runners that run the tasks.
SETUP_PID = []


def _record_signal(name):
    """A receiver of Django's task signal `name` that appends what it was sent to the file
    $DEMO_SIGNAL_LOG, one JSON line each."""
    def receiver(sender, task_result, **kwargs):
        line = {"signal": name, "sender": sender.__name__, "task": task_result.task.name,
                "id": task_result.id, "status": str(task_result.status.name),
                "errors": [e.exception_class_path for e in task_result.errors],
                "pid": os.getpid()}
        with open(os.environ["DEMO_SIGNAL_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")
    return receiver


class DemoConfig(AppConfig):
    name = "demo"

    def ready(self):
        SETUP_PID.append(os.getpid())
        if os.environ.get("DEMO_SIGNAL_LOG"):
            from taskrunner.contrib.django.compat import tasks
            for name in ("task_started", "task_finished"):
                receiver = _record_signal(name)
                getattr(tasks, name).connect(receiver, weak=False)
