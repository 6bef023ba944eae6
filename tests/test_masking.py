"""Secrets masked in what taskrunner shows (masking.py): the database URL's password in any
shape, in every command's output and log; the values of task data's secret keys in lines of
text (log lines, reprs), the same as each pattern before it was made linear; and every log
line in time linear in its length."""
import logging
import re
from urllib.parse import urlsplit, urlunsplit

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from taskrunner import masking
from taskrunner.config import SECRET_KEYS
from taskrunner.masking import MASK, mask_url, redact, text_masker

from conftest import Database, examples, taskrunner

WORDS = ["password", "token", "secret"]
# The pattern before its lookahead: the same matches, in time quadratic in an unclosed quote
# holding many secret words.
_BACKTRACKING = re.compile(
    r"""(["'])([^"'\n]*?(?:%s)[^"'\n]*)\1(\s*:\s*)"""
    r"""("(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s,}\]]+)"""
    % "|".join(re.escape(word) for word in WORDS), re.IGNORECASE)
_pieces = st.sampled_from(["password", "Token", "secretx", "db_", "x", " ", ":", ": ", '"', "'",
                           "\\", "\n", ",", "}", "]", "{", "7", "a b"])


def _old_mask(text):
    return _BACKTRACKING.sub(lambda m: "%s%s%s%s%s" % (m.group(1), m.group(2), m.group(1),
                                                       m.group(3), '"%s"' % MASK), text)


@settings(max_examples=examples(2000), deadline=None)
@given(st.lists(_pieces, max_size=16).map("".join))
def test_a_line_is_masked_as_the_backtracking_pattern_masked_it(text):
    assert text_masker(WORDS)(text) == _old_mask(text)


def test_the_default_words_mask_a_quoted_secret_key_and_nothing_else():
    mask = text_masker(SECRET_KEYS)
    assert mask('''data {"user": "ann", 'db_password': 'x y', "token": 12}''') == \
        '''data {"user": "ann", 'db_password': "%s", "token": "%s"}''' % (MASK, MASK)


