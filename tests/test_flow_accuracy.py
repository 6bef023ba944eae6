"""A queue's rate limit holds for the fleet as a whole (issue 27): two overseers of four
runners each (two hosts' worth, `taskrunner overseer` processes) drain 3,000 tasks of a queue
limited to 50/s. No one-second window of the runs' starts holds more than the limit plus the
burst (5: a tenth of a second of the rate), and the sustained rate is at least 95 % of the
limit: runners throttled sleep until the bucket's next token, and wake for it.

About 60 s per database, on purpose (the rate is the point): marked slow, so that it starts
first and overlaps the rest of the suite, and run in CI like every test.
"""
import bisect

import pytest

from conftest import wait_for
from taskrunner.store.models import Run

TASKS, RATE, BURST, HOSTS, RUNNERS = 3000, 50, 5, 2, 4


def most_in_a_second(starts):
    """The largest number of `starts` (sorted datetimes) in any window [t, t + 1 s)."""
    seconds = [(s - starts[0]).total_seconds() for s in starts]
    return max(bisect.bisect_left(seconds, t + 1.0) - i for i, t in enumerate(seconds))


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_overseers_keep_a_queue_rate_together(database_sp, procs, tmp_path):
    queue = database_sp.queue()
    queue.add_tasks([{"handler": "taskrunner.handlers.Echo"}] * TASKS)
    overseers = []
    for host in range(HOSTS):
        config = database_sp.write_config(tmp_path / ("host%d.toml" % host), (
            '[runner]\nlimit = %d\nhost_id = "flow-host-%d"\nwakeup_dir = "%s"\n'
            '[queues.default]\nlimit = %d\nrate = "%d/s"\n'
            % (RUNNERS, host, tmp_path / ("wake%d" % host), RUNNERS, RATE)))
        overseers.append(procs.spawn("overseer", config=config, name="overseer%d" % host))
    try:
        wait_for(lambda: Run.select().where(Run.status == "success").count() == TASKS,
                 timeout=TASKS / RATE * 2 + 60, interval=0.5,
                 message="every task to succeed")
    except AssertionError:
        raise AssertionError(procs.logs(overseers)) from None
    starts = sorted(r.started_on for r in Run.select(Run.started_on))
    hosts = {r.runner_id for r in Run.select(Run.runner_id).distinct()}
    queue.close()
    assert len(starts) == TASKS
    assert len(hosts) > RUNNERS, "both overseers' runners claimed"
    most = most_in_a_second(starts)
    sustained = (TASKS - 1) / (starts[-1] - starts[0]).total_seconds()
    print("most in a second: %d, sustained: %.2f/s" % (most, sustained))
    assert most <= RATE + BURST, most
    assert sustained >= 0.95 * RATE, sustained
