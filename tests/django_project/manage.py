#!/usr/bin/env python
"""The Django project the integration tests run (tests/test_django.py): its database is
$DEMO_DATABASE_URL (a taskrunner URL), its tasks are in demo/tasks.py."""
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    from django.core.management import execute_from_command_line
    execute_from_command_line(sys.argv)
