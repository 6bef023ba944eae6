"""Named queues: every task belongs to one (``default`` unless named by add, the handler or
a periodic task), a runner claims only from the queues it serves, FIFO within priority
within a queue, and migration 0009 puts existing tasks in ``default``."""
import pytest

from taskrunner import Config, InputError
from taskrunner.runs import lifecycle
from taskrunner.fleet import liveness
from taskrunner.store.models import Run, Task

from conftest import ALL_BACKENDS, Database, taskrunner, usage_error

ECHO = "taskrunner.handlers.Echo"


def test_a_task_is_in_the_queue_it_was_added_to(database, tmp_path):
    queue = database.queue()
    plain = queue.add_task(ECHO)
    named = queue.add_task(ECHO, queue="reports")
    by_handler = queue.add_task("sample_handlers.Report", {"log": "x"})
    overridden = queue.add_task("sample_handlers.Report", {"log": "x"}, queue="urgent")
    bulk = queue.add_tasks([{"handler": ECHO, "queue": "bulk"}, {"handler": ECHO},
                            {"handler": "sample_handlers.Report", "data": {"log": "x"}}])
    later = queue.add_task(ECHO, queue="later", scheduled_on=None)
    result = taskrunner("add", ECHO, "--queue", "cli", url=database.url, check=True)
    from_cli = int(result.stdout)
    queues = {t.id: t.queue for t in Task.select()}
    assert [queues[i] for i in (plain, named, by_handler, overridden, *bulk, later, from_cli)] \
        == ["default", "reports", "reports", "urgent", "bulk", "default", "reports", "later",
            "cli"]
    assert queue.get_task(named).queue == "reports"
    assert '"queue": "cli"' in taskrunner("show", str(from_cli), "--json", url=database.url).stdout
    # The first run carries its task's queue (the claim reads task_runs alone).
    assert all(r.queue == queues[r.task_id] for r in Run.select())
    assert {q.name for q in queue.store.Queue.select()} >= {
        "default", "reports", "urgent", "bulk", "later", "cli"}
    queue.close()


def test_a_bad_queue_name_is_refused_and_nothing_is_stored(sqlite_db):
    queue = sqlite_db.queue()
    for name in ("", "a,b", "x" * 65, "spaces here", 7):
        with pytest.raises(InputError, match="queue"):
            queue.add_task(ECHO, queue=name)
    usage_error(taskrunner("add", ECHO, "--queue", "a,b", url=sqlite_db.url), "--queue")
    assert Task.select().count() == 0
    queue.close()


def test_a_delayed_task_runs_in_its_queue(sqlite_db):
    from datetime import datetime, timedelta, timezone
    queue = sqlite_db.queue()
    soon = datetime.now(timezone.utc) + timedelta(seconds=0.2)
    task_id = queue.add_task(ECHO, queue="reports", scheduled_on=soon)
    lifecycle.create_missing_runs(queue.store, now=soon.replace(tzinfo=None)
                                  + timedelta(seconds=1))
    assert Run.get(Run.task_id == task_id).queue == "reports"
    queue.close()


def test_a_runner_claims_only_from_its_queues_fifo_within_priority(database):
    queue = database.queue()
    runner_id = liveness.register(queue.store).id
    first = queue.add_task(ECHO, queue="reports")
    queue.add_task(ECHO)                                         # default: not claimed below
    urgent = queue.add_task(ECHO, queue="reports", priority=5)
    second = queue.add_task(ECHO, queue="reports")
    order = [lifecycle.claim(queue.store, runner_id, ["reports"]).task_id for _ in range(3)]
    assert order == [urgent, first, second]
    assert lifecycle.claim(queue.store, runner_id, ["reports"]) is None
    assert lifecycle.claim(queue.store, runner_id, ["other", "default"]) is not None
    queue.close()


