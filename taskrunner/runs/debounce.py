"""Debounce (Inngest's ``debounce``, DBOS's debouncer): enqueues of one key of one handler
within a span collapse into one task.

A *window* opens with the first enqueue of a key: a task due ``debounce`` later. Each later
enqueue of the key while the window is open lands in that task: its due time moves to
``debounce`` after this enqueue (a trailing debounce), never past ``debounce_max`` after the
first one when that is given (so a steady stream still runs), and its data becomes this
enqueue's (``debounce_keep="last"``, the default) or stays the first's (``"first"``). The
window closes when the task is due (its span passed with no enqueue), has a run, or has
ended (cancelled); the next enqueue of the key opens a new window, with a new task.

Storage (migration 0026): ``task_queue.debounce_open`` holds the key while the window may be
open, unique with the handler, and ``debounce_until`` the latest due time. A task added
without a debounce writes none of these columns, and nothing on the claim or the end of a run
reads or writes them: an open window closes by time and by its run's creation, conditions
the next enqueue of its key reads, and that enqueue clears ``debounce_open`` (`land`).
"""
from datetime import timedelta

import peewee as pw

from ..errors import InputError, check_text

# What a later enqueue of an open window does with the task's data.
KEEP = ("last", "first")
# The row key that is an option of the add, not a column (taken off before the insert).
KEEP_OPTION = "debounce_keep"


def window(handler, now, span, key, maximum, keep):
    """The columns of a new window's task (and its `KEEP_OPTION`): due `span` seconds after
    `now`, `maximum` at the latest (None: no cap); `key` None debounces by the handler.
    InputError on a bad option."""
    key = handler if key is None else key
    check_text("debounce_key", key, empty=False)
    if keep not in KEEP:
        raise InputError("debounce_keep must be one of %s, not %r" % (", ".join(KEEP), keep))
    due = now + _delta(span)
    until = None if maximum is None else now + _delta(maximum)
    return {"scheduled_on": min(due, until) if until is not None else due,
            "debounce_key": key, "debounce_open": key, "debounce_until": until,
            "debounce_count": 1, KEEP_OPTION: keep}


def _delta(seconds):
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise InputError("debounce span %r is too long" % (seconds,)) from None


def check_unused(debounce_key, maximum, keep):
    """InputError for a debounce option given without ``debounce``."""
    for name, value in (("debounce_key", debounce_key), ("debounce_max", maximum),
                        ("debounce_keep", keep)):
        if value is not None:
            raise InputError("%s needs debounce (the span of the window)" % name)


def land(store, row, keep):
    """Inside the caller's write transaction: land the new window's `row` (`window`, without
    its `KEEP_OPTION`, given as `keep`) in the open window of its key and handler; returns
    that task's id, or None when no window is open (the caller inserts `row`, which opens
    the next one). A closed window found holding the key gives it up here.
    Races closed, with the caller's insert: two enqueues of one key — the holder row is locked
    first (FOR UPDATE; SQLite's write lock), so its window is pushed, or found closed and
    released, by one of them at a time; two enqueues that both find no holder both insert,
    and the unique index on (debounce_open, handler) refuses the second (IntegrityError: the
    caller starts over and lands in the first's window). The window's conditions are read
    under the lock against the run's creation (``run_count``), which locks the task too."""
    Task = store.Task
    key, now, due = row["debounce_open"], row["queued_on"], row["scheduled_on"]
    holder = Task.select(Task.id).where((Task.debounce_open == key)
                                        & (Task.handler == row["handler"]))
    if not store.is_sqlite:
        holder = holder.for_update()
    holder = holder.first()
    if holder is None:
        return None
    pushed = pw.Case(None, [(Task.debounce_until < due, Task.debounce_until)], due)
    changes = {Task.scheduled_on: pushed, Task.next_run_on: pushed, Task.updated_on: now,
               Task.debounce_count: Task.debounce_count + 1}
    if keep == "last":
        changes[Task.data] = row["data"]
    still_open = ((Task.id == holder.id) & (Task.run_count == 0) & Task.finished_on.is_null()
                  & (Task.scheduled_on > now))
    if Task.update(changes).where(still_open).execute():
        return holder.id
    Task.update(debounce_open=None).where(Task.id == holder.id).execute()
    return None

