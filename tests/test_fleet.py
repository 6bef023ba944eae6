"""A small fleet: four hosts in their own PID/UTS/network namespaces, four runners each,
one PostgreSQL reached over a bridge — bench/fleet.py's harness (bench/hostnet.py,
bench/fleet_watch.py); the bench runs the 20 × 8 version.

What must hold: 2,000 tasks of 5 ms queued at once are each executed exactly once across
the hosts (counted by the handler, outside the database, and by runs), and no host ever
has more runs running than its ``[runner] limit``.
"""
import collections

import pytest
from conftest import databases_required, process_env, wait_for

from bench import fleet as bench_fleet
from bench import fleet_watch, hostnet
from taskrunner import TaskQueue

HOSTS, RUNNERS, TASKS, TASK_MS = 4, 4, 2000, 5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_fleet_runs_every_task_once_within_each_hosts_limit(tmp_path):
    reason = hostnet.missing()
    if reason:
        if databases_required():
            pytest.fail(reason)
        pytest.skip(reason)
    log = str(tmp_path / "executions")
    with bench_fleet.Fleet(HOSTS, RUNNERS, tmp_path, env=process_env()) as fleet:
        fleet.start_all(timeout=60)
        queue = TaskQueue(fleet.url)
        try:
            # Queued while no one may claim, then released at once: every runner of every
            # host races for the same runs.
            queue.pause_queue("default")
            ids = queue.add_tasks([{"handler": bench_fleet.WORK,
                                    "data": {"ms": TASK_MS, "log": log}}] * TASKS)
            sampler = fleet_watch.ConcurrencySampler(fleet, interval=0.05)
            sampler.start()
            queue.resume_queue("default")
            wait_for(lambda: bench_fleet.common.query(
                fleet.url, "SELECT count(*) FROM task_queue WHERE last_status = 'success'"
            )[0][0] == TASKS, timeout=60, interval=0.2, message="every task to succeed")
            sampler.stop()
        finally:
            queue.close()
        runs = collections.Counter(task_id for task_id, in bench_fleet.common.query(
            fleet.url, "SELECT task_id FROM task_runs"))
        overlapping = fleet_watch.most_overlapping(fleet.url)

    with open(log) as fh:
        executions = collections.Counter(int(line.split()[0]) for line in fh)
    assert sorted(executions) == sorted(ids), "tasks never executed, or unknown ones"
    twice = [t for t, n in executions.items() if n != 1]
    assert not twice, "executed more than once: %s" % twice[:10]
    assert all(runs[t] == 1 for t in ids), [t for t in ids if runs[t] != 1][:10]
    # Every host took part, and none ever ran more than its limit: neither in a sample of
    # the running runs nor in the runs' start and end times.
    assert set(overlapping) == {"host%d" % n for n in range(1, HOSTS + 1)}, overlapping
    assert all(n <= RUNNERS for n in overlapping.values()), overlapping
    assert sampler.error is None and sampler.samples > 0, sampler.error
    assert sampler.most and all(n <= RUNNERS for n in sampler.most.values()), sampler.most
