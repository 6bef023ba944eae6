"""What an operator hits (issue #29): a succeeded task carries no earlier error, queue lag
leaves paused queues out, pause/resume refuse a queue nobody uses, retry/cancel report
missing ids, bulk retry is batched and fast, the histogram starts at 1 ms, runners busy."""
import json
import os
import pty
import re
import subprocess
import sys
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from taskrunner.errors import InputError  # noqa: E402
from taskrunner.reads import records as reads, summaries  # noqa: E402
from taskrunner.runs import control  # noqa: E402
from taskrunner.store.models import utcnow  # noqa: E402

from conftest import ok, process_env, taskrunner, usage_error, utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402


def samples_of(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def succeeded_after_a_failure(queue):
    task_id = queue.add_task("sample_handlers.FailTimes", {"fail": 1}, max_retries=3,
                             retry_backoff=60)
    start = utc(utcnow())
    queue.run_pending(now=start)
    queue.run_pending(now=start + timedelta(hours=1))
    assert [r.status for r in queue.runs_of(task_id)] == ["error", "success"]
    return task_id


def test_a_succeeded_task_carries_no_earlier_error(database):
    queue = database.queue()
    task_id = succeeded_after_a_failure(queue)
    task = queue.get_task(task_id)
    assert task.status == "success"
    assert (task.last_error_code, task.last_error_message, task.last_traceback) == \
        (None, None, None)
    listed = reads.list_tasks(queue.store)[0]
    assert listed.last_error_code is None and listed.last_traceback is None
    queue.close()
    text = ok(taskrunner("show", str(task_id), url=database.url))
    assert "Planned" not in text and "traceback" not in text, text
    # The failed run keeps its error: the history of the attempts is not rewritten.
    assert "Planned" in ok(taskrunner("runs", str(task_id), url=database.url))


def test_dashboard_shows_no_stale_error_on_a_succeeded_task(sqlite_db):
    queue = sqlite_db.queue()
    task_id = succeeded_after_a_failure(queue)
    served = Served(queue.store)
    try:
        facts = fetch(served.url + "/tasks/%d" % task_id)[1].split('<h2>Runs</h2>')[0]
        assert "Last error" not in facts and "Planned" not in facts, facts
        row = re.findall(r"<tr><td[ >].*?</tr>", fetch(served.url + "/tasks")[1], re.S)[0]
        assert "Planned" not in row and 'class="err"' not in row, row
    finally:
        served.stop()
        queue.close()


def test_lag_leaves_paused_queues_out_and_says_how_long_they_are_paused(database):
    queue = database.queue()
    queue.add_task("taskrunner.handlers.Echo", queue="mail",
                   scheduled_on=utc(utcnow()) - timedelta(seconds=300))
    queue.add_task("taskrunner.handlers.Echo", scheduled_on=utc(utcnow()) - timedelta(seconds=30))
    queue.pause_queue("mail")
    stats = {q.name: q for q in reads.queue_stats(queue.store)}
    assert stats["mail"].lag is None and stats["mail"].paused_for is not None
    assert 0 <= stats["mail"].paused_for < 60
    assert stats["default"].paused_for is None and 25 <= stats["default"].lag < 290
    assert 25 <= summaries.queue_lag(queue.store) < 290
    queue.close()
    samples = samples_of(ok(taskrunner("metrics", url=database.url)))
    assert 25 <= samples[("taskrunner_queue_lag_seconds", ())] < 290
    assert samples[("taskrunner_queue_lag_by_queue_seconds", (("queue", "mail"),))] == 0
    assert 0 <= samples[("taskrunner_queue_paused_seconds", (("queue", "mail"),))] < 60
    assert samples[("taskrunner_queue_paused_seconds", (("queue", "default"),))] == 0
    shown = json.loads(ok(taskrunner("queue", "list", "--json", url=database.url)))
    assert [q["lag"] for q in shown if q["name"] == "mail"] == [None]


def test_pause_and_resume_refuse_an_unknown_queue_and_a_queue_can_be_removed(database):
    url = database.url
    usage_error(taskrunner("queue", "pause", "mial", url=url), "no queue named 'mial'",
                "--create")
    usage_error(taskrunner("queue", "resume", "mial", url=url), "no queue named 'mial'")
    assert "mial" not in ok(taskrunner("queue", "list", url=url))
    ok(taskrunner("queue", "pause", "later", "--create", url=url))
    assert "later" in ok(taskrunner("queue", "list", url=url))
    ok(taskrunner("queue", "remove", "later", url=url))
    assert "later" not in ok(taskrunner("queue", "list", url=url))
    usage_error(taskrunner("queue", "remove", "later", url=url), "no queue named 'later'")
    queue = database.queue()
    queue.add_task("taskrunner.handlers.Echo", queue="mail")
    assert queue.pause_queue("mail") is True
    with pytest.raises(InputError, match="no queue named 'mial'"):
        queue.pause_queue("mial")
    assert queue.pause_queue("new", create=True) is True
    queue.remove_queue("new")
    assert "new" not in {q.name for q in queue.queues()}
    queue.close()
    usage_error(taskrunner("queue", "remove", "mail", url=url), "queue 'mail' has 1 task")


def test_retry_and_cancel_with_ids_report_each_missing_id_and_exit_1(database):
    queue = database.queue()
    failed = queue.add_task("taskrunner.handlers.Fail", {"code": "Planned"}, max_retries=1)
    queue.run_pending()
    waiting = queue.add_task("taskrunner.handlers.Echo",
                             scheduled_on=utc(utcnow()) + timedelta(days=1))
    queue.close()
    result = taskrunner("retry", str(failed), "99999", "99998", url=database.url)
    assert result.returncode == 1, result
    assert "re-armed 1 of 3" in result.stdout
    assert "99999" in result.stderr and "99998" in result.stderr, result.stderr
    assert queue.get_task(failed).status == "scheduled"
    result = taskrunner("cancel", str(waiting), "99999", "--json", url=database.url)
    assert result.returncode == 1, result
    assert json.loads(result.stdout) == {"changed": [waiting], "refused": [],
                                         "missing": [99999]}


def test_run_duration_histogram_has_buckets_from_one_millisecond(database):
    queue = database.queue()
    queue.add_task("taskrunner.handlers.Echo")
    queue.run_pending()
    queue.close()
    samples = samples_of(ok(taskrunner("metrics", url=database.url)))
    bounds = sorted(float(dict(labels)["le"]) for name, labels in samples
                    if name == "taskrunner_run_duration_seconds_bucket")
    assert bounds[0] == 0.001 and {0.005, 0.01, 0.05}.issubset(bounds), bounds


def test_busy_runners_gauge_counts_runners_executing_a_run(database):
    from taskrunner.runs import lifecycle
    from taskrunner.fleet import liveness
    queue = database.queue()
    queue.add_task("taskrunner.handlers.Echo")
    busy = liveness.register(queue.store)
    liveness.register(queue.store)      # idle
    assert lifecycle.claim(queue.store, busy.id) is not None
    host = busy.host
    samples = samples_of(ok(taskrunner("metrics", url=database.url)))
    assert samples[("taskrunner_runners_busy", (("host", host),))] == 1
    assert samples[("taskrunner_runners_alive", (("host", host),))] == 2
    queue.close()


def given_up_tasks(queue, count):
    ids = queue.add_tasks([{"handler": "taskrunner.handlers.Fail", "data": {"code": "X"},
                            "max_retries": 1} for _ in range(count)])
    queue.run_pending()
    assert reads.count_tasks(queue.store, status="given-up") == count
    return ids


def test_bulk_retry_pays_a_transaction_per_batch_not_per_task(database, monkeypatch):
    """The retry used to re-arm one task per transaction, each followed by a fleet-wide pass
    creating runs (about 8 times slower than cancel). Counted, not timed (speed is measured
    in bench/, never in a unit test): re-arming 300 tasks takes a transaction per batch of
    200 and one pass creating runs per batch, and every task gets its run."""
    queue = database.queue()
    ids = given_up_tasks(queue, 300)
    writes, passes = [], []
    write, create = queue.store.write, control.create_missing_runs

    def counted_write(*args, **kwargs):
        writes.append(1)
        return write(*args, **kwargs)

    def counted_pass(*args, **kwargs):
        passes.append(1)
        return create(*args, **kwargs)
    monkeypatch.setattr(queue.store, "write", counted_write)
    monkeypatch.setattr(control, "create_missing_runs", counted_pass)
    outcome = control.retry_many(queue.store, ids)
    monkeypatch.undo()
    assert outcome == {i: None for i in ids}
    # Two batches: each one transaction re-arming its tasks and one pass (a transaction too).
    assert (len(passes), len(writes)) == (2, 4), (passes, writes)
    assert reads.count_tasks(queue.store, status="scheduled") == 300
    assert all(len(queue.runs_of(i)) == 2 for i in ids[:3] + ids[-3:])
    result = ok(taskrunner("cancel", "--status", "scheduled", url=database.url))
    assert "300 of 300" in result
    queue.close()


def test_bulk_verbs_show_a_progress_line_on_a_terminal(sqlite_db):
    queue = sqlite_db.queue()
    given_up_tasks(queue, 30)
    queue.close()
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "taskrunner", "--database", sqlite_db.url, "retry",
             "--status", "given-up"], stdout=subprocess.PIPE, stderr=slave, text=True,
            env=process_env(), timeout=60)
        os.close(slave)
        slave = None
        shown = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0 and "re-armed 30 of 30" in proc.stdout
    assert b"\rretry: 30 of 30" in shown, shown
    # Not a terminal: no progress line (a log or a pipe gets the summary only).
    result = taskrunner("cancel", "--status", "scheduled", url=sqlite_db.url, process=True)
    assert "\r" not in result.stderr and result.stderr == "", result.stderr