def test_a_periodic_task_submits_into_its_queue(sqlite_db, tmp_path):
    from taskrunner.periodic import scheduler as periodic
    queue = sqlite_db.queue()
    taskrunner("periodic", "add", "nightly", ECHO, "every 1s", "--queue", "reports",
               url=sqlite_db.url, check=True)
    periodic.add_periodic(queue.store, "by-handler", "sample_handlers.Report", "every 1s",
                          data={"log": "x"})
    config = sqlite_db.write_config(tmp_path / "c.toml", '[[periodic]]\nname = "cfg"\n'
                                    'handler = "%s"\ntimer = "every 1s"\nqueue = "etl"\n' % ECHO)
    taskrunner("run-event", "periodic-task:OnProcess", config=config, check=True)
    from taskrunner.store.models import PeriodicTask
    rows = {p.name: p.queue for p in PeriodicTask.select()}
    assert (rows["nightly"], rows["by-handler"], rows["cfg"]) == ("reports", "reports", "etl")
    listed = taskrunner("periodic", "list", "--json", url=sqlite_db.url, check=True).stdout
    assert '"queue": "etl"' in listed
    from datetime import timedelta
    from taskrunner.store.models import utcnow
    scheduler = periodic.PeriodicScheduler(queue.store)
    scheduler.run_pending(now=utcnow() + timedelta(seconds=5))
    submitted = {t.periodic_task_id: t.queue for t in Task.select()}
    ids = {p.name: p.id for p in PeriodicTask.select()}
    assert submitted[ids["nightly"]] == "reports" and submitted[ids["cfg"]] == "etl"
    assert submitted[ids["by-handler"]] == "reports"
    queue.close()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_migration_puts_existing_tasks_in_the_default_queue(backend, tmp_path):
    db = Database(backend, tmp_path, empty=True)
    try:
        store = db.store_at("0005_crash_counts")
        store.db.execute_sql(
            "INSERT INTO task_queue (queued_on, scheduled_on, handler, data, priority, "
            "last_status, max_retries, runs_failed, run_count, run_timeout, updated_on) "
            "VALUES ('2026-01-01 00:00:00', '2026-01-01 00:00:00', 'x.Y', '{}', 0, "
            "'scheduled', 5, 0, 1, 60, '2026-01-01 00:00:00')")
        store.migrate()
        assert [t.queue for t in store.Task.select()] == ["default"]
        assert [q.name for q in store.Queue.select()] == ["default"]
        store.close()
    finally:
        db.drop()


@pytest.mark.parametrize("queues,message", [
    ({"reports": {"limit": 0}}, "[queues.reports] limit: must be at least 1"),
    ({"reports": {"limt": 1}}, "unknown key 'limt' in [queues.reports]"),
    ({"a b": {"limit": 1}}, "[queues.a b]"),
    ({"reports": {"limit": 3}, "etl": {"limit": 1}}, "add up to 4, over [runner] limit (4)"),
    ({"reports": 3}, "[queues.NAME] tables"),
])
def test_queue_tables_are_checked(queues, message):
    from taskrunner.errors import ConfigError
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"runner": {"limit": 4}, "queues": queues})
    assert message in str(info.value)


def test_the_overseer_keeps_each_queue_limit_and_default_gets_the_rest():
    config = Config.from_dict({"runner": {"limit": 8}, "queues": {
        "reports": {"limit": 1}, "etl": {"limit": 2, "priority": 5}}})
    assert config.queue_groups() == {("reports",): 1, ("etl",): 2, ("default",): 5}
    with_default = Config.from_dict({"runner": {"limit": 8}, "queues": {
        "default": {"limit": 3}, "etl": {"limit": 5}}})
    assert with_default.queue_groups() == {("default",): 3, ("etl",): 5}


def test_taskrunner_queues_declares_queues_as_empty_tables(tmp_path):
    """$TASKRUNNER_QUEUES gives each queue named runners of its own (the defaults of a
    table), keeps a table the file has, and is checked as the file is."""
    from taskrunner.errors import ConfigError
    path = tmp_path / "taskrunner.toml"
    path.write_text("[runner]\nlimit = 4\n[queues.etl]\nlimit = 2\n")
    config = Config.load(str(path), environ={"TASKRUNNER_QUEUES": "default, emails,etl"})
    assert config.queue_groups() == {("etl",): 2, ("emails",): 1, ("default",): 1}
    assert Config.load(str(path), environ={}).queue_groups() == {("etl",): 2, ("default",): 2}
    with pytest.raises(ConfigError, match=r"^\$TASKRUNNER_QUEUES: queue name must be"):
        Config.load(None, environ={"TASKRUNNER_QUEUES": "a b"})
    with pytest.raises(ConfigError, match="add up to 4, over"):
        Config.load(str(path), environ={"TASKRUNNER_QUEUES": "emails,sms"})


