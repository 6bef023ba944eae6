"""``max_attempts``: the clear name of the count ``max_retries`` has always been — runs in all,
the first included (1: one run, no retry). Accepted wherever ``max_retries`` is (add_task,
``@task`` and ``using``, ``taskrunner add`` and ``periodic add|alter``, ``[[periodic]]``,
``[task]``); both given must agree; 0 is refused with what it would mean; ``retry=False``
stays the word for "no retry"."""
import pytest

import function_tasks as ft
from conftest import taskrunner, usage_error
from taskrunner import Config, InputError, use_queue
from taskrunner.errors import ConfigError
from taskrunner.periodic import scheduler as periodic


@pytest.fixture
def default(sqlite_db):
    queue = sqlite_db.queue(task={"retry_backoff": 0})
    before = use_queue(queue)
    yield queue
    use_queue(before)
    queue.close()


def _drain(queue):
    while queue.run_pending():
        pass


def test_add_task_takes_max_attempts_as_runs_in_all(default):
    task_id = default.add_task("sample_handlers.Boom", max_attempts=2)
    _drain(default)
    task = default.get_task(task_id)
    assert (task.runs, task.status, task.max_retries) == (2, "given-up", 2)
    assert default.get_task(default.add_task("taskrunner.handlers.Echo", max_attempts=3,
                                             max_retries=3)).max_retries == 3
    before = default.tasks(limit=None)
    with pytest.raises(InputError, match="max_attempts .2. and max_retries .3. are the same "
                                         "count"):
        default.add_task("taskrunner.handlers.Echo", max_attempts=2, max_retries=3)
    with pytest.raises(InputError, match="max_attempts counts runs in all.*1 is one run and "
                                         "no retry"):
        default.add_task("taskrunner.handlers.Echo", max_attempts=0)
    for bad in (-1, "2", 1.5):
        with pytest.raises(InputError, match="max_attempts must be"):
            default.add_task("taskrunner.handlers.Echo", max_attempts=bad)
    assert default.tasks(limit=None) == before            # nothing stored


def test_the_task_decorator_and_using_take_max_attempts(default):
    handle = ft.two_runs.enqueue("boom")
    _drain(default)
    task = default.get_task(handle.id)
    assert (task.runs, task.status, task.max_retries) == (2, "given-up", 2)
    # A call's count replaces the decorator's, by either name.
    assert default.get_task(ft.two_runs.using(max_retries=4).enqueue("x").id).max_retries == 4
    assert default.get_task(ft.send_receipt.using(max_attempts=1).enqueue(1).id
                            ).max_retries == 1
    # retry=False is "no retry": one run, and a count of more contradicts it.
    assert default.get_task(ft.fails.enqueue("x").id).max_retries == 1
    with pytest.raises(InputError, match="retry=False and max_attempts=2 contradict"):
        ft.fails.using(max_attempts=2).enqueue("x")
    with pytest.raises(InputError, match="the same count"):
        ft.add.using(max_attempts=2, max_retries=3).enqueue(1)


def test_the_cli_takes_max_attempts_and_refuses_both_or_zero(sqlite_db, tmp_path):
    queue = sqlite_db.queue()
    out = taskrunner("add", "taskrunner.handlers.Echo", "--max-attempts", "1",
                     url=sqlite_db.url, check=True)
    assert queue.get_task(int(out.stdout)).max_retries == 1
    usage_error(taskrunner("add", "taskrunner.handlers.Echo", "--max-attempts", "1",
                           "--max-retries", "2", url=sqlite_db.url),
                "--max-retries", "not allowed with", "--max-attempts")
    usage_error(taskrunner("add", "taskrunner.handlers.Echo", "--max-attempts", "0",
                           url=sqlite_db.url), "max_attempts counts runs in all")
    taskrunner("periodic", "add", "digest", "taskrunner.handlers.Echo", "every 1h",
               "--max-attempts", "2", url=sqlite_db.url, check=True)
    stored = queue.store.PeriodicTask.select().where(queue.store.PeriodicTask.name == "digest")
    assert stored.get().max_retries == 2
    taskrunner("periodic", "alter", "digest", "--max-attempts", "3", url=sqlite_db.url,
               check=True)
    assert stored.get().max_retries == 3
    usage_error(taskrunner("periodic", "alter", "digest", "--max-attempts", "0",
                           url=sqlite_db.url), "max_attempts must be an integer of at least 1")
    assert stored.get().max_retries == 3
    assert len(queue.tasks(limit=None)) == 1
    queue.close()


def test_the_config_takes_max_attempts_for_tasks_and_periodic_tasks(sqlite_db, tmp_path):
    from taskrunner import TaskQueue
    path = tmp_path / "c.toml"
    sqlite_db.write_config(path, '[task]\nmax_attempts = 2\n\n[[periodic]]\nname = "digest"\n'
                           'handler = "taskrunner.handlers.Echo"\ntimer = "every 1h"\n'
                           'max_attempts = 3\n')
    config = Config.load(str(path), environ={})
    assert config.task.max_retries == 2
    queue = TaskQueue(config, migrate=True)
    assert queue.get_task(queue.add_task("taskrunner.handlers.Echo")).max_retries == 2
    periodic.sync_definitions(queue.store)
    PeriodicTask = queue.store.PeriodicTask
    assert PeriodicTask.get(PeriodicTask.name == "digest").max_retries == 3
    queue.close()
    for text, message in (
            ("[task]\nmax_attempts = 2\nmax_retries = 3\n",
             r"\[task\] max_attempts \(2\) and max_retries \(3\) are the same count"),
            ("[task]\nmax_attempts = -1\n", r"\[task\] max_attempts: must be at least 1"),
            ('[[periodic]]\nname = "d"\nhandler = "taskrunner.handlers.Echo"\n'
             'timer = "every 1h"\nmax_attempts = 3\nmax_retries = 4\n', "the same count")):
        path.write_text(text)
        with pytest.raises((ConfigError, InputError), match=message):
            periodic.validate_definitions(Config.load(str(path), environ={}),
                                          import_handlers=False)