@pytest.mark.parametrize("message", [
    "t" * 300_000,                 # one long word: the URL keywords' pattern
    '"' + "tokenx" * 50_000,       # an unclosed quote before secret words: secret_keys'
], ids=["long-word", "unclosed-quote"])
def test_a_runner_logs_a_failure_quoting_a_300_kb_text_and_goes_on(sqlite_db, message):
    """A log line is masked in time linear in its length: a handler's exception quoting 300
    KB (a response body, a blob, data from a web request) is logged with its traceback, and
    the runner takes its next run. Before, the runner stayed in that log line for minutes
    (a 16 KB word took 2.3 s; the unclosed quote 87 s): each pattern backtracked."""
    queue = sqlite_db.queue()
    failing = queue.add_task("taskrunner.handlers.Fail", data={"message": message},
                             max_retries=1)
    echo = queue.add_task("taskrunner.handlers.Echo")
    queue.close()
    result = taskrunner("runner", "--burst", url=sqlite_db.url, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "run 1 of task %d failed" % failing in result.stderr
    assert message in result.stderr              # the traceback's last line, whole
    queue = sqlite_db.queue()
    assert queue.get_task(echo).status == "success"
    queue.close()


@pytest.mark.parametrize("url,masked", [
    ("postgresql://app:s3cret@db:5432/app", "postgresql://app:***@db:5432/app"),
    ("postgresql://app:p@ss@db/app", "postgresql://app:***@db/app"),
    ("mysql://app:pa/ss@db/app", "mysql://app:***@db/app"),
    ("mysql://root@db/app", "mysql://root@db/app"),
    ("postgresql://db:5432/app", "postgresql://db:5432/app"),
    ("sqlite:///taskrunner.db", "sqlite:///taskrunner.db"),
    ("sqlite://u:s3cret@h/x", "sqlite://u:***@h/x"),
    ("postgresql://app@db/app?sslmode=require&password=s3cret", 
     "postgresql://app@db/app?sslmode=require&password=***"),
    ("host=db password=s3cret dbname=app", "host=db password=***"),
    ("host=db password = 'se cret' dbname=app", "host=db password = *** dbname=app"),
])
def test_mask_url_hides_the_whole_password(url, masked):
    assert mask_url(url) == masked


SECRET = "Zq9SECRETx7"
_text = st.text(st.characters(codec="ascii", exclude_characters="\x00"), max_size=8)
_plain = st.text("abcdefghijklmnopqrstuvwxyz0123456789.-_", min_size=1, max_size=8)
# A password with the secret marker anywhere in it, unencoded characters URLs hate included.
_password = st.builds(lambda a, b: a + SECRET + b, _text, _text)


@st.composite
def secret_urls(draw):
    """A URL or DSN of some shape carrying SECRET, in every place a password goes."""
    scheme = draw(st.sampled_from(["postgresql", "postgres", "mysql", "sqlite", "redis",
                                   "POSTGRESQL", "x+y"]))
    host = draw(st.sampled_from(["127.0.0.1:1", "127.0.0.1", "[::1]:1", "h", ""]))
    user = draw(_plain)
    password = draw(_password)
    key = draw(st.sampled_from(["password", "PASSWORD", "passwd", "pwd", "pass%77ord"]))
    shape = draw(st.sampled_from(["userinfo", "query", "dsn", "dsn-quoted", "both"]))
    if shape == "userinfo":
        return "%s://%s:%s@%s/db" % (scheme, user, password, host)
    if shape == "query":
        return "%s://%s@%s/db?sslmode=%s&%s=%s" % (scheme, user, host, draw(_plain), key,
                                                   password.replace("&", ""))
    if shape == "dsn":
        return "host=%s %s=%s dbname=db" % (host, key, password.replace(" ", ""))
    if shape == "dsn-quoted":
        return "host=%s %s = '%s' dbname=db" % (host, key,
                                               password.replace("\\", "").replace("'", ""))
    return "%s://%s:%s@%s/db?%s=%s" % (scheme, user, password, host, key,
                                      password.replace("&", ""))


@settings(max_examples=examples(500), deadline=None)
@given(secret_urls())
def test_no_url_shape_shows_its_secret(url):
    assert SECRET not in redact(url)
    assert SECRET not in redact("driver said: %s failed" % url, url)


# The keyword pattern as it was before its lookbehind: the same matches, found in time
# quadratic in a word's length.
_UNANCHORED_KEY = re.compile(r"([^\s&;?=/'\"]+)(\s*=\s*)")
_pieces = st.sampled_from(["password", "pwd", "host", "Pass%77ord", "=", " = ", "&", ";", "?",
                           "/", "//", "'", '"', " ", "\t", "x", "s3", "@", ":", "\\"])


@settings(max_examples=examples(1000), deadline=None)
@given(st.lists(_pieces, max_size=14).map("".join))
def test_redaction_finds_the_keywords_the_unanchored_pattern_found(text):
    anchored = masking._KEY
    try:
        masking._KEY = _UNANCHORED_KEY
        expected = redact(text)
    finally:
        masking._KEY = anchored
    assert redact(text) == expected


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(url=secret_urls(), command=st.sampled_from(
    [["check"], ["status", "--json"], ["init-db"], ["tasks"], ["add", "x.Y"]]))
def test_no_command_prints_the_secret_of_its_url(url, command, caplog):
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        result = taskrunner(*command, url=url)
    assert result.returncode == 2, result
    seen = result.stdout + result.stderr + "".join(r.getMessage() for r in caplog.records)
    assert SECRET not in seen
    assert "Traceback" not in seen


@pytest.fixture
def pg(tmp_path):
    db = Database("postgresql", tmp_path)
    yield db
    db.drop()


@pytest.mark.parametrize("shape", ["userinfo", "query"])
def test_reports_on_a_reachable_database_do_not_show_its_password(pg, shape, caplog):
    """The test server trusts local connections, so a password is accepted and ignored."""
    parts = urlsplit(pg.url)
    if shape == "userinfo":
        url = urlunsplit(parts._replace(netloc="postgres:%s@%s" % (SECRET, parts.hostname)))
    else:
        url = pg.url + "?password=" + SECRET
    seen = []
    with caplog.at_level(logging.DEBUG):
        for command in (["init-db"], ["check"], ["status"], ["status", "--json"],
                        ["add", "taskrunner.handlers.Echo"], ["tasks", "--json"]):
            result = taskrunner(*command, url=url)
            assert result.returncode == 0, result
            seen.append(result.stdout + result.stderr)
    seen.extend(record.getMessage() for record in caplog.records)
    assert not [text for text in seen if SECRET in text]
    assert "***" in seen[1]
