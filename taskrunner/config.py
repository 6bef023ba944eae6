"""Configuration: every key, its default and its check, declared once in `SCHEMA`.

A config file is TOML. Every key is optional; unknown sections and keys are errors (a typo
must not silently fall back to a default). Errors name the file and the key.
"""
import os
import sys
from types import SimpleNamespace

from .errors import ConfigError
from .timespan import parse_timespan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on older Pythons only
    import tomli as tomllib

DEFAULT_DATABASE_URL = "sqlite:///taskrunner.db"


def _int(minimum=None):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("expected an integer")
        if minimum is not None and value < minimum:
            raise ValueError("must be at least %d" % minimum)
        return value
    return check


def _seconds(value):
    return parse_timespan(value)


def _positive_seconds(value):
    seconds = parse_timespan(value)
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def _choice(*choices):
    def check(value):
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError("expected one of %s" % ", ".join(choices))
        return value.lower()
    return check


def _string(value):
    if not isinstance(value, str):
        raise ValueError("expected a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid UTF-8 text") from None
    return value


def _bool(value):
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def _string_list(value):
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of strings")
    return list(value)


# section -> key -> (default, check). config.example.toml documents each of these.
SCHEMA = {
    "database": {
        "url": (DEFAULT_DATABASE_URL, _string),
        "sqlite_synchronous": ("full", _choice("full", "normal", "off")),
        "busy_timeout": (30.0, _positive_seconds),
    },
    "runner": {
        "limit": (8, _int(1)),
        "poll_interval": (1.0, _positive_seconds),
        "memory_limit": (100, _int(1)),
        "max_runs": (0, _int(0)),
        "heartbeat_interval": (5.0, _positive_seconds),
        # "" = liveness.default_host_id(); wake-ups: "" = $TASKRUNNER_WAKEUP_DIR, then
        # $XDG_RUNTIME_DIR or the temporary directory (see wakeup.base_directory).
        "host_id": ("", _string),
        "wakeup_dir": ("", _string),
    },
    "task": {
        "run_timeout": (86400.0, _positive_seconds),
        "max_retries": (5, _int(1)),
        "max_data_size": (1048576, _int(2)),
        "retry_backoff": (10.0, _seconds),
        "retry_backoff_max": (3600.0, _seconds),
    },
    "handlers": {
        "allow": ([], _string_list),
    },
    "rotation": {
        "keep_success": (7 * 86400.0, _seconds),
        "keep_failed": (30 * 86400.0, _seconds),
        "keep_runners": (86400.0, _seconds),
        "batch_size": (1000, _int(1)),
        "timer": ("hourly", _string),
    },
    "overseer": {
        "check_interval": (1.0, _positive_seconds),
        "heartbeat_timeout": (60.0, _positive_seconds),
        "graceful_timeout": (30.0, _seconds),
        "kill_grace": (10.0, _seconds),
        "max_start_failures": (10, _int(1)),
        "crash_grace": (60.0, _seconds),
    },
    "log": {
        "level": ("info", _choice("debug", "info", "warning", "error")),
        "format": ("text", _choice("text", "json")),
    },
    "dashboard": {
        "bind": ("127.0.0.1:8411", _string),
        "read_only": (False, _bool),
        # pbkdf2_sha256$iterations$salt$hash, from `taskrunner dashboard --hash-password`.
        "password_hash": ("", _string),
        # The name of an environment variable holding the password.
        "password_env": ("", _string),
    },
}


# Keys checked against each other: (section, key) must be `relation` (section, key).
CONSTRAINTS = (
    # A runner must beat more than once per timeout, or a healthy one is declared hung.
    (("runner", "heartbeat_interval"), ("overseer", "heartbeat_timeout"), "<"),
    (("task", "retry_backoff"), ("task", "retry_backoff_max"), "<="),
)


class Config(SimpleNamespace):
    """Sections as attributes: ``config.runner.limit``; ``config.periodic`` is the list of
    ``[[periodic]]`` tables; ``config.source`` is the file or ``<defaults>``."""

    @classmethod
    def from_dict(cls, data, source="<config>"):
        if not isinstance(data, dict):
            raise ConfigError("%s: expected a table of sections" % source)
        for section in data:
            if section not in SCHEMA and section != "periodic":
                raise ConfigError("%s: unknown section [%s]" % (source, section))
        periodic = data.get("periodic", [])
        if not isinstance(periodic, list) or not all(isinstance(p, dict) for p in periodic):
            raise ConfigError("%s: periodic tasks are written as [[periodic]] tables" % source)
        sections = {}
        for section, keys in SCHEMA.items():
            given = data.get(section, {})
            if not isinstance(given, dict):
                raise ConfigError("%s: [%s] must be a table" % (source, section))
            for key in given:
                if key not in keys:
                    raise ConfigError("%s: unknown key %r in [%s]" % (source, key, section))
            values = {}
            for key, (default, check) in keys.items():
                if key in given:
                    try:
                        values[key] = check(given[key])
                    except ValueError as exc:
                        raise ConfigError("%s: [%s] %s: %s" % (source, section, key, exc)) from None
                else:
                    values[key] = list(default) if isinstance(default, list) else default
            sections[section] = SimpleNamespace(**values)
        for (first, bigger), (second, smaller), relation in CONSTRAINTS:
            value, limit = getattr(sections[first], bigger), getattr(sections[second], smaller)
            if not value < limit if relation == "<" else not value <= limit:
                raise ConfigError("%s: [%s] %s (%gs) must be %s [%s] %s (%gs)" % (
                    source, first, bigger, value,
                    "shorter than" if relation == "<" else "at most", second, smaller, limit))
        # [[periodic]] entries are checked when they are synced or by `taskrunner check`
        # (periodic.validate_definitions: that needs the timers and the handlers).
        return cls(source=source, periodic=[dict(p) for p in periodic], **sections)

    @classmethod
    def load(cls, path=None, database_url=None, environ=None):
        """Read `path` (or $TASKRUNNER_CONFIG); the URL precedence is argument,
        $TASKRUNNER_DATABASE_URL, then ``[database] url``."""
        environ = os.environ if environ is None else environ
        path = path or environ.get("TASKRUNNER_CONFIG") or None
        data = {}
        if path:
            try:
                with open(path, "rb") as fh:
                    data = tomllib.load(fh)
            except FileNotFoundError:
                raise ConfigError("%s: config file not found" % path) from None
            except OSError as exc:
                raise ConfigError("%s: cannot read config file: %s" % (path, exc.strerror)) from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError("%s: invalid TOML: %s" % (path, exc)) from None
            except UnicodeDecodeError:
                raise ConfigError("%s: invalid TOML: not UTF-8 text" % path) from None
        config = cls.from_dict(data, source=path or "<defaults>")
        if database_url is not None and not database_url.strip():
            raise ConfigError("the database URL given is empty")
        url = database_url or environ.get("TASKRUNNER_DATABASE_URL")
        if url and not database_url:
            try:
                url.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError("$TASKRUNNER_DATABASE_URL is not valid UTF-8 text") from None
        if url:
            config.database.url = url
        return config
