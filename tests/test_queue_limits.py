"""Queue limits with real overseers and runners: a slow queue with ``limit = 1`` cannot
delay the default queue's pickup, the limit holds whoever starts the runners (rule 5), and
HUP applies a changed limit. Limits are sampled from the database while tasks run."""
import os
import signal
from collections import Counter

import pytest

from conftest import START_TIMEOUT, taskrunner, wait_for
from sample_handlers import read_records
from taskrunner import Config, liveness
from taskrunner.errors import RunnerLimitReached
from taskrunner.models import RUNNER, RUNNING, Run, Runner, RunnerQueue
from taskrunner.store import Store
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
    # Reports run one at a time (8 s each): the quick ones finished while they ran.
    assert len(done & set(reports)) <= 1, overseers.log()

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
