"""What an operator reaches for on the dashboard: the next run in the task list, the action
notice kept out of the URL, the status first on a phone, the workflows list with its Cancel
button, and searching tasks by their data."""
import re
from datetime import timedelta

import pytest

pytest.importorskip("prometheus_client")

from taskrunner.store.models import utcnow  # noqa: E402

from conftest import utc  # noqa: E402
from dashboard_helpers import Served, fetch  # noqa: E402


def rows_of(body):
    return re.findall(r"<tr><td>.*?</tr>", body, re.S)


def test_task_list_shows_each_tasks_next_run(sqlite_db):
    queue = sqlite_db.queue()
    retrying = queue.add_task("taskrunner.handlers.Fail", {"code": "Again"}, max_retries=3,
                              retry_backoff=3600)
    queue.run_pending()
    next_run = queue.get_task(retrying).next_run_on
    assert next_run is not None and next_run > utc(utcnow()) + timedelta(minutes=30)
    served = Served(queue.store)
    try:
        body = fetch(served.url + "/tasks")[1]
        assert "<th>Next run</th>" in body
        row = next(r for r in rows_of(body) if ">%d<" % retrying in r)
        assert 'datetime="%s"' % next_run.isoformat() in row, row
    finally:
        served.stop()
        queue.close()
