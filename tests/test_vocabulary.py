"""One vocabulary and one set of units across the Python API, the CLI and the dashboard
(issue #29): the same status words and filters, the same spans, the same rules."""
import json
import re
from datetime import timedelta

import pytest

from taskrunner.cli.runs import STATUS_CHOICES
from taskrunner.errors import InputError
from taskrunner.reads import records as reads, summaries
from taskrunner.store.models import utcnow

from conftest import ok, taskrunner, usage_error, utc


def history(queue):
    """A task in each state: success, given up, retrying, cancelled, scheduled."""
    done = queue.add_task("taskrunner.handlers.Echo")
    given_up = queue.add_task("taskrunner.handlers.Fail", {"code": "Planned"}, max_retries=1,
                              queue="mail")
    queue.run_pending()
    retrying = queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                              retry_backoff=3600)
    queue.run_pending()
    cancelled = queue.add_task("taskrunner.handlers.Echo",
                               scheduled_on=utc(utcnow()) + timedelta(days=1))
    queue.cancel(cancelled)
    later = queue.add_task("taskrunner.handlers.Echo",
                           scheduled_on=utc(utcnow()) + timedelta(days=1))
    return dict(done=done, given_up=given_up, retrying=retrying, cancelled=cancelled,
                later=later)


def test_every_surface_takes_the_same_status_words(database):
    assert STATUS_CHOICES == reads.TASK_STATUSES == summaries.STATUS_FILTERS
    queue = database.queue()
    ids = history(queue)
    expected = {"scheduled": [ids["later"]], "running": [], "waiting": [],
                "retrying": [ids["retrying"]],
                "given-up": [ids["given_up"]], "success": [ids["done"]],
                "cancelled": [ids["cancelled"]], "error": [ids["retrying"], ids["given_up"]],
                "timeout": [], "failed": [ids["retrying"], ids["given_up"]]}
    assert set(expected) == set(STATUS_CHOICES)
    for word, want in expected.items():
        api = [t.id for t in queue.tasks(status=word)]
        web = [t.id for t in summaries.find_tasks(queue.store,
                                                  summaries.TaskFilter(status=word)).tasks]
        cli = [t["id"] for t in json.loads(ok(taskrunner("tasks", "--status", word, "--json",
                                                         url=database.url)))]
        assert api == web == cli == want, word
    with pytest.raises(InputError, match="unknown task status 'requeued'"):
        queue.tasks(status="requeued")
    table = ok(taskrunner("tasks", url=database.url))
    shown = {int(line.split()[0]): line.split()[2] for line in table.splitlines()[1:-1]}
    assert shown[ids["retrying"]] == "retrying" and shown[ids["given_up"]] == "given-up"
    queue.close()


def test_the_cli_filters_by_queue_and_error_code_as_the_dashboard_does(database):
    queue = database.queue()
    ids = history(queue)
    queue.close()
    url = database.url
    listed = json.loads(ok(taskrunner("tasks", "--queue", "mail", "--json", url=url)))
    assert [t["id"] for t in listed] == [ids["given_up"]]
    listed = json.loads(ok(taskrunner("tasks", "--error-code", "Again", "--json", url=url)))
    assert [t["id"] for t in listed] == [ids["retrying"]]
    out = json.loads(ok(taskrunner("retry", "--status", "failed", "--error-code", "Planned",
                                   "--json", url=url)))
    assert out["changed"] == [ids["given_up"]]


def test_every_duration_option_takes_the_spans_of_the_config(sqlite_db):
    url = sqlite_db.url
    task_id = int(ok(taskrunner("add", "taskrunner.handlers.Echo", "--in", "5min",
                                "--max-runtime", "2min", "--timeout", "1h 30min", url=url)))
    queue = sqlite_db.queue()
    task = queue.get_task(task_id)
    assert (task.max_runtime, task.run_timeout) == (120.0, 5400.0)
    assert 290 <= (task.scheduled_on - task.queued_on).total_seconds() <= 310
    other = queue.add_task("taskrunner.handlers.Echo", run_timeout="10min", max_runtime="90s")
    assert (queue.get_task(other).run_timeout, queue.get_task(other).max_runtime) == (600, 90)
    queue.close()
    usage_error(taskrunner("add", "taskrunner.handlers.Echo", "--in", "5 parsecs", url=url),
                "--in", "time span")
    usage_error(taskrunner("wait", str(task_id), "--timeout", "0", url=url), "--timeout")
    result = taskrunner("wait", str(task_id), "--timeout", "50ms", url=url)
    assert result.returncode == 3, result


def test_retry_backoff_0_is_valid_in_the_config_and_the_api_alike(sqlite_db, tmp_path):
    config = sqlite_db.write_config(tmp_path / "c.toml", "[task]\nretry_backoff = 0\n")
    ok(taskrunner("check", config=config))
    queue = sqlite_db.queue()
    task_id = queue.add_task("sample_handlers.FailTimes", {"fail": 1}, retry_backoff=0)
    assert queue.run_pending() == 1          # failed
    assert queue.run_pending() == 1          # retried at once, no backoff
    assert queue.get_task(task_id).status == "success"
    with pytest.raises(InputError, match="retry_backoff"):
        queue.add_task("taskrunner.handlers.Echo", retry_backoff=-1)
    with pytest.raises(InputError, match="run_timeout must be a positive number of seconds"):
        queue.add_task("taskrunner.handlers.Echo", run_timeout=0)
    queue.close()


def test_tables_fit_120_columns_and_show_local_times_with_the_zone_once(sqlite_db):
    from taskrunner.periodic import scheduler as periodic
    queue = sqlite_db.queue()
    for n in range(3):
        periodic.add_periodic(queue.store, "nightly-report-of-tenant-%d" % n,
                              "taskrunner.handlers.Echo", "Mon..Fri *-*-* 07:30:00",
                              subject="the nightly report every tenant asked for", group="g")
    failed = queue.add_task("taskrunner.handlers.Fail", {
        "code": "Planned", "message": "a long message " * 20}, max_retries=1)
    queue.run_pending()
    queue.close()
    url = sqlite_db.url
    for args in (("periodic", "list"), ("tasks",), ("runs", str(failed)), ("status",),
                 ("queue", "list")):
        text = ok(taskrunner(*args, url=url))
        if args[0] == "runs":           # the tracebacks under the table are kept whole
            text = text.split("\n\n")[0]
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= 120, (args, lines)
    wide = ok(taskrunner("periodic", "list", "--wide", url=url)).splitlines()
    assert max(len(line) for line in wide) > 120 and "taskrunner.handlers.Echo" in wide[1]
    shown = ok(taskrunner("show", str(failed), url=url))
    assert not re.search(r"\dT\d\d:", shown) and shown.count("times are local:") == 1, shown
    assert ok(taskrunner("tasks", url=url)).count("times are local:") == 1
    berlin = ok(taskrunner("tasks", url=url, env={"TZ": "Europe/Berlin"}))
    assert re.search(r"times are local: CES?T \(UTC\+[12]\)$", berlin), berlin
