import os

from django.apps import AppConfig

# The process that set Django up: under `manage.py taskrunner overseer`, the overseer, before
# it forked the runners that run the tasks.
SETUP_PID = []


class DemoConfig(AppConfig):
    name = "demo"

    def ready(self):
        SETUP_PID.append(os.getpid())