def test_runners_of_default_serve_every_queue_not_configured(sqlite_db):
    from taskrunner.runs import queues
    queue = sqlite_db.queue(queues={"reports": {"limit": 1}, "etl": {"limit": 1, "priority": 9}})
    for name in ("reports", "etl", "misc", "zz"):
        queue.add_task(ECHO, queue=name)
    store = queue.store
    assert queues.claim_order(store, ("default",)) == ["default", "misc", "zz"]
    assert queues.claim_order(store, ("reports", "etl")) == ["etl", "reports"]
    assert queues.claim_order(store, None) == ["etl", "default", "misc", "reports", "zz"]
    queue.close()


def test_a_paused_queue_is_not_claimed_from_until_resumed(database):
    queue = database.queue()
    mail = queue.add_task(ECHO, queue="mail")
    plain = queue.add_task(ECHO)
    assert queue.pause_queue("mail") is True and queue.pause_queue("mail") is False
    assert queue.pause_queue("not-used-yet", create=True) is True   # before its first task
    assert queue.run_pending() == 1
    assert queue.get_task(plain).status == "success"
    assert queue.get_task(mail).status == "scheduled"
    info = {q.name: q for q in queue.queues()}
    assert info["mail"].paused and info["mail"].scheduled == 1 and info["mail"].lag is None
    assert info["mail"].paused_for >= 0
    assert not info["default"].paused and info["default"].lag is None
    assert queue.resume_queue("mail") is True and queue.resume_queue("mail") is False
    assert queue.run_pending() == 1
    assert queue.get_task(mail).status == "success"
    queue.close()


def test_queue_commands(sqlite_db):
    import json
    url = sqlite_db.url
    assert "paused" in taskrunner("queue", "pause", "mail", "--create", url=url,
                                  check=True).stdout
    assert "already" in taskrunner("queue", "pause", "mail", url=url, check=True).stdout
    listed = json.loads(taskrunner("queue", "list", "--json", url=url, check=True).stdout)
    assert [(q["name"], q["paused"]) for q in listed] == [("default", False), ("mail", True)]
    assert "resumed" in taskrunner("queue", "resume", "mail", url=url, check=True).stdout
    usage_error(taskrunner("queue", "pause", "a,b", url=url), "queue")
    usage_error(taskrunner("queue", "pause", url=url), "name")


def test_a_queue_table_without_limit_is_warned_about_by_check(tmp_path):
    """`limit` defaults to 1: a table written for its rate alone would run one task at a
    time per host without a word."""
    path = tmp_path / "c.toml"
    path.write_text('[queues.emails]\nrate = "10/s"\n\n[queues.reports]\nlimit = 2\n')
    config = Config.load(str(path), environ={})
    assert len(config.warnings) == 1
    assert "[queues.emails] sets no limit" in config.warnings[0]
    assert config.queues["emails"].limit == 1
    out = taskrunner("check", config=str(path), url="sqlite:///%s" % (tmp_path / "q.db"))
    assert out.returncode == 0, out.stderr
    assert "warning: %s: [queues.emails] sets no limit" % path in out.stdout
    assert "reports" not in out.stdout


def test_max_retries_zero_is_refused_with_what_one_means(tmp_path, sqlite_db):
    """max_retries counts runs: a Celery user's "no retry" (0) is told to write 1."""
    queue = sqlite_db.queue()
    with pytest.raises(InputError, match="1 is one run and no retry"):
        queue.add_task("taskrunner.handlers.Echo", max_retries=0)
    usage_error(taskrunner("add", "taskrunner.handlers.Echo", "--max-retries", "0",
                           url=sqlite_db.url), "1 is one run and no retry")
    path = tmp_path / "c.toml"
    path.write_text("[task]\nmax_retries = 0\n")
    from taskrunner.errors import ConfigError
    with pytest.raises(ConfigError, match=r"\[task\] max_retries: .*1 is one run and no retry"):
        Config.load(str(path), environ={})
    queue.close()
