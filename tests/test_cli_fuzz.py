"""The CLI under generated arguments of every kind a hostile or careless user types: nested,
invalid and non-UTF-8 JSON, lone surrogates, huge and odd numbers, odd dates, odd timers,
reserved names, malformed database URLs. Whatever comes in, the answer is exit 0, or exit 2
with one line on stderr and nothing stored changed; never a traceback.

In-process (conftest's `taskrunner()`), on one SQLite database per test; about 1,100 cases
per run in all (1,060)."""
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import Database, examples, taskrunner

ECHO = "taskrunner.handlers.Echo"


def fuzz(thorough):
    return settings(max_examples=examples(thorough), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture
def db(tmp_path):
    return Database("sqlite", tmp_path)


def dump(url):
    """Every row of every table, to compare before and after a refused command."""
    connection = sqlite3.connect(url[len("sqlite:///"):])
    try:
        tables = [row[0] for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {table: connection.execute("SELECT * FROM %s ORDER BY rowid" % table).fetchall()
                for table in tables}
    finally:
        connection.close()


def run(db, argv, refused=False):
    """The contract, for one command line."""
    before = dump(db.url)
    result = taskrunner("--database", db.url, *argv)
    shown = "argv %r\nexit %d\nstdout: %r\nstderr: %r" % (argv, result.returncode,
                                                         result.stdout[:2000], result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert result.returncode in (0, 2), shown
    if result.returncode == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("taskrunner: "), shown
        assert dump(db.url) == before, shown
    elif refused:
        raise AssertionError("accepted what must be refused\n" + shown)
    return result


# -- what users type -------------------------------------------------------------------------

_chars = st.characters(exclude_characters="\x00")             # argv cannot hold NUL
_surrogate = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                     max_size=2)
# Lone surrogates are how Python hands over arguments that are not valid UTF-8.
with_surrogate = st.builds(lambda a, s, b: a + s + b, st.text(_chars, max_size=4), _surrogate,
                           st.text(_chars, max_size=4))
texts = st.one_of(st.text(_chars, max_size=12), with_surrogate, st.just(""),
                  st.text(_chars, min_size=256, max_size=300))
int_texts = st.one_of(
    st.integers(-10 ** 30, 10 ** 30).map(str), st.integers(-3, 20).map(str),
    st.sampled_from(["", "x", "1.5", "-0", "\u0663", "1_000", " 7 ", "0x10", "2147483648",
                     "9223372036854775808", "99999999999999999999999999"]), with_surrogate)
number_texts = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr), int_texts,
    st.sampled_from(["nan", "inf", "-inf", "1e400", "1e-300", "5s", "3153600001", "0"]))
date_texts = st.one_of(
    st.datetimes().map(lambda d: d.isoformat()),
    st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()),
    st.sampled_from(["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+01:00", "2024-02-30",
                     "now", "", "2024-01-01T00:00:00Z", "0001-01-01"]), texts)


def _nested(depth, kind):
    return ("[" * depth + "]" * depth) if kind else ('{"a":' * depth + "1" + "}" * depth)


json_texts = st.one_of(
    st.builds(_nested, st.integers(1, 5000), st.booleans()),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                     st.text(max_size=3), inner, max_size=3), max_leaves=8).map(
        lambda value: __import__("json").dumps(value)),
    st.sampled_from(['"\\ud800"', '{"a": "\\udfff"}', "NaN", "[1e999]", "{", "",
                     '"' + "x" * 1100000 + '"']),
    texts)
_timer_words = st.sampled_from([
    "every", "5min", "1h", "30s", "fortnights", "0.5s", "99999999999999999999y", "Mon", "..",
    "Fri", "*-*-*", "07:30", "*:*:0/7", "~", ",", "-", "/", ":", "daily", "quarterly",
    "Europe/Berlin", "UTC", "Nope/Zone", "2024-02-29", "00:00:60", "*-02-31", "Mon..Sun",
    "9999999999-01-01", "1..5/0"])
timer_texts = st.one_of(
    st.lists(st.one_of(_timer_words, st.text(_chars, max_size=3)), min_size=1, max_size=5)
    .flatmap(lambda words: st.sampled_from([" ".join(words), "".join(words)])),
    st.sampled_from(["every 5min", "daily", "Mon..Fri 07:30", "every 0s", "every 5 fortnights"]),
    texts)
names = st.one_of(texts, st.sampled_from(["taskrunner.rotate", "taskrunner.x", "nightly",
                                           "n" * 246, "n" * 247]))
handlers = st.one_of(st.just(ECHO), st.sampled_from(
    ["taskrunner.handlers.Nope", "os.system", "x", "taskrunner..Echo", "json.JSONDecoder"]),
    texts)


def options(**choices):
    """Some of the given --options, each with a generated value."""
    return st.lists(st.sampled_from(sorted(choices)), unique=True, max_size=len(choices)).flatmap(
        lambda chosen: st.tuples(*[st.tuples(st.just(name), choices[name]) for name in chosen])
    ).map(lambda pairs: [part for name, value in pairs for part in (name, value)])


