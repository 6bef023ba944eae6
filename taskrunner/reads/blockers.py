"""Why a task that has not ended is not running: the ``blocked_by`` of every task record, read
for a page of tasks in a bounded number of queries (one per kind of reason present in the
page, never one per task).

Each reason is a dict with ``reason`` (a word below), ``text`` (the sentence the CLI and the
dashboard show) and the facts it names:

- ``queue-paused``: ``queue``, ``since``.
- ``concurrency-key``: ``key``, ``limit``, ``tasks`` (the tasks holding its slots:
  ``{"id", "status"}``).
- ``rate-limit``: ``kind`` (``queue`` or ``key``), ``name``, ``next_slot_in`` (seconds).
- ``parents``: ``tasks`` (the ids of the parents that have not succeeded yet).
- ``event``: ``event``, ``until`` (its timeout, or None); ``sleep``: ``until``.
- ``backoff`` (retrying after a failure), ``snoozed`` (the handler asked to run later),
  ``not-due`` (added for later): ``until``.
- ``debounce``: its debounce window is open: ``key``, ``until`` (when it runs unless
  enqueued again), ``latest`` (``debounce_max``'s cap, or None), ``enqueues`` (that landed in it).
- ``due``: due since ``since``; nothing holds it back but a free runner of ``queue``.
"""
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

import peewee as pw

from ..runs import flow
from ..store.models import FAILED, RUNNING, SCHEDULED, WAITING, utcnow

# error_code of a run whose handler asked to run again later (runner/outcomes.py).
SNOOZED = "Snoozed"


def _iso(value: Optional[datetime]) -> Optional[str]:
    return value.replace(tzinfo=timezone.utc).isoformat() if value is not None else None


def _words(value: Optional[datetime]) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "-"


def _seconds(value: float) -> str:
    return "%.1fs" % value if value < 60 else "%dmin %ds" % divmod(int(round(value)), 60)


def blocked_by(store: Any, rows: List[Any], now: Optional[datetime] = None
               ) -> Dict[int, List[Dict[str, Any]]]:
    """{task id: its reasons, most telling first} of those of the task rows `rows` that have
    not ended and are not running; the others are left out. `now`: naive UTC, this host's
    (the database's clock is used)."""
    Task, Run, Queue = store.Task, store.Run, store.Queue
    open_rows = [r for r in rows if r.finished_on is None
                 and (r.last_status in (SCHEDULED, WAITING) + FAILED)]
    if not open_rows:
        return {}
    at = store.database_time(now or utcnow())
    ids = [r.id for r in open_rows]
    live = {task_id: (status, scheduled_on) for task_id, status, scheduled_on in Run.select(
        Run.active_task_id, Run.status, Run.scheduled_on).where(
        Run.active_task_id.in_(ids)).tuples()}
    # A running task's row says scheduled (the claim writes the run alone): nothing holds it.
    open_rows = [r for r in open_rows if live.get(r.id, (None,))[0] != RUNNING]
    if not open_rows:
        return {}
    paused = {name: since for name, since in Queue.select(Queue.name, Queue.paused_on).where(
        (Queue.paused == True)  # noqa: E712
        & Queue.name.in_(sorted({r.queue for r in open_rows}))).tuples()}
    keys = sorted({r.waiting_key for r in open_rows if r.waiting_key})
    holders: Dict[str, List[Dict[str, Any]]] = {}
    if keys:
        for key, task_id, status in Run.select(Run.concurrency_key, Run.task_id, Run.status).where(
                Run.concurrency_key.in_(keys) & Run.concurrency_slot.is_null(False)).order_by(
                Run.task_id).tuples():
            holders.setdefault(key, []).append({"id": task_id, "status": status})
    queued = [r for r in open_rows if r.id in live and live[r.id][0] == SCHEDULED]
    empty = flow.empty_buckets(store, [r.queue for r in queued],
                               [r.rate_key for r in queued if r.rate_key], at) if queued else {}
    parents: Dict[int, List[int]] = {}
    waiting_parents = [r.id for r in open_rows if r.last_status == WAITING and r.waiting_parents]
    if waiting_parents:
        Dependency = store.Dependency
        for task_id, parent_id in Dependency.select(Dependency.task_id, Dependency.parent_id).where(
                Dependency.task_id.in_(waiting_parents) & ~Dependency.satisfied).order_by(
                Dependency.task_id, Dependency.parent_id).tuples():
            parents.setdefault(task_id, []).append(parent_id)
    later = [r.id for r in open_rows if r.id not in live and r.last_status == SCHEDULED
             and r.next_run_on is not None and r.next_run_on > at]
    snoozed = set()
    if later:
        latest = Run.select(pw.fn.MAX(Run.id)).where(Run.task_id.in_(later)).group_by(Run.task_id)
        snoozed = {task_id for task_id, code, in Run.select(Run.task_id, Run.error_code).where(
            Run.id.in_(latest)).tuples() if code == SNOOZED}
    result = {}
    for r in open_rows:
        reasons = []
        if r.queue in paused:
            reasons.append({"reason": "queue-paused", "queue": r.queue,
                            "since": _iso(paused[r.queue]),
                            "text": "queue %s paused" % r.queue})
        reasons += _own(r, live.get(r.id), holders, empty, parents, r.id in snoozed, at)
        result[r.id] = reasons
    return result


