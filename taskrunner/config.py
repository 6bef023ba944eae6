"""Configuration: every key, its default and its check, declared once in `SCHEMA`.

A config file is TOML. Every key is optional; unknown sections and keys are errors (a typo
must not silently fall back to a default). Errors name the file and the key.
"""
import os
import re
import sys
from types import SimpleNamespace
from urllib.parse import urlsplit

from .errors import ConfigError, InputError
from .passwords import is_hash
from .timespan import parse_timespan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on older Pythons only
    import tomli as tomllib

DEFAULT_DATABASE_URL = "sqlite:///taskrunner.db"
DEFAULT_QUEUE = "default"
# A queue name: safe in a comma-separated --queue list, a log line and a metric label.
QUEUE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def check_queue_name(value, what="queue"):
    """`value` if it is a valid queue name, else InputError naming `what`."""
    if not isinstance(value, str) or not QUEUE_NAME.match(value):
        raise InputError("%s must be 1 to 64 letters, digits, '_', '.', ':' or '-', not %r"
                         % (what, value))
    return value


def parse_queue_list(text):
    """``"a,b"`` (the ``--queue`` option) as a tuple of names; InputError when invalid."""
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        check_queue_name(name, "--queue")
    if len(set(names)) != len(names):
        raise InputError("--queue names a queue twice: %r" % text)
    return names


def _int(minimum=None, maximum=None):
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("expected an integer")
        if minimum is not None and value < minimum:
            raise ValueError("must be at least %d" % minimum)
        if maximum is not None and value > maximum:
            raise ValueError("must be at most %d" % maximum)
        return value
    return check


# max_retries counts runs, the first included; Celery's counts the retries after it, so
# its "no retry" (0) is refused here with the translation rather than a bare range error.
MAX_RETRIES_ZERO = ("max_retries counts runs in all, the first included: 1 is one run and "
                    "no retry (Celery's max_retries=0; or write max_attempts, the same count "
                    "by its clear name); 0 would never run the task")
MAX_ATTEMPTS_ZERO = ("max_attempts counts runs in all, the first included: 1 is one run and "
                     "no retry; 0 would never run the task")


def _max_retries(value):
    if value == 0 and not isinstance(value, bool):
        raise ValueError(MAX_RETRIES_ZERO)
    return _int(1)(value)


def _max_attempts(value):
    """[task] max_attempts: 0 (the default) leaves the count to max_retries."""
    if value == 0 and not isinstance(value, bool):
        return 0
    return _int(1)(value)


def one_count_of_runs(max_retries, max_attempts, where=""):
    """The runs in all a task may take, given as `max_attempts` (the clear name) or
    `max_retries` (the same count, its older name, kept for compatibility): whichever is
    given, or None; InputError when both are, unless they agree."""
    if max_attempts is None:
        return max_retries
    if max_retries is not None and max_retries != max_attempts:
        raise InputError("%smax_attempts (%r) and max_retries (%r) are the same count, runs in "
                         "all: give one" % (where, max_attempts, max_retries))
    if max_attempts == 0 and not isinstance(max_attempts, bool):
        raise InputError(where + MAX_ATTEMPTS_ZERO)
    return max_attempts


def _seconds(value):
    return parse_timespan(value)


def _positive_seconds(value):
    seconds = parse_timespan(value)
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def _flush_interval(value):
    seconds = _positive_seconds(value)
    if seconds > 1:
        # Outcomes wait this long, unrecorded: a crash re-executes what finished meanwhile.
        raise ValueError("must be at most 1s")
    return seconds


def _choice(*choices):
    def check(value):
        if not isinstance(value, str) or value.lower() not in choices:
            raise ValueError("expected one of %s" % ", ".join(repr(c) if not c else c
                                                               for c in choices))
        return value.lower()
    return check


