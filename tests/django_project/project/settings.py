import os
from urllib.parse import unquote, urlsplit

import django

SECRET_KEY = "tests-only"
USE_TZ = os.environ.get("DEMO_USE_TZ", "1") == "1"
TIME_ZONE = "Europe/Paris"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
ROOT_URLCONF = "project.urls"

INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth",
                  "django.contrib.sessions", "taskrunner.contrib.django", "demo"]
if django.VERSION < (6,):
    INSTALLED_APPS.append("django_tasks")      # the backport


def _database(url):
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parts.path[1:]}
    engine = {"postgresql": "postgresql", "mysql": "mysql"}[parts.scheme]
    return {"ENGINE": "django.db.backends." + engine, "NAME": parts.path.lstrip("/"),
            "USER": unquote(parts.username or ""), "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "", "PORT": str(parts.port or "")}


DATABASES = {"default": _database(os.environ["DEMO_DATABASE_URL"])}

TASKS = {"default": {
    "BACKEND": "taskrunner.contrib.django.TaskrunnerBackend",
    "QUEUES": ["default", "emails"],
    "OPTIONS": {"DATABASE": "default", "MAX_ATTEMPTS": 2, "RETRY_BACKOFF": 0.2,
                "CONFIG": os.environ.get("DEMO_TASKRUNNER_CONFIG")},
}}
# Another backend's task, enqueued on taskrunner's with .using(backend="default").
TASKS["elsewhere"] = {"BACKEND": ("django.tasks" if django.VERSION >= (6,) else "django_tasks")
                      + ".backends.dummy.DummyBackend"}
if os.environ.get("DEMO_MAX_RUNTIME"):
    TASKS["default"]["OPTIONS"]["MAX_RUNTIME"] = float(os.environ["DEMO_MAX_RUNTIME"])
if not TASKS["default"]["OPTIONS"]["CONFIG"]:
    del TASKS["default"]["OPTIONS"]["CONFIG"]

if os.environ.get("DEMO_MEMORY_BACKEND"):
    # A backend whose database no runner could reach: refused by Django's checks.
    DATABASES["memory"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    TASKS["memory"] = {"BACKEND": "taskrunner.contrib.django.TaskrunnerBackend",
                       "OPTIONS": {"DATABASE": "memory"}}

MIDDLEWARE = ["django.contrib.sessions.middleware.SessionMiddleware",
              "django.middleware.csrf.CsrfViewMiddleware",
              "django.contrib.auth.middleware.AuthenticationMiddleware"]