def _own(r: Any, live: Any, holders: Dict[str, List[Dict[str, Any]]],
         empty: Dict[Any, float], parents: Dict[int, List[int]], snoozed: bool,
         at: datetime) -> List[Dict[str, Any]]:
    """The reasons of the task row `r` itself (its queue's pause aside)."""
    if r.last_status == WAITING:
        if r.waiting_parents:
            ids = parents.get(r.id, [])
            return [{"reason": "parents", "tasks": ids,
                     "text": "waiting for %d parent%s: %s" % (
                         r.waiting_parents, "" if r.waiting_parents == 1 else "s",
                         ", ".join("task %d" % i for i in ids))}]
        if r.waiting_for:
            return [{"reason": "event", "event": r.waiting_for, "until": _iso(r.next_run_on),
                     "text": "waiting for event %s%s" % (r.waiting_for, " until %s" % _words(
                         r.next_run_on) if r.next_run_on else "")}]
        return [{"reason": "sleep", "until": _iso(r.next_run_on),
                 "text": "sleeping until %s" % _words(r.next_run_on)}]
    if r.waiting_key:
        held = holders.get(r.waiting_key, [])
        return [{"reason": "concurrency-key", "key": r.waiting_key, "limit": r.concurrency_limit,
                 "tasks": held,
                 "text": "held by concurrency key %s (limit %s): %s" % (
                     r.waiting_key, r.concurrency_limit,
                     ", ".join("task %d %s" % (h["id"], h["status"]) for h in held)
                     or "a slot frees at the next queue pass")}]
    if live is None:
        until = r.next_run_on
        if until is None or until <= at:
            return [{"reason": "due", "since": _iso(until or r.scheduled_on), "queue": r.queue,
                     "text": "due: its run is created at the next queue pass"}]
        if r.debounce_open is not None and r.run_count == 0:
            latest = " (at the latest %s)" % _words(r.debounce_until) if r.debounce_until else ""
            return [{"reason": "debounce", "key": r.debounce_key, "until": _iso(until),
                     "latest": _iso(r.debounce_until), "enqueues": r.debounce_count,
                     "text": "debounce key %s: runs at %s unless enqueued again%s (%d "
                             "enqueue%s so far)" % (r.debounce_key, _words(until), latest,
                                                     r.debounce_count,
                                                     "" if r.debounce_count == 1 else "s")}]
        if r.last_status in FAILED:
            return [{"reason": "backoff", "until": _iso(until),
                     "text": "retrying after %s (failed %d of %d)" % (
                         _words(until), r.runs_failed, r.max_retries)}]
        if snoozed:
            return [{"reason": "snoozed", "until": _iso(until),
                     "text": "snoozed until %s" % _words(until)}]
        return [{"reason": "not-due", "until": _iso(until),
                 "text": "not due until %s" % _words(until)}]
    status, scheduled_on = live
    if status != SCHEDULED:
        return []
    reasons = []
    for kind, name in ((flow.QUEUE, r.queue), (flow.KEY, r.rate_key)):
        wait = empty.get((kind, name))
        if wait is not None:
            reasons.append({"reason": "rate-limit", "kind": kind, "name": name,
                            "next_slot_in": wait,
                            "text": "rate limit of %s %s: next slot in %s" % (
                                kind, name, _seconds(wait))})
    return reasons or [{"reason": "due", "since": _iso(scheduled_on), "queue": r.queue,
                        "text": "due since %s: waiting for a free runner of queue %s" % (
                            _words(scheduled_on), r.queue)}]
