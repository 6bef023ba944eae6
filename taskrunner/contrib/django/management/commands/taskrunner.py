"""``python manage.py taskrunner [--backend ALIAS] COMMAND ...``: any taskrunner command
(overseer, runner, status, dashboard, ...) on the database of the project's tasks backend
(``TASKS["default"]`` unless ``--backend``), with Django set up once: the overseer's runners
are forked from this process and inherit it."""
import os
import sys
from typing import Any, List

from django.core.management.base import BaseCommand, CommandError

from .....cli import main
from .....errors import TaskRunnerError


class Command(BaseCommand):
    help = ("Run a taskrunner command on the database of the project's tasks backend: "
            "manage.py taskrunner [--backend ALIAS] COMMAND [ARGS] (manage.py taskrunner "
            "--help lists taskrunner's commands)")

    def run_from_argv(self, argv: List[str]) -> None:
        # taskrunner's own parser reads the arguments: Django's would take taskrunner's
        # options (--json, --database, --help) for its own.
        sys.exit(self.run_taskrunner(list(argv[2:])))

    def handle(self, *args: Any, **options: Any) -> None:
        code = self.run_taskrunner(list(args))
        if code:
            raise CommandError("taskrunner %s exited %d" % (" ".join(args[:1]), code),
                               returncode=code)

    def run_taskrunner(self, argv: List[str]) -> int:
        from ...backend import TaskrunnerBackend
        from ...compat import tasks
        alias = "default"
        if argv[:1] == ["--backend"] and len(argv) > 1:
            alias, argv = argv[1], argv[2:]
        try:
            backend = tasks.package.task_backends[alias]
        except Exception as exc:     # Django's InvalidTaskBackend, whatever its name
            self.stderr.write("taskrunner: error: TASKS[%r]: %s" % (alias, exc))
            return 2
        if not isinstance(backend, TaskrunnerBackend):
            self.stderr.write("taskrunner: error: TASKS[%r] is not a TaskrunnerBackend" % alias)
            return 2
        try:
            url = backend.database_url()
        except TaskRunnerError as exc:
            self.stderr.write("taskrunner: error: %s" % exc)
            return 2
        # The environment, not --database: a password on the command line is visible to
        # every user of the host (ps); the overseer's HUP reload reads it again.
        os.environ["TASKRUNNER_DATABASE_URL"] = url
        # The backend's QUEUES are lanes of their own (TaskrunnerBackend.declared_queues).
        os.environ["TASKRUNNER_QUEUES"] = backend.declared_queues()
        if backend.options.get("CONFIG"):
            os.environ["TASKRUNNER_CONFIG"] = str(backend.options["CONFIG"])
        return int(main(argv) or 0)