# -- the commands ----------------------------------------------------------------------------

@fuzz(250)
@given(data=st.data())
def test_add_takes_any_arguments_without_a_traceback(db, data):
    handler = data.draw(handlers)
    argv = ["add", handler] + data.draw(options(**{
        "--data": json_texts, "--queued-by": texts, "--unique-key": texts,
        "--priority": int_texts, "--max-retries": int_texts, "--timeout": number_texts,
        "--max-runtime": number_texts}))
    argv += data.draw(st.sampled_from([[], ["--in"], ["--at"]]).flatmap(
        lambda flag: st.just(flag) if not flag else st.tuples(
            st.just(flag[0]), number_texts if flag[0] == "--in" else date_texts).map(list)))
    run(db, argv)


@fuzz(150)
@given(command=st.one_of(
    st.tuples(st.just("tasks"), st.just("--limit"), int_texts).map(list),
    st.tuples(st.just("tasks"), st.just("--status"), texts).map(list),
    st.tuples(st.sampled_from(["show", "runs", "retry", "cancel"]), int_texts).map(list)))
def test_reads_and_verbs_take_any_id_or_limit(db, command):
    run(db, command)


@fuzz(250)
@given(data=st.data())
def test_periodic_takes_any_arguments_without_a_traceback(db, data):
    action = data.draw(st.sampled_from(["add", "add", "add", "list", "enable", "disable",
                                        "remove"]))
    if action == "add":
        argv = ["periodic", "add", data.draw(names), data.draw(handlers),
                data.draw(timer_texts)] + data.draw(options(**{
                    "--data": json_texts, "--priority": int_texts, "--max-retries": int_texts,
                    "--max-runtime": texts, "--min-spacing": texts, "--owner": texts,
                    "--catch-up": texts}))
        name = argv[2]
        must_refuse = isinstance(name, str) and name.strip().startswith("taskrunner.")
        run(db, argv, refused=must_refuse)
    elif action == "list":
        run(db, ["periodic", "list", "--owner", data.draw(texts)])
    else:
        run(db, ["periodic", action, data.draw(names)] + data.draw(options(**{"--owner": texts})))


@fuzz(200)
@given(expression=timer_texts, extra=options(**{
    "-n": st.one_of(st.integers(0, 20).map(str), st.sampled_from(
        ["-1", "1000000001", "99999999999999999999999999", "x", ""]), with_surrogate),
    "--base": date_texts}), as_json=st.booleans())
def test_calendar_takes_any_expression_without_a_traceback(db, expression, extra, as_json):
    run(db, ["calendar", expression] + extra + (["--json"] if as_json else []))


@fuzz(150)
@given(url=st.one_of(
    st.sampled_from(["sqlite:", "sqlite://", "sqlite:///", "sqlite:///:memory:",
                     "sqlite://:memory:", "sqlite://u:secret@h/x", "sqlite:///x.db?a=b",
                     "mysql://root:x@127.0.0.1:notaport/x", "postgresql://[::1/x",
                     "postgresql://postgres@127.0.0.1:1/x?password=hunter2",
                     "mysql://root@127.0.0.1:1/x", "postgresql://h:99999/x", "redis://h/0",
                     "host=h password=x", "", "postgresql://", "mysql:///x"]),
    # Random parts where no host name is looked up (DNS would make a case take seconds).
    st.builds(lambda scheme, shape, text: scheme + shape % text,
              st.sampled_from(["sqlite://", "postgresql://", "mysql://", "x://", ""]),
              st.sampled_from(["127.0.0.1:%s/x", "[%s", "u:%s@127.0.0.1:1/x", "127.0.0.1:1/%s",
                               "127.0.0.1:1/x?%s", "/%s"]),
              texts)),
    command=st.sampled_from([["check"], ["status", "--json"], ["tasks"], ["init-db"],
                             ["add", ECHO]]))
def test_any_database_url_gets_one_line(db, url, command, tmp_path):
    before = dump(db.url)
    with pytest.MonkeyPatch.context() as patch:
        (tmp_path / "cwd").mkdir(exist_ok=True)
        patch.chdir(tmp_path / "cwd")   # a relative SQLite path lands here, not in the repo
        result = taskrunner("--database", url, *command)
    shown = "url %r\nexit %d\nstdout: %r\nstderr: %r" % (url, result.returncode,
                                                        result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, shown
    assert result.returncode in (0, 2), shown
    if result.returncode == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("taskrunner: "), shown
    assert dump(db.url) == before


@fuzz(60)
@given(argv=st.one_of(
    st.tuples(st.just("--log-level"), texts, st.just("check")).map(list),
    st.tuples(st.just("--config"), with_surrogate, st.just("check")).map(list),
    st.lists(texts, max_size=4)))
def test_any_other_arguments_get_one_line(db, argv):
    if argv and argv[0] in ("runner", "overseer", "run-event"):
        argv = argv[1:]          # those start processes; their arguments are checked above
    run(db, argv)