def _setup_path(value):
    value = _string(value)
    if value and not re.fullmatch(r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*", value):
        raise ValueError("expected 'module:function' (or 'module.function'), e.g. "
                         "'myapp.telemetry:configure'")
    return value


def _string(value):
    if not isinstance(value, str):
        raise ValueError("expected a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid UTF-8 text") from None
    return value


# The longest code version (task_runners.code_version, task_queue.code_version).
CODE_VERSION_LIMIT = 64


def check_code_version(value):
    """A code version: "" (computed, runner/versions.py) or printable text of at most
    CODE_VERSION_LIMIT characters without spaces (it is a word on every face and a metric's
    label)."""
    if not isinstance(value, str) or len(value) > CODE_VERSION_LIMIT or any(
            not c.isprintable() or c.isspace() for c in value):
        raise ValueError("expected a version of at most %d printable characters without "
                         "spaces, e.g. a git commit or a release number" % CODE_VERSION_LIMIT)
    return value


def _bool(value):
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def _password_hash(value):
    """"" (none) or the output of ``--hash-password``; the text itself is not quoted back: it
    may be a password written where its hash belongs."""
    if not isinstance(value, str) or (value and not is_hash(value)):
        raise ValueError("expected the output of `taskrunner run-event --hash-password` "
                         "(a pbkdf2_sha256$... hash)")
    return value


def _string_list(value):
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of strings")
    return list(value)


def _words(value):
    words = _string_list(value)
    if not all(word.strip() for word in words):
        raise ValueError("an empty word would match every key")
    return [word.strip().lower() for word in words]


# Task data keys whose values are never shown (masking.py): a key containing one of these.
SECRET_KEYS = ["password", "passwd", "secret", "token", "api_key", "apikey", "private_key",
               "authorization", "credential"]


# A rate limit: "100/s", "6000/min", "20/h" (runs/flow.py's token buckets).
RATE_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
              "h": 3600.0, "hour": 3600.0}
RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([a-z]+)\s*$")


def parse_rate(text):
    """``"25/s"`` as tokens per second (25.0); ValueError for anything else."""
    match = RATE.match(text) if isinstance(text, str) else None
    if match is None or match.group(2) not in RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError("expected a rate like '100/s', '6000/min' or '20/h', not %r" % (text,))
    return float(match.group(1)) / RATE_UNITS[match.group(2)]


def default_burst(rate):
    """The burst of a rate limit that sets none: a tenth of a second of it, at least 1."""
    return max(1.0, float(int(rate / 10)))


def _rate(value):
    if value != "":
        parse_rate(value)
    return value


