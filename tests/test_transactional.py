"""Adding tasks inside the application's own transaction (``connection=``): with sqlite3,
psycopg and PyMySQL connections, and through SQLAlchemy. Rolled back: no task; committed:
the task is there and an idle runner (polling only every 30 s) starts it at once — woken
after the commit, by the server's NOTIFY on PostgreSQL, by `wake()` elsewhere. The
queue's own connection is not used."""
import time
from urllib.parse import urlsplit

import pytest

from conftest import START_TIMEOUT, wait_for
from sample_handlers import read_records
from taskrunner import InputError
from taskrunner.store.models import RUNNING, Runner, Task
from test_runner_processes import waiting_in_select

ORDERS = "CREATE TABLE orders (id INTEGER PRIMARY KEY, note VARCHAR(50))"


def connect(database):
    """A plain DB-API connection of the application's own, with an open transaction."""
    parts = urlsplit(database.url)
    if database.backend == "sqlite":
        import sqlite3
        return sqlite3.connect(parts.path, timeout=30)
    if database.backend == "postgresql":
        import psycopg
        return psycopg.connect(database.url)
    import pymysql
    return pymysql.connect(host=parts.hostname, port=parts.port or 3306,
                           user=parts.username, password=parts.password or "",
                           database=parts.path.lstrip("/"))


def param(database):
    return "?" if database.backend == "sqlite" else "%s"


def orders(conn):
    cursor = conn.cursor()
    cursor.execute("SELECT note FROM orders ORDER BY id")
    rows = [r[0] for r in cursor.fetchall()]
    cursor.close()
    return rows


@pytest.fixture
def app(database):
    conn = connect(database)
    cursor = conn.cursor()
    cursor.execute(ORDERS)
    cursor.close()
    conn.commit()
    yield conn
    conn.close()


def test_a_task_added_in_a_rolled_back_transaction_does_not_exist(database, app):
    queue = database.queue()
    queue.store.close()
    cursor = app.cursor()
    cursor.execute("INSERT INTO orders (id, note) VALUES (1, %s)" % param(database), ("lost",))
    task_id = queue.add_task("taskrunner.handlers.Echo", {"order": 1}, connection=app)
    ids = queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "queue": "mail"}] * 3,
                          connection=app)
    assert queue.store.db.is_closed()        # written with the application's connection only
    assert len(set(ids + [task_id])) == 4
    app.rollback()
    assert orders(app) == []
    assert Task.select().count() == 0 and "mail" not in [q.name for q in queue.queues()]
    queue.close()


def test_a_committed_task_wakes_an_idle_runner_after_the_commit(database, app, procs, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "runs.log")
    config = database.write_config(tmp_path / "c.toml", "[runner]\npoll_interval = 30\n")
    runner = procs.spawn("runner", config=config)
    wait_for(lambda: Runner.select().where(Runner.status == RUNNING).exists()
             and waiting_in_select(runner.pid), timeout=START_TIMEOUT,
             message="the runner to register and wait idle")
    cursor = app.cursor()
    cursor.execute("INSERT INTO orders (id, note) VALUES (1, %s)" % param(database), ("kept",))
    task_id = queue.add_task("sample_handlers.Record", {"log": log}, connection=app)
    # Not visible to anyone else before the commit.
    assert not Task.select().where(Task.id == task_id).exists()
    app.commit()
    committed = time.monotonic()
    if database.backend != "postgresql" or database.pooler:
        queue.wake()        # PostgreSQL: the NOTIFY sent in the transaction arrives at commit
    wait_for(lambda: [t for t, _, _ in read_records(log)] == [task_id], timeout=20,
             message="the runner to start the task")
    assert time.monotonic() - committed < 20, "woken, not found by its 30 s poll"
    assert orders(app) == ["kept"]
    queue.close()


def test_a_connection_to_another_kind_of_database_is_refused(sqlite_db):
    import sqlite3
    queue = sqlite_db.queue()
    with pytest.raises(InputError, match="connection= must be a sqlite connection"):
        queue.add_task("taskrunner.handlers.Echo", connection=object())
    assert isinstance(sqlite3.connect(":memory:"), sqlite3.Connection)
    queue.close()


def sqlalchemy_url(database):
    if database.backend == "sqlite":
        return database.url
    if database.backend == "postgresql":
        return database.url.replace("postgresql://", "postgresql+psycopg://", 1)
    return database.url.replace("mysql://", "mysql+pymysql://", 1)


def test_the_sqlalchemy_recipe(database, app):
    sqlalchemy = pytest.importorskip("sqlalchemy")
    queue = database.queue()
    engine = sqlalchemy.create_engine(sqlalchemy_url(database))
    insert = sqlalchemy.text("INSERT INTO orders (id, note) VALUES (:id, :note)")
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(insert, {"id": 1, "note": "lost"})
        queue.add_task("taskrunner.handlers.Echo", connection=conn)
        raise RuntimeError("the order failed")
    with engine.begin() as conn:
        conn.execute(insert, {"id": 2, "note": "kept"})
        task_id = queue.add_task("taskrunner.handlers.Echo", {"order": 2}, connection=conn)
    queue.wake()
    assert [t.id for t in Task.select()] == [task_id] and orders(app) == ["kept"]
    assert queue.run_pending() == 1 and queue.get_task(task_id).status == "success"
    engine.dispose()
    queue.close()


def test_the_django_recipe(sqlite_db, tmp_path):
    """Django's ``connection`` inside ``transaction.atomic()``, the wake-up registered with
    ``transaction.on_commit`` (SQLite here; the recipe is the same on PostgreSQL)."""
    pytest.importorskip("django")
    from django.conf import settings
    if settings.configured:
        pytest.skip("Django is configured for another database in this process")
    settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                              "NAME": urlsplit(sqlite_db.url).path}})
    import django
    django.setup()
    from django.db import connection, transaction
    queue = sqlite_db.queue()
    with connection.cursor() as cursor:
        cursor.execute(ORDERS)
    woken = []
    with pytest.raises(RuntimeError), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO orders (id, note) VALUES (1, 'lost')")
        queue.add_task("taskrunner.handlers.Echo", connection=connection)
        transaction.on_commit(lambda: woken.append(1))
        raise RuntimeError("the order failed")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO orders (id, note) VALUES (2, 'kept')")
        task_id = queue.add_task("taskrunner.handlers.Echo", connection=connection)
        transaction.on_commit(queue.wake)
        transaction.on_commit(lambda: woken.append(2))
    assert woken == [2]
    assert [t.id for t in Task.select()] == [task_id]
    with connection.cursor() as cursor:
        cursor.execute("SELECT note FROM orders")
        assert [r[0] for r in cursor.fetchall()] == ["kept"]
    connection.close()
    queue.close()
