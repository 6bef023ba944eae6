"""Database URLs: secrets never shown in any shape, URLs that would not persist refused,
malformed URLs and servers too old refused in one line."""
import logging
import re
import sqlite3
from urllib.parse import urlsplit, urlunsplit

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from taskrunner import TaskQueue
from taskrunner.store.db import (MINIMUM_VERSIONS, check_version, mask_url, parse_mysql_version,
                                 redact, server_version)
from taskrunner.errors import ConfigError

from conftest import Database, taskrunner


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


@settings(max_examples=500, deadline=None)
@given(secret_urls())
def test_no_url_shape_shows_its_secret(url):
    assert SECRET not in redact(url)
    assert SECRET not in redact("driver said: %s failed" % url, url)


@settings(max_examples=60, deadline=None,
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


@pytest.mark.parametrize("url", ["sqlite:", "sqlite://", "sqlite:///", "sqlite:///:memory:",
                                 "sqlite://:memory:", "sqlite:///file::memory:"])
def test_a_database_that_would_not_persist_is_refused(url):
    with pytest.raises(ConfigError, match="names no file"):
        TaskQueue(url, migrate=True)
    result = taskrunner("add", "taskrunner.handlers.Rotate", url=url)
    assert result.returncode == 2 and "names no file" in result.stderr
    assert result.stdout == ""


def test_an_in_memory_database_when_asked_for():
    with TaskQueue("sqlite://:memory:", migrate=True, ephemeral=True) as queue:
        task_id = queue.add_task("taskrunner.handlers.Rotate")
        assert queue.run_pending() == 1
        assert queue.get_task(task_id).status == "success"


@pytest.mark.parametrize("url,fragment", [
    ("mysql://root:s3cret@127.0.0.1:notaport/x", "the port is not a number"),
    ("postgresql://[::1/x", "unbalanced [ ]"),
    ("mysql://root@127.0.0.1:3306/", "names no database"),
    ("sqlite:///x.db?cache=shared", "takes no parameters"),
])
def test_a_malformed_url_is_one_line(url, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TaskQueue(url)
    result = taskrunner("check", url=url)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result
    assert fragment in result.stderr and "s3cret" not in result.stderr


@pytest.mark.parametrize("product,version,ok", [
    ("SQLite", (3, 34, 1), False), ("SQLite", (3, 35, 0), True),
    ("MariaDB", (10, 5, 22), False), ("MariaDB", (10, 6, 0), True),
    ("MySQL", (8, 0, 0), False), ("MySQL", (5, 7, 44), False), ("MySQL", (8, 0, 1), True),
    ("PostgreSQL", (9, 6, 24), False), ("PostgreSQL", (10, 0), True),
])
def test_servers_older_than_the_sql_needs_are_refused(product, version, ok):
    if ok:
        check_version(product, version)
        return
    with pytest.raises(ConfigError) as info:
        check_version(product, version)
    message = str(info.value)
    assert "\n" not in message
    assert ".".join(map(str, version)) in message
    assert ".".join(map(str, MINIMUM_VERSIONS[product])) in message


@pytest.mark.parametrize("text,expected", [
    ("10.11.6-MariaDB-0+deb12u1", ("MariaDB", (10, 11, 6))),
    ("5.5.5-10.5.23-MariaDB", ("MariaDB", (5, 5, 5))),
    ("8.0.36", ("MySQL", (8, 0, 36))),
    ("8.0.0-dmr-log", ("MySQL", (8, 0, 0))),
])
def test_mysql_version_text(text, expected):
    assert parse_mysql_version(text) == expected


def test_the_servers_in_use_pass_the_version_check(database):
    with database.queue() as queue:
        product, version = server_version(queue.store.db)
        check_version(product, version)
        if database.backend == "sqlite":
            assert version == sqlite3.sqlite_version_info


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


class Refused(Exception):
    pass


def test_a_write_is_one_transaction_with_savepoints_inside(database):
    """Store.write's transaction (store/db.py: write_transaction, peewee's transaction() at
    depth 0): an atomic() inside it is a savepoint whose failure undoes its own rows only;
    a failure of the write undoes all of it; what committed stays."""
    queue = database.queue()
    store, db = queue.store, queue.store.db
    db.execute_sql("CREATE TABLE tr_nested (x INTEGER)")

    def rows():
        return sorted(r[0] for r in db.execute_sql("SELECT x FROM tr_nested").fetchall())

    def write():
        db.execute_sql("INSERT INTO tr_nested (x) VALUES (1)")
        assert db.in_transaction()
        try:
            with db.atomic():
                db.execute_sql("INSERT INTO tr_nested (x) VALUES (2)")
                raise Refused()
        except Refused:
            pass
        with db.atomic():
            db.execute_sql("INSERT INTO tr_nested (x) VALUES (3)")
    store.write(write)
    assert not db.in_transaction() and rows() == [1, 3]

    def failing():
        db.execute_sql("INSERT INTO tr_nested (x) VALUES (4)")
        raise Refused()
    with pytest.raises(Refused):
        store.write(failing)
    assert not db.in_transaction() and rows() == [1, 3]
    db.execute_sql("DROP TABLE tr_nested")
    queue.close()


def test_a_write_runs_its_after_commit_callbacks_when_it_commits(database):
    """peewee's db.after_commit(fn) inside a store write (an application's code in
    run.transaction_step, say) runs fn once the write committed, and not at all when the
    write rolled back — not later, at some other transaction's commit."""
    queue = database.queue()
    store, db = queue.store, queue.store.db
    ran = []
    store.write(lambda: db.after_commit(lambda: ran.append("committed")))
    assert ran == ["committed"]

    def failing():
        db.after_commit(lambda: ran.append("rolled back"))
        raise Refused()
    with pytest.raises(Refused):
        store.write(failing)
    store.write(lambda: None)
    assert ran == ["committed"]
    queue.close()