def _burst(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (value != 0 and value < 1):
        raise ValueError("expected 0 (a tenth of a second of the rate) or a number >= 1")
    return float(value)


# Each [queues.NAME] table: key -> (default, check).
QUEUE_SCHEMA = {
    "limit": (1, _int(1)),
    "priority": (0, _int()),
    "rate": ("", _rate),
    "burst": (0, _burst),
    "fair_by": ("", _choice("", "tenant")),
    "aging": (0.0, _seconds),
    "aging_max": (100, _int()),
}

# section -> key -> (default, check). config.example.toml documents each of these.
SCHEMA = {
    "database": {
        "url": (DEFAULT_DATABASE_URL, _string),
        "sqlite_synchronous": ("full", _choice("full", "normal", "off")),
        "busy_timeout": (30.0, _positive_seconds),
        # "pgbouncer": the url goes through PgBouncer in transaction pooling mode (see
        # POOLERS). listen_url: a direct PostgreSQL URL of the same database for LISTEN; ""
        # = LISTEN on url, or with a pooler no LISTEN at all (runners poll).
        "pooler": ("", _choice("", "pgbouncer")),
        "listen_url": ("", _string),
    },
    "runner": {
        "limit": (8, _int(1)),
        "poll_interval": (1.0, _positive_seconds),
        "memory_limit": (100, _int(1)),
        "max_runs": (0, _int(0)),
        "heartbeat_interval": (5.0, _positive_seconds),
        # Batched acknowledgements (batches.py): runs claimed at once, and how long a
        # success may wait for the others' before it is committed. 1 = one at a time.
        "batch": (1, _int(1, maximum=1000)),
        "flush_interval": (0.005, _flush_interval),
        # "" = liveness.default_host_id(); wake-ups: "" = $TASKRUNNER_WAKEUP_DIR, else
        # beside a SQLite file, else $XDG_RUNTIME_DIR or the temporary directory
        # (see wakeup.directory).
        "host_id": ("", _string),
        # The version of the handler code its runners run; "" = $TASKRUNNER_CODE_VERSION,
        # else a digest of the application's source (runner/versions.py).
        "code_version": ("", check_code_version),
        "wakeup_dir": ("", _string),
    },
    "task": {
        "run_timeout": (86400.0, _positive_seconds),
        "max_retries": (5, _max_retries),
        "max_attempts": (0, _max_attempts),
        "max_data_size": (1048576, _int(2)),
        "max_result_size": (1048576, _int(2)),
        "retry_backoff": (10.0, _seconds),
        "retry_backoff_max": (3600.0, _seconds),
        "secret_keys": (SECRET_KEYS, _words),
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
        # Host names (besides IP addresses, localhost names and this host's name) that
        # requests may name in their Host header: a reverse proxy's, a DNS name of this host.
        "allowed_hosts": ([], _string_list),
        # /metrics and `taskrunner metrics`: queues and periodic tasks with series of their
        # own besides the configured ones (the busiest); the rest are summed as "(other)".
        "metrics_series": (100, _int(1)),
        # A credential for /metrics alone (a scraper that may not see the pages): HTTP Basic,
        # as password_hash / password_env.
        "metrics_password_hash": ("", _string),
        "metrics_password_env": ("", _string),
    },
    "tracing": {
        # "module:function" called once in each runner process as it starts, to configure
        # OpenTelemetry (tracing.py); "" = none.
        "setup": ("", _setup_path),
    },
    "run_event": {
        # In-Portal's `run_event.php EVENT password_here`: when set, every `run-event` must
        # be given the password after the event. From `taskrunner run-event --hash-password`.
        "password_hash": ("", _password_hash),
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
    ``[[periodic]]`` tables; ``config.queues`` maps a queue name to its ``[queues.NAME]``
    (``.limit``, ``.priority``); ``config.source`` is the file or ``<defaults>``."""

    @classmethod
    def from_dict(cls, data, source="<config>"):
        if not isinstance(data, dict):
            raise ConfigError("%s: expected a table of sections" % source)
        for section in data:
            if section not in SCHEMA and section not in ("periodic", "queues", "rate_limits"):
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
        task = sections["task"]
        if task.max_attempts:
            if "max_retries" in data.get("task", {}) and task.max_retries != task.max_attempts:
                raise ConfigError("%s: [task] max_attempts (%d) and max_retries (%d) are the "
                                  "same count, runs in all: give one"
                                  % (source, task.max_attempts, task.max_retries))
            task.max_retries = task.max_attempts
        for (first, bigger), (second, smaller), relation in CONSTRAINTS:
            value, limit = getattr(sections[first], bigger), getattr(sections[second], smaller)
            if not value < limit if relation == "<" else not value <= limit:
                raise ConfigError("%s: [%s] %s (%gs) must be %s [%s] %s (%gs)" % (
                    source, first, bigger, value,
                    "shorter than" if relation == "<" else "at most", second, smaller, limit))
        check_pooler(sections["database"], source)
        queues = _queues(data.get("queues", {}), source, sections["runner"].limit)
        # [[periodic]] entries are checked when they are synced or by `taskrunner check`
        # (periodic.validate_definitions: that needs the timers and the handlers).
        return cls(source=source, periodic=[dict(p) for p in periodic], queues=queues,
                   rate_limits=_rate_limits(data.get("rate_limits", {}), source),
                   warnings=_queue_warnings(data.get("queues", {}), source), **sections)

    def queue_groups(self, stored=None):
        """The runners an overseer keeps, as {queues served (a tuple): how many}: ``limit``
        runners for each configured queue — the limit `stored` on its row ({queue: limit},
        ``queue limit``) where there is one — and the rest of ``[runner] limit`` after the
        configured limits for ``default`` (which also serves every queue not configured).
        The overseer fits them into ``[runner] limit`` in this order."""
        stored = stored or {}
        groups = {(name,): stored.get(name) or q.limit for name, q in self.queues.items()}
        if DEFAULT_QUEUE not in self.queues:
            groups[(DEFAULT_QUEUE,)] = self.runner.limit - sum(
                q.limit for q in self.queues.values())
        return groups

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
        declare_queues(data, environ.get("TASKRUNNER_QUEUES", ""))
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
            check_pooler(config.database, config.source)
        version = environ.get("TASKRUNNER_CODE_VERSION", "")
        if version:
            try:
                config.runner.code_version = check_code_version(version)
            except ValueError as exc:
                raise ConfigError("$TASKRUNNER_CODE_VERSION: %s" % exc) from None
        return config


def declare_queues(data, names):
    """$TASKRUNNER_QUEUES (``"emails,reports"``): queues that get runners of their own as if
    the file had an empty ``[queues.NAME]`` table each (one it has is kept as written): an
    application that names its queues (Django's ``QUEUES``) keeps them apart from
    ``default`` without writing a config file."""
    queues = data.setdefault("queues", {})
    if not isinstance(queues, dict):
        return      # from_dict says what is wrong with it
    for name in (n.strip() for n in names.split(",")):
        if not name or name == DEFAULT_QUEUE:
            continue
        try:
            check_queue_name(name, "queue name")
        except InputError as exc:
            raise ConfigError("$TASKRUNNER_QUEUES: %s" % exc) from None
        queues.setdefault(name, {})


def _is_postgresql(url):
    try:
        return urlsplit(url).scheme.lower() in ("postgres", "postgresql")
    except ValueError:
        return False     # malformed: db.open_database says what is wrong with it


def check_pooler(database, source):
    """[database] pooler and listen_url only mean something on PostgreSQL; listen_url must
    itself be a PostgreSQL URL. The URLs are not quoted: they may hold a password."""
    for key in ("pooler", "listen_url"):
        if getattr(database, key) and not _is_postgresql(database.url):
            raise ConfigError("%s: [database] %s is for PostgreSQL only; the database URL is "
                              "not a postgresql:// URL" % (source, key))
    if database.listen_url and not _is_postgresql(database.listen_url):
        raise ConfigError("%s: [database] listen_url: expected a postgresql:// URL of the same "
                          "database, connecting directly (not through the pooler)" % source)


def _queues(given, source, host_limit):
    """The [queues.NAME] tables, checked: names, keys, and limits that fit the host's."""
    if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
        raise ConfigError("%s: queues are written as [queues.NAME] tables" % source)
    queues = {}
    for name, table in given.items():
        try:
            check_queue_name(name, "queue name")
        except InputError as exc:
            raise ConfigError("%s: [queues.%s]: %s" % (source, name, exc)) from None
        values = {}
        for key in table:
            if key not in QUEUE_SCHEMA:
                raise ConfigError("%s: unknown key %r in [queues.%s]" % (source, key, name))
        for key, (default, check) in QUEUE_SCHEMA.items():
            try:
                values[key] = check(table[key]) if key in table else default
            except ValueError as exc:
                raise ConfigError("%s: [queues.%s] %s: %s" % (source, name, key, exc)) from None
        # The rate in tokens per second (None: no limit), and the burst it implies.
        values["per_second"] = parse_rate(values["rate"]) if values["rate"] else None
        if values["per_second"] is not None and not values["burst"]:
            values["burst"] = default_burst(values["per_second"])
        queues[name] = SimpleNamespace(**values)
    total = sum(q.limit for q in queues.values())
    spare = 0 if DEFAULT_QUEUE in queues else 1
    if total + spare > host_limit:
        raise ConfigError("%s: [queues] limits add up to %d, over [runner] limit (%d)%s"
                          % (source, total, host_limit,
                             "" if not spare else " less one runner for the default queue"))
    return queues


def _queue_warnings(given, source):
    """Valid settings that likely do not mean what they say, one line each: a
    [queues.NAME] table without `limit` gets one runner per host (a table written for its
    `rate` alone would otherwise silently run one task at a time)."""
    return ["%s: [queues.%s] sets no limit: one runner per host serves it (limit = 1); set "
            "limit to say how many" % (source, name)
            for name, table in given.items() if "limit" not in table]


def check_rate_pattern(value, what="rate key"):
    """A rate key, or a prefix of keys ending in ``*`` (``tenant:*``); InputError if not."""
    if not isinstance(value, str) or not value or len(value) > 255 or \
            "*" in value[:-1] or value.strip() != value:
        raise InputError("%s must be 1 to 255 characters without surrounding spaces, with "
                         "'*' only at the end (a prefix), not %r" % (what, value))
    return value


def rate_limit(value):
    """A ``[rate_limits]`` value: ``"25/s"`` or ``{rate = "25/s", burst = 5}``, as
    (tokens per second, burst, the rate as written); ValueError if not."""
    if isinstance(value, dict):
        unknown = set(value) - {"rate", "burst"}
        if unknown or "rate" not in value:
            raise ValueError("expected \"25/s\" or {rate = \"25/s\", burst = 5}")
        text, burst = value["rate"], _burst(value.get("burst", 0))
    else:
        text, burst = value, 0.0
    rate = parse_rate(text)
    return rate, burst or default_burst(rate), text


def _rate_limits(given, source):
    """The [rate_limits] table: key or prefix -> (rate, burst, text)."""
    if not isinstance(given, dict):
        raise ConfigError("%s: [rate_limits] must be a table" % source)
    limits = {}
    for pattern, value in given.items():
        try:
            check_rate_pattern(pattern)
            limits[pattern] = rate_limit(value)
        except (InputError, ValueError) as exc:
            raise ConfigError("%s: [rate_limits] %r: %s" % (source, pattern, exc)) from None
    return limits


# What each key means, in words: the configuration reference (docs/reference/configuration.md)
# is generated from SCHEMA, QUEUE_SCHEMA and these, as gunicorn's settings page is from its
# settings; tests/test_docs.py fails when a key has no description.
DESCRIPTIONS = {
    ("database", "url"):
        "`sqlite:///relative/path`, `sqlite:////absolute/path`, "
        "`postgresql://user:password@host:5432/db` or `mysql://user:password@host:3306/db`. "
        "`--database` and `$TASKRUNNER_DATABASE_URL` override it.",
    ("database", "sqlite_synchronous"):
        "SQLite only. `full`: durable commits (a committed task survives power loss; a host's "
        "runners share one sync of the WAL); `normal`: the last commits may be lost on power "
        "loss, faster; `off`.",
    ("database", "busy_timeout"):
        "SQLite only: how long to wait for another program's write lock before failing (this "
        "host's taskrunner processes take turns on `<database>-hostlock` first, and wait no "
        "longer for it).",
    ("database", "pooler"):
        "PostgreSQL only. `pgbouncer` when `url` goes through PgBouncer in transaction pooling "
        "mode: no server-side prepared statements and no LISTEN on `url`. `\"\"`: a direct "
        "connection.",
    ("database", "listen_url"):
        "PostgreSQL only: a direct URL of the same database (not through the pooler) on which "
        "each host's overseer LISTENs for wake-ups from other hosts. `\"\"`: LISTEN on `url`, "
        "or with a pooler not at all.",
    ("runner", "limit"):
        "Runners that may run at once on one host, however they were started (overseer "
        "children, supervisord `numprocs`, cron `run-event`).",
    ("runner", "poll_interval"):
        "Longest an idle runner waits before looking for work again.",
    ("runner", "memory_limit"):
        "MB of RSS after which a runner exits after its current run (and is replaced).",
    ("runner", "max_runs"):
        "Runs after which a runner exits; 0 = never (the overseer adds a random 0-10 %, so "
        "runners do not all recycle at once).",
    ("runner", "heartbeat_interval"):
        "How often a runner refreshes its heartbeat (and RSS); must be shorter than "
        "`[overseer] heartbeat_timeout`.",
    ("runner", "batch"):
        "Runs a busy runner claims in one transaction, their successes committed together "
        "(batched acknowledgements; at most 1000), and no more than its share of the "
        "queue's backlog among the running runners. 1 = one run at a time.",
    ("runner", "flush_interval"):
        "With `batch` > 1: the longest a success waits before it is committed (at most 1s). A "
        "crash re-executes the successes not committed yet.",
    ("runner", "code_version"):
        "The version of the handler code this host's runners run, recorded on each runner "
        "and on each durable task it starts (docs: \"Changing durable code under running "
        "work\"); `$TASKRUNNER_CODE_VERSION` overrides it. \"\" = a digest of the "
        "application's source, which changes when a deploy changes it; set it (a release, "
        "a git commit) to name versions yourself.",
    ("runner", "host_id"):
        "This host's identity in `task_runners`; a PID is judged only on the host that "
        "recorded it. `\"\"`: the hostname, plus `/pidns:INODE` inside a PID namespace of "
        "its own (a container).",
    ("runner", "wakeup_dir"):
        "Where idle runners' wake-up sockets live. `\"\"`: `$TASKRUNNER_WAKEUP_DIR`, else a "
        "SQLite database's beside its file (`<database>-wakeup`), a server database's in "
        "`$XDG_RUNTIME_DIR`, else the temporary directory.",
    ("task", "run_timeout"):
        "Default for a task: a run with no update (heartbeat, progress) for this long is "
        "timed out.",
    ("task", "max_retries"):
        "Default for a task: runs in all, the first included, that may fail in a row before "
        "it is given up (1: one run, no retry; Celery's `max_retries` + 1). `max_attempts` is "
        "the same count by its clear name.",
    ("task", "max_attempts"):
        "The same count as `max_retries`, by its clear name: runs in all, the first included "
        "(1: one run, no retry). `0`: `max_retries` decides; both given must agree.",
    ("task", "max_data_size"):
        "Largest task data, in bytes of JSON.",
    ("task", "max_result_size"):
        "Largest result of a step (`run.step`) or checkpoint, in bytes of JSON: a larger one "
        "fails the run (error code `TooLarge`) and is not stored.",
    ("task", "retry_backoff"):
        "Backoff after the n-th consecutive failure: `retry_backoff * 2^(n-1)`, with jitter "
        "(between half and all of it); a task may set its own.",
    ("task", "retry_backoff_max"):
        "The backoff's cap.",
    ("handlers", "allow"):
        "Glob patterns of the handler paths that may be queued and run, e.g. "
        "`[\"myapp.tasks.*\"]`; checked before anything is imported. Empty: any importable "
        "`TaskHandler`.",
    ("rotation", "keep_success"):
        "Successful tasks (with their runs) are deleted this long after they finished.",
    ("rotation", "keep_failed"):
        "Given-up and cancelled tasks are deleted this long after they ended.",
    ("rotation", "keep_runners"):
        "Finished runner rows are deleted this long after they finished.",
    ("rotation", "batch_size"):
        "Rows deleted per transaction.",
    ("rotation", "timer"):
        "When the built-in periodic task `taskrunner.rotate` runs rotation (a calendar event "
        "or `every SPAN`); `taskrunner periodic disable taskrunner.rotate` turns it off.",
    ("overseer", "check_interval"):
        "How often the overseer checks its runners' PIDs and, while it holds the maintenance "
        "lease, processes the queue for every host.",
    ("overseer", "heartbeat_timeout"):
        "A runner whose heartbeat is older than this is dead (on another host; or on this "
        "host, hung, and then killed), counted from the database's return after an outage.",
    ("overseer", "graceful_timeout"):
        "On TERM/INT: how long runners get to finish their current run before KILL.",
    ("overseer", "kill_grace"):
        "A runner whose run timed out exits hard if the handler has not returned this long "
        "after the run was marked `timeout`; also the time from a fast stop to KILL.",
    ("overseer", "max_start_failures"):
        "Runners dying before they register this many times in a row: the overseer exits 1.",
    ("overseer", "crash_grace"):
        "Runs found crashed when an overseer starts wait this long before their retry, so an "
        "operator can cancel a crash loop.",
    ("log", "level"):
        "`debug`, `info`, `warning` or `error`; `--log-level` overrides it.",
    ("log", "format"):
        "`text`, or `json`: one JSON object per line (a run's records with `run_id`, "
        "`task_id`, `handler`, `status`, `duration`, `error_code`).",
    ("dashboard", "bind"):
        "Where `taskrunner dashboard` listens. Any address other than a loopback one needs a "
        "password (`password_hash` or `password_env`).",
    ("dashboard", "read_only"):
        "Serve the pages without the actions (retry, cancel, enable/disable, pause/resume).",
    ("dashboard", "password_hash"):
        "HTTP Basic password, hashed: the output of `taskrunner dashboard --hash-password`.",
    ("dashboard", "password_env"):
        "Or the name of an environment variable holding the password.",
    ("dashboard", "allowed_hosts"):
        "Host names the dashboard answers besides IP addresses, localhost names, the bind "
        "name and this host's name (say, a reverse proxy's); any other Host gets 403 (DNS "
        "rebinding).",
    ("dashboard", "metrics_series"):
        "Queues and periodic tasks with `/metrics` series of their own besides the configured "
        "ones (the busiest first); the rest are summed as `(other)`.",
    ("dashboard", "metrics_password_hash"):
        "A password that opens `/metrics` alone (HTTP Basic, hashed as `password_hash`), for a "
        "scraper running as another user or on another host.",
    ("dashboard", "metrics_password_env"):
        "Or the name of an environment variable holding the `/metrics` password.",
    ("task", "secret_keys"):
        "Words that mark a key of task data or results as secret: its value is shown masked "
        "on the dashboard, in the CLI's output and in logs (`[]` shows everything).",
    ("tracing", "setup"):
        "`module:function` each runner calls once as it starts, to configure OpenTelemetry "
        "(a tracer provider and its exporter) so that its runs and steps are traced "
        "(the `otel` extra; how-to: Monitoring).",
    ("run_event", "password_hash"):
        "In-Portal's `run_event.php EVENT password`: when set, every `run-event` requires the "
        "password (the output of `taskrunner run-event --hash-password`).",
}

QUEUE_DESCRIPTIONS = {
    "limit": "Runners serving this queue at once on one host, however they were started; "
             "the overseer keeps this many for it. Write it in every table: without it the "
             "queue gets one runner per host, and the overseer and `check` warn.",
    "priority": "A runner serving several queues claims from higher ones first.",
    "rate": "Runs of this queue started per second/minute/hour on all hosts together "
            "(`\"100/s\"`, `\"6000/min\"`, `\"20/h\"`), a token bucket in the database; "
            "`\"\"`: no limit. See [Flow control](../how-to/flow-control.md).",
    "burst": "The bucket's size with `rate`: up to this many runs start at once after a quiet "
             "spell, so any window of T seconds holds at most `burst + rate * T` starts. 0: "
             "a tenth of a second of the rate, at least 1.",
    "fair_by": "`tenant`: claims round-robin between the tenants of the queue's waiting "
               "tasks (`add_task(..., tenant=...)`), FIFO within priority inside each; "
               "`\"\"`: plain FIFO within priority.",
    "aging": "Priority aging: a scheduled run's priority grows by 1 for each `aging` it has "
             "waited (`\"30s\"`), up to `aging_max`; 0 = off.",
    "aging_max": "The highest priority aging raises a run to.",
}

# The [rate_limits] table: key or key prefix -> rate.
RATE_LIMITS_DESCRIPTION = (
    "`\"KEY\" = \"25/s\"` or `\"PREFIX*\" = {rate = \"25/s\", burst = 5}`: the rate "
    "limit of the tasks added with `rate_key=KEY` (an exact key wins over the longest "
    "prefix; `taskrunner rate set` overrides a pattern at run time). Each key has a bucket "
    "of its own.")

# The keys of a [[periodic]] table (periodic.definitions checks them).
PERIODIC_DESCRIPTIONS = {
    "name": "Unique name; required. Names starting `taskrunner.` are reserved.",
    "handler": "Dotted path of the handler; required.",
    "timer": "Required: a systemd calendar event (`Mon..Fri 07:30 Europe/Berlin`), `every SPAN` "
             "(a fixed grid) or `after SPAN` (SPAN after the previous task finished).",
    "data": "The submitted tasks' JSON data; default null.",
    "priority": "The submitted tasks' priority; default 0.",
    "enabled": "`false` to define it disabled; default true.",
    "catch_up": "After downtime: `once` submits one task for the missed due times, `skip` none.",
    "max_runtime": "Timebox: the `max_runtime` of each submitted task.",
    "min_spacing": "Drop a task at start if the previous one started less than this ago.",
    "timebox": "`half`: each task's `max_runtime` is half the interval (`every`/`after` "
               "timers); the default with `tolerance` (Nuntium's mode); `off` turns it off.",
    "anchor": "`due` (default): the next due time counts from the last one; `now` (`every` "
              "timers): from the moment the scheduler submitted (Nuntium's nextRun).",
    "tolerance": "Drop a task started less than interval - tolerance after the previous start "
                 "(`every` timers); every due time is then submitted.",
    "max_retries": "The submitted tasks' `max_retries`; default `[task] max_retries`.",
    "max_attempts": "The same as `max_retries` (runs in all), by its clear name.",
    "owner": "Whoever created it: `periodic remove --owner WHO --all` removes all of theirs.",
    "submitter": "`queued_by` of the submitted tasks; default `periodic:NAME`.",
    "subject": "What it is for, in words; copied to the tasks it submits.",
    "group": "The tenant it belongs to; copied to its tasks; `periodic list --group G`.",
    "queue": "The queue of the submitted tasks; default `default`.",
    "resume": "`true`: a task starts from the checkpoint of the previous one when that one "
              "ended without success (stopped at its `max_runtime`, given up); default false.",
    "jitter": "A span: each instance is due at its calendar time plus a stable offset in "
              "[0, jitter) hashed from the name and that time, the same on every host "
              "(calendar and `every` timers); default none.",
}
