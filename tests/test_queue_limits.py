"""Queue limits with real overseers and runners: a slow queue with ``limit = 1`` cannot
delay the default queue's pickup, the limit holds whoever starts the runners (rule 5), and
HUP applies a changed limit. Limits are sampled from the database while tasks run."""
import os
import signal
from collections import Counter

import pytest

from conftest import START_TIMEOUT, taskrunner, wait_for
from sample_handlers import read_records
from taskrunner import Config
from taskrunner.fleet import liveness
from taskrunner.errors import RunnerLimitReached
from taskrunner.store.models import RUNNER, RUNNING, Run, Runner, RunnerQueue
from taskrunner.store.bound import Store
from test_overseer import Overseers, overseer_toml

REPORTS = "[queues.reports]\nlimit = %d\n"


@pytest.fixture
def overseers(database, tmp_path):
    group = Overseers(database, tmp_path)
    yield group
    group.kill_all()


class Sampler:
    """The most runs running and runners registered per queue, seen so far."""

    def __init__(self):
        self.runs = Counter()
        self.runners = Counter()
        self.total = 0

    def sample(self):
        running = Counter(q for (q,) in Run.select(Run.queue).where(Run.status == RUNNING).tuples())
        serving = Counter(q for (q,) in RunnerQueue.select(RunnerQueue.queue).tuples())
        for counter, seen in ((self.runs, running), (self.runners, serving)):
            for name, count in seen.items():
                counter[name] = max(counter[name], count)
        self.total = max(self.total, Runner.select().where(
            (Runner.kind == RUNNER) & (Runner.status == RUNNING)).count())


@pytest.mark.timeout(240)
def test_slow_reports_with_limit_one_do_not_starve_quick_tasks(database, overseers, tmp_path):
    queue = database.queue()
    log = str(tmp_path / "runs.log")
    reports = queue.add_tasks([{"handler": "sample_handlers.Report", "priority": 5,
                                "data": {"log": log, "sleep": 8}} for _ in range(3)])
    quick = set(queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                                 for _ in range(300)]))
    overseers.start(overseers.config(limit=3, extra=REPORTS % 1))
    sampler = Sampler()

    def quick_done():
        sampler.sample()
        return quick <= {task for task, _, _ in read_records(log)}
    wait_for(quick_done, timeout=120, interval=0.2, message="the 300 quick tasks")
    done = {task for task, _, _ in read_records(log)}
    # Reports run one at a time (8 s each): the quick ones finished while they still ran (with
    # all runners on the reports, the three would have ended before any quick task started).
    assert len(done & set(reports)) < len(reports), overseers.log()

    def reports_done():
        sampler.sample()
        return set(reports) <= {task for task, _, _ in read_records(log)}
    wait_for(reports_done, timeout=120, interval=0.2, message="the reports")
    assert sampler.runs["reports"] == 1 and sampler.runners["reports"] == 1, sampler.runs
    assert sampler.total <= 3
    queue.close()


@pytest.mark.timeout(120)
def test_hup_applies_a_changed_queue_limit(database, overseers, tmp_path):
    queue = database.queue()
    config = overseers.config(limit=4, extra=REPORTS % 1)
    proc = overseers.start(config)
    sampler = Sampler()

    def serving(reports, total):
        sampler.sample()
        rows = Counter(q for (q,) in RunnerQueue.select(RunnerQueue.queue).tuples())
        return rows["reports"] == reports and sum(rows.values()) == total
    wait_for(lambda: serving(1, 4), timeout=START_TIMEOUT, message="1 reports runner of 4")
    with open(config, "w") as fh:
        fh.write('[database]\nurl = "%s"\n' % database.url
                 + overseer_toml(limit=4, extra=REPORTS % 3))
    os.kill(proc.pid, signal.SIGHUP)
    wait_for(lambda: serving(3, 4), timeout=START_TIMEOUT * 2, message="3 reports runners of 4")
    assert sampler.total <= 4
    queue.close()


