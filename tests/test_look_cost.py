"""A busy runner re-reads its claim order every check_interval (runner/idle.py's look):
with W runners that is W looks a second whatever the jobs, so each must cost little next
to a job. Counted in Python calls, not time (a shared machine's timings swing)."""
import sys

from taskrunner.runs import flow, queues

ECHO = "taskrunner.handlers.Echo"


def _peewee_calls(fn):
    """The calls of peewee's Python functions that `fn()` makes (the driver's are the
    database's own, and differ by driver)."""
    count = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("peewee.py"):
            count[0] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_runners_look_builds_its_statement_once(database):
    queue = database.queue()
    queue.add_task(ECHO)
    queue.add_task(ECHO, queue="reports")
    store = queue.store

    def look():
        return queues.claim_order(store, None, with_work=True, also=(flow.keys_limited,))
    order, work, limited = look()
    assert (order, work, bool(limited[0])) == (["default", "reports"], True, False)
    # The first look builds the statement (over a thousand calls of peewee); the next
    # ones only run it. Before, every look built it again.
    later = [_peewee_calls(look) for _ in range(5)]
    assert max(later) < 30, later
    assert look()[:2] == (["default", "reports"], True)
    queue.close()
