"""A queue's per-host limit changed at run time (issue 42): ``taskrunner queue limit NAME N``
stores it on the queue's row, and every host's runners and overseers obey it without a restart.
Lowered while runners are busy, the runs in flight finish and no more than N run at once after
the change; raised, more runners claim. Measured from the runs' own start and end times (the
database's), on real runner processes."""
import json
from datetime import datetime

import pytest

from conftest import START_TIMEOUT, taskrunner, usage_error, wait_for
from taskrunner.errors import InputError
from taskrunner.fleet import liveness
from taskrunner.store.models import RUNNING, Queue, Run, RunnerQueue, utcnow
from test_overseer import overseer_toml
from test_queue_limits import REPORTS, overseers  # noqa: F401 (a fixture, used by name)


def _spans(since):
    """(started_on, finished_on) of the runs of ``reports`` started after `since`; a run still
    running ends at the far future."""
    never = datetime(9999, 1, 1)
    return [(started, finished or never) for started, finished in Run.select(
        Run.started_on, Run.finished_on).where(
        (Run.queue == "reports") & (Run.started_on > since)).tuples()]


def most_at_once(spans):
    """The most spans overlapping at one instant (an end before a start at the same time)."""
    events = sorted([(s, 1) for s, _ in spans] + [(f, -1) for _, f in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _running():
    return Run.select().where((Run.queue == "reports") & (Run.status == RUNNING)).count()


def _set_limit(url_or_config, *args):
    """`queue limit reports ARGS` through the CLI; the time once it returned."""
    out = taskrunner("queue", "limit", "reports", *args, "--json", config=url_or_config,
                     check=True)
    return json.loads(out.stdout), utcnow()


@pytest.mark.timeout(240)
def test_a_lowered_limit_holds_at_once_for_busy_runners_and_a_raised_one_lets_them_claim(
        database, procs, tmp_path):
    """Four standalone runners of ``reports`` (limit 4) busy on a backlog. Their claim order
    is re-read only every 60 s (check_interval) and a busy runner claims its next run without
    a look: only the claim itself can hold them to the new limit. Lowered to 2: the runs in
    flight finish, and the runs started after the change never overlap more than 2. Raised to
    4 again: the same runners claim again, 4 at once."""
    database.queue().close()
    config = database.write_config(
        tmp_path / "c.toml", "[runner]\nlimit = 6\npoll_interval = 0.1\n[overseer]\n"
        "check_interval = 60\n" + REPORTS % 4)
    queue = database.queue(queues={"reports": {"limit": 4}})
    queue.add_tasks([{"handler": "sample_handlers.Record", "queue": "reports",
                      "data": {"log": str(tmp_path / "runs.log"), "sleep": 0.3}}
                     for _ in range(400)])
    for i in range(4):
        procs.spawn("runner", "--queue", "reports", config=config, name="r%d" % i)
    wait_for(lambda: _running() == 4, timeout=START_TIMEOUT, interval=0.02,
             message="4 reports runs at once\n" + procs.logs())

    answer, changed = _set_limit(config, "2")
    assert answer == {"queue": "reports", "limit": 2, "source": "stored", "changed": True}
    in_flight = {r.id for r in Run.select(Run.id).where(
        (Run.queue == "reports") & (Run.status == RUNNING) & (Run.started_on <= changed))}
    wait_for(lambda: len(_spans(changed)) >= 16 and _running() <= 2, timeout=60,
             message="16 runs after the change")
    assert most_at_once(_spans(changed)) <= 2, _spans(changed)
    assert not Run.select().where(Run.id.in_(list(in_flight)) & (Run.status != "success")
                                  ).exists()           # the runs in flight finished
    listed = json.loads(taskrunner("queue", "list", "--json", config=config, check=True).stdout)
    reports = next(q for q in listed if q["name"] == "reports")
    assert (reports["limit"], reports["limit_source"]) == (2, "stored")
    assert "2 (stored)" in taskrunner("queue", "list", config=config, check=True).stdout

    answer, raised = _set_limit(config, "4")
    assert answer["limit"] == 4
    wait_for(lambda: most_at_once(_spans(raised)) == 4, timeout=30, interval=0.1,
             message="4 runs at once after the limit was raised")
    assert all(p.poll() is None for p in procs.started), procs.logs()
    queue.close()


@pytest.mark.timeout(240)
def test_an_overseer_sizes_its_runners_by_the_stored_limit(database, overseers, tmp_path):
    """An overseer (host limit 5, ``reports`` limit 2 in its config): raised to 4, it starts
    two more runners of reports and 4 run at once; lowered to 1, it retires those above the
    limit and no more than 1 runs after the change; reset, the config's 2 apply again."""
    queue = database.queue(queues={"reports": {"limit": 2}})
    queue.add_tasks([{"handler": "sample_handlers.Record", "queue": "reports",
                      "data": {"log": str(tmp_path / "runs.log"), "sleep": 0.4}}
                     for _ in range(400)])
    config = overseers.config(limit=5, extra=REPORTS % 2)
    overseers.start(config)

    def reports_runners():
        return RunnerQueue.select().where(RunnerQueue.queue == "reports").count()
    wait_for(lambda: reports_runners() == 2 and _running() == 2, timeout=START_TIMEOUT,
             message="2 reports runners\n" + overseers.log())

    _, raised = _set_limit(config, "4")
    wait_for(lambda: most_at_once(_spans(raised)) == 4, timeout=START_TIMEOUT * 2,
             interval=0.1, message="4 reports runs at once\n" + overseers.log())

    _, lowered = _set_limit(config, "1")
    wait_for(lambda: reports_runners() == 1 and len(_spans(lowered)) >= 6, timeout=60,
             message="1 reports runner\n" + overseers.log())
    assert most_at_once(_spans(lowered)) <= 1, _spans(lowered)

    answer, reset = _set_limit(config, "--reset")
    assert (answer["limit"], answer["source"]) == (2, "config")
    wait_for(lambda: most_at_once(_spans(reset)) == 2, timeout=START_TIMEOUT * 2, interval=0.1,
             message="2 reports runs at once after the reset\n" + overseers.log())
    assert reports_runners() == 2
    queue.close()


def test_a_bad_queue_limit_is_a_one_line_error_and_nothing_is_stored(database, tmp_path):
    config = database.write_config(tmp_path / "c.toml", REPORTS % 2)
    queue = database.queue(queues={"reports": {"limit": 2}})
    for args, fragment in ((["-1"], "-1"), (["x"], "'x'"), (["1.5"], "1.5"), (["0"], "'0'"),
                           ([], "N or --reset"), (["3", "--reset"], "not both")):
        usage_error(taskrunner("queue", "limit", "reports", *args, config=config),
                    "queue", fragment)
    usage_error(taskrunner("queue", "limit", "nosuch", "2", config=config),
                "'nosuch'", "[queues.nosuch]")
    for bad in (-1, 0, "2", 2.0, True):
        with pytest.raises(InputError, match="whole number"):
            queue.set_queue_limit("reports", bad)
    with pytest.raises(InputError, match="no \\[queues.mail\\] table"):
        queue.set_queue_limit("mail", 2)
    assert not Queue.select().where(Queue.host_limit.is_null(False)).exists()
    queue.close()


def test_the_dashboard_shows_the_limit_and_its_source_and_sets_it(sqlite_db):
    """The queue row: the limit in force and where it comes from; its form (CSRF) stores
    another, Reset goes back to the config's; a bad value changes nothing."""
    from dashboard_helpers import Served, fetch
    from test_dashboard import notice_of, token_of
    queue = sqlite_db.queue(queues={"reports": {"limit": 3}})
    queue.add_task("taskrunner.handlers.Echo", queue="reports")

    def row():
        section = fetch(served.url + "/")[1].split('id="queues"')[1]
        return next(r for r in section.split("<tr>") if ">reports<" in r)

    def stored():
        return Queue.get(Queue.name == "reports").host_limit
    served = Served(queue.store)
    try:
        assert '3 <span class="muted">(config)</span>' in row() and "Reset" not in row()
        status, _, _ = fetch(served.url + "/queues/limit", data="name=reports&limit=2")
        assert status == 403 and stored() is None                  # no CSRF token
        token = token_of(served)
        status, _, headers = fetch(served.url + "/queues/limit",
                                   data="csrf=%s&name=reports&limit=2" % token)
        assert status == 303 and "limit 2 runners per host, stored" in notice_of(headers)
        assert stored() == 2 and '2 <span class="muted">(stored)</span>' in row()
        for bad in ("-1", "x", "0"):
            status, _, headers = fetch(served.url + "/queues/limit",
                                       data="csrf=%s&name=reports&limit=%s" % (token, bad))
            assert status == 303 and "nothing changed" in notice_of(headers) and stored() == 2
        status, _, headers = fetch(served.url + "/queues/limit",
                                   data="csrf=%s&name=reports&reset=1" % token)
        assert status == 303 and stored() is None and "(config)" in row()
    finally:
        served.stop()
    served = Served(queue.store, read_only=True)
    try:
        assert "(config)" in row() and "/queues/limit" not in row()
        assert fetch(served.url + "/queues/limit", data="csrf=x&name=reports&limit=1")[0] == 403
        assert stored() is None
    finally:
        served.stop()
        queue.close()


def _claims_logged(log):
    """The claim statements a runner's debug log shows (PostgreSQL's CTE, MySQL's locking
    read), each as logged on one line."""
    return [line for line in log.splitlines() if "SKIP LOCKED" in line and "task_runs" in line]


@pytest.mark.timeout(120)
def test_only_a_runner_whose_slot_can_be_above_a_limit_checks_it_in_its_claims(database_pm,
                                                                              tmp_path):
    """Issue 41: a feature a job does not use costs it nothing. A limit is at least 1, so the
    runner holding slot 1 of a queue, or no slot (a queue without a table), is never above
    one: its claims leave the slot check out. The runner holding slot 2 keeps it."""
    config = database_pm.write_config(
        tmp_path / "c.toml", '[runner]\nlimit = 4\n[log]\nlevel = "debug"\n' + REPORTS % 2)
    queue = database_pm.queue(queues={"reports": {"limit": 2}})
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "queue": q}
                     for q in ("reports", "default") for _ in range(3)])

    def burst(*args):
        result = taskrunner("runner", "--burst", *args, config=config)
        assert result.returncode == 0, result.stderr
        return _claims_logged(result.stderr)
    claims = {"slot-1": burst("--queue", "reports"), "no-slot": burst("--queue", "default")}
    held = liveness.register(queue.store, serving=["reports"])     # slot 1 of reports, held
    assert held.queue_slots == {"reports": 1}
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo", "queue": "reports"}
                     for _ in range(3)])
    claims["slot-2"] = burst("--queue", "reports")
    assert all(claims.values()), claims
    assert not any("task_runner_queues" in c for c in claims["slot-1"] + claims["no-slot"])
    assert all("task_runner_queues" in c for c in claims["slot-2"]), claims["slot-2"]
    assert Run.select().where(Run.status != "success").count() == 0
    queue.close()