def test_a_queue_limit_holds_for_runners_started_by_anyone(database, tmp_path):
    config = Config.from_dict({"database": {"url": database.url}, "runner": {"limit": 4},
                               "queues": {"reports": {"limit": 1}}})
    store = Store(config)
    store.migrate()
    Runner, RunnerQueue = store.Runner, store.RunnerQueue
    first = liveness.register(store, serving=("reports", "default"))
    with pytest.raises(RunnerLimitReached, match="reports"):
        liveness.register(store, serving=("default", "reports"))
    # The refused registration left nothing behind: no runner row, no queue row.
    assert Runner.select().where(Runner.status == RUNNING).count() == 1
    assert sorted(r.queue for r in RunnerQueue.select()) == ["default", "reports"]
    path = tmp_path / "c.toml"
    database.write_config(path, "[queues.reports]\nlimit = 1\n")
    cron = taskrunner("run-event", "task-runner:OnProcess", "--queue", "reports",
                      config=str(path))
    assert cron.returncode == 0 and "queue 'reports'" in cron.stderr, cron.stderr
    standalone = taskrunner("runner", "--queue", "reports", config=str(path))
    assert standalone.returncode == 1 and "[queues.reports] limit" in standalone.stderr
    liveness.retire(store, first.id, "done")
    assert RunnerQueue.select().count() == 0          # its queue slots are free again
    assert liveness.register(store, serving=("reports",)).slot == 1
    store.close()


@pytest.mark.timeout(240)
def test_pause_and_resume_reach_the_runners_of_two_overseers(database, overseers, tmp_path):
    """Two overseers (2 runners each). A paused queue is claimed from by none of them while
    other queues' work runs; its run in flight finishes; status shows it paused with its
    backlog and how long it has been paused (no lag); resumed, its tasks run."""
    import json
    queue = database.queue()
    log = str(tmp_path / "runs.log")
    running = Runner.select().where((Runner.kind == RUNNER) & (Runner.status == RUNNING))
    first = overseers.start(overseers.config(limit=2))
    wait_for(lambda: running.count() == 2, timeout=START_TIMEOUT, message="2 runners")
    # The second's host limit is 4: it starts the 2 runners the first one leaves.
    second = overseers.start(database.write_config(tmp_path / "c2.toml", overseer_toml(limit=4)))
    wait_for(lambda: running.count() == 4, timeout=START_TIMEOUT, message="4 runners")
    in_flight = queue.add_task("sample_handlers.Started", {"log": log, "sleep": 2}, queue="mail")
    wait_for(lambda: os.path.exists(log + ".started"), timeout=START_TIMEOUT,
             message="the mail task to start")
    assert "paused" in taskrunner("queue", "pause", "mail", url=database.url, check=True).stdout
    mail = queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log},
                             "queue": "mail"} for _ in range(20)])
    other = set(queue.add_tasks([{"handler": "sample_handlers.Record", "data": {"log": log}}
                                 for _ in range(40)]))

    def done():
        return {task for task, _, _ in read_records(log)}
    wait_for(lambda: other | {in_flight} <= done(), timeout=60, message="the default tasks")
    assert not set(mail) & done()
    pids = {pid for task, _, pid in read_records(log) if task in other}
    parents = {r.parent_id for r in Runner.select().where(Runner.pid.in_(list(pids)))}
    assert len(parents) == 2, "both overseers' runners work while mail is paused\n" + overseers.log()
    status = json.loads(taskrunner("status", "--json", url=database.url, check=True).stdout)
    mail_info = next(q for q in status["queues"] if q["name"] == "mail")
    # Paused on purpose: no lag (no alert), and how long it has been paused.
    assert mail_info["paused"] and mail_info["scheduled"] == 20 and mail_info["lag"] is None
    assert mail_info["paused_for"] >= 0
    assert "paused" in taskrunner("status", url=database.url, check=True).stdout
    taskrunner("queue", "resume", "mail", url=database.url, check=True)
    wait_for(lambda: set(mail) <= done(), timeout=60, message="the mail tasks after resume")
    assert first.poll() is None and second.poll() is None
    queue.close()


@pytest.mark.timeout(180)
def test_eight_runners_started_at_once_for_a_queue_keep_its_limit(database, procs, tmp_path):
    """8 cron-style runners of ``reports`` (limit 2) started together, as supervisord
    numprocs would: 2 register, 6 refuse quietly; sampled throughout, never more than 2."""
    database.queue().close()
    config = database.write_config(tmp_path / "c.toml",
                                   "[runner]\nlimit = 8\n" + REPORTS % 2)
    crowd = [procs.spawn("run-event", "task-runner:OnProcess", "--queue", "reports",
                         config=config, name="r%d" % i) for i in range(8)]
    sampler = Sampler()

    def settled():
        sampler.sample()
        return sum(p.poll() is not None for p in crowd) == 6 and \
            RunnerQueue.select().where(RunnerQueue.queue == "reports").count() == 2
    wait_for(settled, timeout=START_TIMEOUT * 3, interval=0.02, message="2 runners, 6 refused")
    assert sampler.runners["reports"] == 2 and sampler.total == 2
    assert all(p.returncode == 0 for p in crowd if p.poll() is not None), procs.logs()
