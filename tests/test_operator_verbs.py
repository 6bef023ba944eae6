"""The verbs operators of Mission Control and Oban Web expect (issue #29): run a periodic
task now, delete finished tasks."""
import json
import re
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")

from taskrunner.errors import InputError, StateError  # noqa: E402
from taskrunner.periodic import scheduler as periodic  # noqa: E402
from taskrunner.store.models import utcnow  # noqa: E402

from conftest import ok, taskrunner, usage_error, utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402
from test_dashboard import location, token_of  # noqa: E402


def test_a_periodic_task_runs_now_without_moving_its_schedule(database):
    queue = database.queue()
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "*-*-* 03:00",
                          data={"k": 1})
    before = periodic.PeriodicScheduler(queue.store).next_due()
    out = json.loads(ok(taskrunner("periodic", "run", "nightly", "--json", url=database.url)))
    task = queue.get_task(out["task_id"])
    assert (task.handler, task.data, task.status) == ("taskrunner.handlers.Echo", {"k": 1},
                                                      "scheduled")
    assert task.periodic_task_id is not None
    assert periodic.PeriodicScheduler(queue.store).next_due() == before
    # Like its due times, never two of its tasks at once.
    with pytest.raises(StateError, match="has not finished"):
        periodic.run_now(queue.store, "nightly")
    usage_error(taskrunner("periodic", "run", "nightly", url=database.url), "has not finished")
    assert queue.run_pending() == 1
    assert queue.get_task(out["task_id"]).status == "success"
    assert periodic.run_now(queue.store, "nightly") > out["task_id"]
    with pytest.raises(InputError, match="no periodic task named 'nope'"):
        periodic.run_now(queue.store, "nope")
    queue.close()


def test_run_now_from_the_dashboard(sqlite_db):
    queue = sqlite_db.queue()
    periodic.add_periodic(queue.store, "nightly", "taskrunner.handlers.Echo", "*-*-* 03:00")
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/periodic")[1]
        assert "Run now" in body
        status, _, headers = fetch(served.url + "/periodic/run",
                                   data="csrf=%s&name=nightly" % token_of(served, "/periodic"))
        assert status == 303 and re.search(r"periodic task 'nightly': task \d+ submitted",
                                           location(headers)), location(headers)
        assert len(queue.tasks()) == 1
    finally:
        served.stop()
        queue.close()
