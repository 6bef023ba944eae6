"""The configuration, in-process: defaults, durations, precedence, and errors that name the
file, the section and the key."""
import os
import stat
import sys

import pytest

from taskrunner import ConfigError
from taskrunner.config import DEFAULT_DATABASE_URL, SCHEMA, Config, _positive_seconds, _seconds

from conftest import REPO_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - older Pythons only
    import tomli as tomllib

ALL_KEYS = [(section, key) for section, keys in SCHEMA.items() for key in keys]
DURATION_KEYS = [(section, key) for section, keys in SCHEMA.items()
                 for key, (_, check) in keys.items() if check in (_seconds, _positive_seconds)]
POSITIVE_DURATION_KEYS = [(s, k) for s, k in DURATION_KEYS if SCHEMA[s][k][1] is _positive_seconds]


def write(tmp_path, text, name="taskrunner.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load(path):
    return Config.load(path, environ={})


# Values for the keys CONSTRAINTS compares that leave any value of the other key valid.
ROOMY = {("runner", "heartbeat_interval"): "0.001", ("overseer", "heartbeat_timeout"): '"99y"',
         ("task", "retry_backoff"): "0", ("task", "retry_backoff_max"): '"99y"'}


def with_roomy_partners(section, key, value):
    """TOML setting `key`, and the keys it is compared with to values that let it pass."""
    tables = {}
    for (other_section, other_key), roomy in ROOMY.items():
        tables.setdefault(other_section, {})[other_key] = roomy
    tables.setdefault(section, {})[key] = value
    return "".join("[%s]\n%s" % (name, "".join("%s = %s\n" % item for item in keys.items()))
                   for name, keys in tables.items())


def refused(path):
    """The one-line ConfigError that loading `path` raises."""
    with pytest.raises(ConfigError) as err:
        load(path)
    return str(err.value)


def test_the_schema_declares_durations():
    # Guards the parametrizations below against silently becoming empty.
    assert ("task", "run_timeout") in POSITIVE_DURATION_KEYS
    assert ("rotation", "keep_success") in DURATION_KEYS


@pytest.mark.parametrize("section,key", ALL_KEYS, ids=["%s.%s" % sk for sk in ALL_KEYS])
def test_every_default_is_applied_when_the_key_is_absent(tmp_path, section, key):
    # An empty file, a file with only another key of the section, and no file at all.
    other = next((k for k in SCHEMA[section] if k != key), None)
    other_line = ""
    if other is not None:
        default = SCHEMA[section][other][0]
        other_line = "%s = %s\n" % (other, _toml_value(default))
    files = [write(tmp_path, "", "empty.toml"),
             write(tmp_path, "[%s]\n%s" % (section, other_line), "other.toml")]
    for config in [load(p) for p in files] + [Config.load(None, environ={})]:
        assert getattr(getattr(config, section), key) == SCHEMA[section][key][0]


def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"%s"' % value
    if isinstance(value, list):
        return "[%s]" % ", ".join(_toml_value(v) for v in value)
    return repr(value)


def test_defaults_are_the_documented_values():
    config = Config.from_dict({})
    assert config.database.url == DEFAULT_DATABASE_URL == "sqlite:///taskrunner.db"
    assert config.task.max_retries == 5
    assert config.runner.memory_limit == 100
    assert config.handlers.allow == []
    assert config.log.level == "info"


def test_a_list_default_is_not_shared_between_configs():
    first = Config.from_dict({})
    first.handlers.allow.append("myapp.*")
    assert Config.from_dict({}).handlers.allow == []
    assert SCHEMA["handlers"]["allow"][0] == []


def test_given_values_replace_the_defaults(tmp_path):
    config = load(write(tmp_path, '[runner]\nlimit = 3\n[log]\nlevel = "DEBUG"\n'
                                  '[handlers]\nallow = ["myapp.tasks.*"]\n'))
    assert config.runner.limit == 3
    assert config.runner.memory_limit == SCHEMA["runner"]["memory_limit"][0]
    assert config.log.level == "debug"
    assert config.handlers.allow == ["myapp.tasks.*"]


@pytest.mark.parametrize("value,seconds", [
    ("90", 90.0), ("2.5", 2.5), ('"45s"', 45.0), ('"5min"', 300.0), ('"7d"', 604800.0),
    ('"1h 30min"', 5400.0), ('"1w 1d"', 8 * 86400.0), ('"500ms"', 0.5),
])
@pytest.mark.parametrize("section,key", DURATION_KEYS, ids=["%s.%s" % sk for sk in DURATION_KEYS])
def test_durations_accept_numbers_and_time_spans(tmp_path, section, key, value, seconds):
    config = load(write(tmp_path, with_roomy_partners(section, key, value)))
    assert getattr(getattr(config, section), key) == pytest.approx(seconds)
    assert isinstance(getattr(getattr(config, section), key), float)


@pytest.mark.parametrize("section,key", POSITIVE_DURATION_KEYS,
                         ids=["%s.%s" % sk for sk in POSITIVE_DURATION_KEYS])
def test_a_zero_duration_is_refused_where_it_must_be_positive(tmp_path, section, key):
    path = write(tmp_path, "[%s]\n%s = 0\n" % (section, key))
    message = refused(path)
    assert "[%s] %s" % (section, key) in message and path in message


@pytest.mark.parametrize("section,key,value", [
    ("database", "url", "5"),
    ("database", "sqlite_synchronous", '"sometimes"'),
    ("database", "busy_timeout", '"soon"'),
    ("runner", "limit", '"eight"'),
    ("runner", "limit", "0"),
    ("runner", "limit", "true"),
    ("runner", "limit", "2.5"),
    ("runner", "max_runs", "-1"),
    ("task", "run_timeout", '"5 parsecs"'),
    ("task", "max_retries", "0"),
    ("task", "retry_backoff", "-1"),
    ("task", "max_data_size", "[1]"),
    ("handlers", "allow", '"myapp.*"'),
    ("handlers", "allow", "[1, 2]"),
    ("rotation", "keep_success", "true"),
    ("overseer", "graceful_timeout", '""'),
    ("log", "level", '"loud"'),
    ("overseer", "check_interval", "nan"),
    ("task", "run_timeout", "inf"),
    ("task", "retry_backoff", '"200y"'),
    ("database", "pooler", '"pgpool"'),
    ("database", "pooler", '"pgbouncer"'),         # the default URL is SQLite's
    ("database", "listen_url", '"postgresql://app@db/app"'),
    ("database", "listen_url", "5"),
])
def test_a_bad_value_names_the_file_the_section_and_the_key(tmp_path, section, key, value):
    path = write(tmp_path, "[%s]\n%s = %s\n" % (section, key, value))
    message = refused(path)
    assert path in message and "[%s]" % section in message and key in message
    assert "\n" not in message


def test_an_unknown_key_names_the_file_and_the_key(tmp_path):
    path = write(tmp_path, "[runner]\nlimit = 2\nlimitt = 3\n")
    message = refused(path)
    assert path in message and "limitt" in message and "[runner]" in message


def test_an_unknown_section_names_the_file_and_the_section(tmp_path):
    path = write(tmp_path, "[runners]\nlimit = 2\n")
    message = refused(path)
    assert path in message and "[runners]" in message


def test_a_section_that_is_not_a_table_is_refused(tmp_path):
    path = write(tmp_path, "runner = 5\n")
    message = refused(path)
    assert path in message and "[runner]" in message


def test_invalid_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[runner\nlimit = 2\n")
    message = refused(path)
    assert path in message and "invalid TOML" in message


def test_a_file_that_is_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "taskrunner.toml"
    path.write_bytes(b"[runner]\nlimit = \xff\n")
    message = refused(str(path))
    assert str(path) in message and "UTF-8" in message


def test_a_missing_file_names_the_file(tmp_path):
    path = str(tmp_path / "nowhere.toml")
    message = refused(path)
    assert path in message and "not found" in message


def test_a_path_that_cannot_be_read_names_the_file(tmp_path):
    message = refused(str(tmp_path))  # a directory: unreadable as a file, even for root
    assert str(tmp_path) in message and "cannot read" in message


def test_an_unreadable_file_names_the_file(tmp_path):
    path = write(tmp_path, "[runner]\nlimit = 2\n")
    os.chmod(path, 0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("this user (root?) can read a mode-000 file")
        message = refused(path)
        assert path in message and "cannot read" in message
    finally:
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def test_the_database_url_comes_from_argument_then_environment_then_file(tmp_path):
    path = write(tmp_path, '[database]\nurl = "sqlite:///from-file.db"\n')
    env = {"TASKRUNNER_DATABASE_URL": "sqlite:///from-env.db"}
    assert Config.load(path, environ={}).database.url == "sqlite:///from-file.db"
    assert Config.load(path, environ=env).database.url == "sqlite:///from-env.db"
    assert Config.load(path, "sqlite:///from-arg.db", environ=env).database.url \
        == "sqlite:///from-arg.db"
    assert Config.load(None, environ={}).database.url == DEFAULT_DATABASE_URL


def test_taskrunner_config_names_the_file_when_no_path_is_given(tmp_path):
    path = write(tmp_path, "[runner]\nlimit = 4\n")
    config = Config.load(None, environ={"TASKRUNNER_CONFIG": path})
    assert config.runner.limit == 4 and config.source == path
    other = write(tmp_path, "[runner]\nlimit = 6\n", "other.toml")
    assert Config.load(other, environ={"TASKRUNNER_CONFIG": path}).runner.limit == 6


def test_config_example_toml_parses_and_documents_every_key():
    path = os.path.join(REPO_DIR, "config.example.toml")
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    missing = [(s, k) for s, k in ALL_KEYS if k not in data.get(s, {})]
    assert not missing, "config.example.toml does not set: %s" % missing
    # Its header says the values shown are the defaults: hold it to that.
    config, defaults = Config.load(path, environ={}), Config.from_dict({})
    differ = [(s, k) for s, k in ALL_KEYS
              if getattr(getattr(config, s), k) != getattr(getattr(defaults, s), k)]
    assert not differ, "config.example.toml differs from the defaults in: %s" % differ


@pytest.mark.parametrize("text,fragment", [
    ("[runner]\nheartbeat_interval = 120\n[overseer]\nheartbeat_timeout = 60\n",
     "[runner] heartbeat_interval (120s) must be shorter than [overseer] heartbeat_timeout (60s)"),
    ("[runner]\nheartbeat_interval = 60\n",
     "[runner] heartbeat_interval (60s) must be shorter than [overseer] heartbeat_timeout (60s)"),
    ("[task]\nretry_backoff = '2h'\nretry_backoff_max = '1h'\n",
     "[task] retry_backoff (7200s) must be at most [task] retry_backoff_max (3600s)"),
])
def test_keys_that_contradict_each_other_are_refused(tmp_path, text, fragment):
    path = write(tmp_path, text)
    message = refused(path)
    assert message.startswith(path + ": ") and fragment in message


def test_a_database_url_from_the_environment_that_is_not_utf8_is_refused():
    with pytest.raises(ConfigError, match="TASKRUNNER_DATABASE_URL is not valid UTF-8"):
        Config.load(environ={"TASKRUNNER_DATABASE_URL": "sqlite:///\udcff.db"})


def test_a_pooler_needs_a_postgresql_url_wherever_the_url_comes_from(tmp_path):
    path = write(tmp_path, '[database]\nurl = "postgresql://app@db/app"\npooler = "pgbouncer"\n'
                           'listen_url = "postgres://app@db-direct/app"\n')
    assert load(path).database.pooler == "pgbouncer"
    for url in ("sqlite:///from-env.db", "mysql://app@db/app"):
        with pytest.raises(ConfigError) as err:
            Config.load(path, environ={"TASKRUNNER_DATABASE_URL": url})
        assert str(err.value).startswith(path + ": [database] pooler is for PostgreSQL only")


def test_a_listen_url_that_is_not_postgresql_is_refused_without_showing_it(tmp_path):
    path = write(tmp_path, '[database]\nurl = "postgresql://app@db/app"\n'
                           'listen_url = "mysql://app:hunter22@db/app"\n')
    message = refused(path)
    assert message.startswith(path + ": [database] listen_url: expected a postgresql:// URL")
    assert "hunter22" not in message
