"""Database URLs: URLs that would not persist refused, malformed URLs and servers too old
refused in one line; a write is one transaction. (That no URL's secret is ever shown:
test_masking.py.)"""
import re
import sqlite3
import subprocess
import sys
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from taskrunner import Config, TaskQueue
from taskrunner.store.db import (MINIMUM_VERSIONS, check_version, open_database,
                                 parse_mysql_version, server_version)
from taskrunner.errors import ConfigError

from conftest import process_env, taskrunner


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


def test_a_mysql_urls_password_reaches_pymysql_by_its_own_name():
    """peewee's db_url hands it on as `passwd`, an alias PyMySQL warns about at every
    connect (DeprecationWarning: 'passwd' is deprecated)."""
    pytest.importorskip("pymysql", reason="the mysql extra: pip install '.[mysql]'")
    config = Config.from_dict({"database": {"url": "mysql://app:p%40ss@db.example:3307/q"}})
    params = open_database(config.database).connect_params
    assert "passwd" not in params
    assert (params["user"], params["password"], params["host"], params["port"]) == \
        ("app", "p@ss", "db.example", 3307)


@pytest.mark.parametrize("database", ["mysql"], indirect=True)
def test_a_mysql_connection_with_a_password_warns_of_nothing(database):
    """The whole path, URL to an open queue, under ``-W error::DeprecationWarning``: a
    password in the URL is the case PyMySQL's deprecated `passwd` alias came from."""
    user, password = "trpw_%s" % database.name[-12:], "p@ss w"
    with database.admin.cursor() as cur:
        cur.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", (user, password))
        cur.execute("GRANT ALL ON `%s`.* TO %%s@'%%%%'" % database.name, (user,))
    try:
        parts = urlsplit(database.url)
        url = urlunsplit(parts._replace(netloc="%s:%s@%s:%d" % (
            user, quote(password), parts.hostname, parts.port or 3306)))
        script = ("import sys\nfrom taskrunner import TaskQueue\n"
                  "with TaskQueue(sys.argv[1]) as queue:\n"
                  "    print(queue.add_task('taskrunner.handlers.Echo'))\n")
        result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                                 script, url], env=process_env(), capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert int(result.stdout) > 0
    finally:
        with database.admin.cursor() as cur:
            cur.execute("DROP USER %s@'%%'", (user,))


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


def test_store_after_commit_calls_once_the_outermost_write_committed(database):
    """Store.after_commit: a call made inside a write (nested too) runs once the outermost
    write committed, outside its transaction (and SQLite's host lock); none for a write
    rolled back; outside a write, at once; one that raises is logged, the write stands."""
    queue = database.queue()
    store = queue.store
    ran = []

    def call(what):
        return lambda: ran.append((what, store.db.in_transaction()))

    def outer():
        store.write(lambda: store.after_commit(call("nested")))
        store.after_commit(lambda: 1 / 0)
        store.after_commit(call("outer"))
        assert ran == []
        return "done"
    assert store.write(outer) == "done"
    assert ran == [("nested", False), ("outer", False)]

    def failing():
        store.after_commit(call("rolled back"))
        raise Refused()
    with pytest.raises(Refused):
        store.write(failing)
    store.write(lambda: None)
    store.after_commit(call("now"))
    assert ran[2:] == [("now", False)]
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


def test_every_datetime_column_keeps_microseconds_on_mysql(database):
    """Every datetime column of a migrated MySQL/MariaDB schema is DATETIME(6): a plain
    DATETIME rounds the fraction away (FIFO order, a kill grace counted from a cancel)."""
    if database.backend != "mysql":
        pytest.skip("SQLite and PostgreSQL keep microseconds in every timestamp column")
    with database.queue() as queue:
        rows = queue.store.db.execute_sql(
            "SELECT table_name, column_name, datetime_precision FROM information_schema.columns"
            " WHERE table_schema = DATABASE() AND data_type = 'datetime'").fetchall()
    assert rows and [(t, c) for t, c, precision in rows if precision != 6] == []
