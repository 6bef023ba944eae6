"""The run lifecycle — rules 1 to 4: creating runs (rule 3), claiming them (rule 2), ending
them (rule 4) every way a run ends (success, failure, timeout, a cancel of a scheduled or a
running run, a hand-back, a dead runner), aggregating each task after its run, giving runs
back.

Rule 1 (one live run per task) is the unique index on ``task_runs.active_task_id``. The
statements are the catalogue's (sql.py), each with the race it closes; this module decides
which one runs when, in one write transaction of the store. What others do when a run ends
(a periodic task's last status) is a hook registered with `on_outcome` where a process builds
its store (periodic.scheduler.install_hooks), so this module
imports none of them.

Times: a `now` given here is this host's (a runner's clock, or the time a test injects);
what is written and compared is the database server's clock (`Store.database_time`), so a
maintainer whose clock is off neither times out a fresh run nor keeps an overdue one, and a
runner whose clock is off is judged fairly. Times handed back to the caller are its own.
"""
import logging
import random
from collections import namedtuple
from datetime import timedelta

import peewee as pw

from . import flow, graph, sql
from .concurrency import create_keyed_runs, release_waiting
from .statements.shared import needs_slot_check
from ..errors import StateError
from ..store.models import (CANCELLED, CRASHED, DEFAULT_QUEUE, FAILED, REQUEUED, RUNNING,
                            SCHEDULED, STOPPING_PREFIX, SUCCESS, TIMEOUT, TRACEBACK_LIMIT,
                            WAITING, run_status_is, utcnow)

log = logging.getLogger("taskrunner.lifecycle")

# `started_on`: the caller's clock (its deadlines: run.deadline, max_runtime's hard limit).
ClaimedRun = namedtuple("ClaimedRun", "run_id task_id attempt handler data max_runtime "
                                      "periodic_task_id started_on")
_OUTCOME_HOOKS = []
_FAILURE_HOOKS = []


def on_outcome(hook):
    """Register ``hook(store, periodic_task_id, status, now, error_code)``, called inside the
    transaction that ends a run of a task submitted by a periodic task, or cancels such a
    task (`now`: the database's clock)."""
    if hook not in _OUTCOME_HOOKS:
        _OUTCOME_HOOKS.append(hook)


def _outcome(store, periodic_task_id, status, now, error_code=None):
    for hook in _OUTCOME_HOOKS:
        hook(store, periodic_task_id, status, now, error_code)


def after_failure(hook):
    """Register ``hook(store, task_id, status, error_code, final)``, called after the commit
    of a transaction that ended a run of the task failed (``error``, ``timeout``) or
    cancelled the task, in the process that recorded it, whoever that is: the runner of the
    run, the overseer that reaped it dead, a maintainer or runner that found it dead or
    overdue, the operator who cancelled it. `final`: the task gets no further run (given
    up, cancelled). A framework's "task finished" notice is sent from here for the ends its
    runner's handler never saw."""
    if hook not in _FAILURE_HOOKS:
        _FAILURE_HOOKS.append(hook)


def _failure(store, task_id, status, error_code, final):
    for hook in _FAILURE_HOOKS:
        store.after_commit(lambda hook=hook: hook(store, task_id, status, error_code, final))


def retry_delay(runs_failed, base, cap, rand=random.random):
    """Exponential backoff after `runs_failed` consecutive failures, capped, with jitter
    (half fixed, half random) so failed tasks don't all come back at the same moment."""
    # The exponent is capped: 2 ** 1025 no longer fits a float, and max_retries may be huge.
    delay = min(cap, base * 2 ** min(max(0, runs_failed - 1), 64))
    return delay / 2 + rand() * delay / 2


def crash_backoff(not_before, now, crashed_before, cap):
    """The earliest retry after a crash: `not_before` (crash_grace from now, given when an
    overseer starts and finds crashed runs) doubled by each crash before it in a row,
    capped at `cap` but never below crash_grace — TimescaleDB backs a crashed job off by its
    consecutive crashes, so a task that takes its runner down on every start (a segfault,
    the memory of the host) stops restarting every crash_grace."""
    if not_before is None or not_before <= now:
        return not_before
    grace = (not_before - now).total_seconds()
    return now + timedelta(seconds=max(grace, min(cap, grace * 2 ** min(crashed_before, 64))))


def bounded_traceback(text):
    """The last TRACEBACK_LIMIT bytes of a traceback (its end says where it failed), cut at a
    line start and marked as cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= TRACEBACK_LIMIT:
        return text
    tail = data[-(TRACEBACK_LIMIT - 64):].decode("utf-8", "ignore")
    line_start = tail.find("\n", 0, 1024)
    tail = tail[line_start + 1:]
    return "[... %d bytes cut ...]\n%s" % (len(data) - len(tail.encode("utf-8")), tail)


# -- creating runs (rule 3) -------------------------------------------------------------------

def create_missing_runs(store, now=None, batch=500, queues=None):
    """Create the next run of every task whose next_run_on has come (on the database's clock):
    due delayed tasks and failed tasks whose backoff has passed (given-up and final tasks
    have no next_run_on). `queues`: of the tasks of these queues only (`taskrunner verify`'s
    own pass, which leaves every other queue to the fleet's).
    Race closed: two processes creating runs at once — the candidate tasks are locked (SKIP
    LOCKED / SQLite's write lock) and the unique index on task_runs.active_task_id refuses a
    second live run whatever happens."""
    Task = store.Task
    now = store.database_time(now)
    created = 0
    release_waiting(store, now, queues)
    due = Task.next_run_on <= now
    if queues is not None:
        due &= Task.queue.in_(list(queues))
    # A cheap read first: most passes find nothing and need no write lock.
    if not Task.select(Task.id).where(due).exists():
        return 0
    while True:
        def step():
            query = (Task.select(Task.id).where(due)
                     .order_by(Task.next_run_on).limit(batch))
            if not store.is_sqlite:
                query = query.for_update(skip_locked=True)
            ids = [t.id for t in query]
            if ids:
                _create_runs(store, ids, now)
            return len(ids)
        count = store.write_and_wake(step, lambda created: created)
        created += count
        if count < batch:
            return created


def _create_runs(store, ids, now):
    """The next run of each task in `ids` (locked by the caller), inside its transaction.
    A task that has a live run already (a creator that raced it: a retry, a rerun, a
    release) gets none, and keeps its status and run count: only its stale due time is
    cleared, as the end of that live run sets the next one."""
    Task, Run = store.Task, store.Run
    ids = create_keyed_runs(store, ids, now)      # leaves the tasks without a key
    if not ids:
        return
    live = Run.select(Run.id).where(Run.active_task_id == Task.id)
    fresh = [t.id for t in Task.select(Task.id).where(Task.id.in_(ids) & ~pw.fn.EXISTS(live))]
    refused = set(ids) - set(fresh)
    if refused:
        Task.update(next_run_on=None).where(Task.id.in_(sorted(refused))).execute()
    if not fresh:
        return
    source = (Task.select(Task.id, pw.Value(now), pw.Value(now), Task.run_count + 1,
                          Task.id, Task.priority, Task.scheduled_on,
                          pw.Value(SCHEDULED), pw.Value(0), Task.queue, Task.rate_key,
                          Task.tenant)
              .where(Task.id.in_(fresh)))
    Run.insert_from(source, [Run.task_id, Run.created_on, Run.updated_on, Run.attempt,
                             Run.active_task_id, Run.priority, Run.scheduled_on, Run.status,
                             Run.percent_completed, Run.queue, Run.rate_key,
                             Run.tenant]).execute()
    (Task.update(next_run_on=None, run_count=Task.run_count + 1, last_status=SCHEDULED,
                 updated_on=now).where(Task.id.in_(fresh)).execute())


# -- claiming -----------------------------------------------------------------------------------

def scheduled_runs_query(store, queues=None):
    """Scheduled runs (of `queues`, when given), read from the partial claim index (never
    the run history)."""
    Run = store.Run
    query = Run.select(Run.id).where(run_status_is(Run, SCHEDULED))
    if queues is not None:
        query = query.where(Run.queue.in_(list(queues)))
    return query.limit(1)


def running_runs_query(store):
    """Running runs with their task's timeouts, from the partial runner index."""
    Task, Run = store.Task, store.Run
    return (Run.select(Run.id, Run.task_id, Run.runner_id, Run.updated_on, Run.started_on,
                       Task.run_timeout, Task.max_runtime)
            .join(Task, on=(Run.task_id == Task.id)).where(run_status_is(Run, RUNNING)))


def runs_of_runner_query(store, runner_id):
    """The runs a runner has running, from the partial runner index."""
    Run = store.Run
    return Run.select(Run.id, Run.task_id).where((Run.runner_id == runner_id)
                                                 & run_status_is(Run, RUNNING))


def held_queues(slots):
    """The queues of a runner's `slots` ({queue: its slot}) whose claims check the slot
    against the queue's limit: where it could be above one (statements.shared.needs_slot_check).
    """
    return frozenset(queue for queue, slot in slots.items() if needs_slot_check(slot))


def held(queue, held_queues):
    """Whether a claim of `queue` checks its runner's slot against the queue's limit:
    `held_queues` are the queues where the runner's slot could be above one (None: any)."""
    return held_queues is None or queue in held_queues


def claim(store, runner_id, queues=(DEFAULT_QUEUE,), now=None, guarded=False,
          held_queues=None):
    """Start the next run for `runner_id` from the first of `queues` (names, in the order
    to try) that has one: highest priority first, FIFO within a priority within a queue
    (rule 2; the race it closes: sql.claim). Returns a ClaimedRun or None. `guarded`: none
    from a queue paused meanwhile, and none while a rate key has a limit (sql.CLAIM_GUARD;
    for `queues` without flow control only). `held_queues`: see `held`. `now`: the claim's
    time (a test's pinned clock); by default the time it holds the write lock
    (`_claim_now`)."""
    if store.backend == "postgresql":
        # One statement per queue tried, each its own transaction.
        return _claim_now(store, runner_id, queues, now, guarded, held_queues)
    return store.write(lambda: _claim_now(store, runner_id, queues, now, guarded,
                                          held_queues))


def claim_many(store, runner_id, queues, now, limit, share=True, held_queues=None):
    """Inside the caller's write transaction: up to `limit` runs for `runner_id`, from
    `queues` in turn, in the claim order (rule 2, as `claim`); with `share`, of each queue
    no more than this runner's share of its backlog (sql.backlog_share). A list of
    ClaimedRun. `held_queues`: see `held`."""
    at, claimed = store.database_time(now), []
    for queue in queues:
        if len(claimed) >= limit:
            break
        control = flow.claim_flow(store, queue)
        want = limit - len(claimed)
        if share and want > 1 and control is None:
            want = sql.backlog_share(store, queue, want)
        claimed += [ClaimedRun(*row, now) for row in sql.claim(
            store, runner_id, queue, at, want, control,
            slot_check=held(queue, held_queues))]
    return claimed


def _claim_now(store, runner_id, queues, now=None, guarded=False, held_queues=None):
    """_claim_step at `now`, by default at the time it runs: inside the caller's write
    transaction, once its lock is held. A run's started_on is when it was claimed, and its
    run_timeout and max_runtime count from it, for its runner as for whoever times it out:
    a time read before the wait for the lock (a busy host, a runner stopped or descheduled
    meanwhile) would start the run seconds early on the record, and it would be timed out
    that much before its time — taskrunner verify saw one timed out 0.14 s after its handler
    started, its task's next run then executing beside it. A retried transaction reads the
    time again."""
    now = now or utcnow()
    return _claim_step(store, runner_id, queues, now, store.database_time(now), guarded,
                       held_queues)


def _claim_step(store, runner_id, queues, now, at, guarded=False, held_queues=None):
    """claim() inside the caller's write transaction: each queue in turn."""
    for queue in queues:
        rows = sql.claim(store, runner_id, queue, at, flow=flow.claim_flow(store, queue),
                         guarded=guarded, slot_check=held(queue, held_queues))
        if rows:
            return ClaimedRun(*rows[0], now)
    return None


def release_runs_of(store, runner_id, only=None, keep=None, now=None):
    """Give back, unstarted, the runs `runner_id` has ``running`` (just `only`, or all but
    `keep`): a runner told to stop between a claim and the start, or one that lost its
    connection while claiming and cannot know whether the claim committed (such a run would
    otherwise stay ``running`` until its run_timeout). Not a failure, not a new attempt.
    Returns how many were given back (the race it closes: sql.give_back)."""
    Run = store.Run
    at = store.database_time(now)

    def step():
        query = runs_of_runner_query(store, runner_id)
        if only is not None:
            query = query.where(Run.id == only)
        if keep is not None:
            query = query.where(Run.id != keep)
        return sum(sql.give_back(store, run.id, run.task_id, runner_id, at)
                   for run in list(query))
    return store.write_and_wake(step, lambda released: released)


def was_ended_by(store, run_id, runner_id, status):
    """Whether the run ended with `status` by `runner_id`'s own end (not a timeout set by
    someone else): after a lost connection, did the end commit?"""
    return run_id in ended_by(store, runner_id, [run_id], status)


def ended_by(store, runner_id, run_ids, status=SUCCESS):
    """Which of `run_ids` ended with `status` by `runner_id`'s own end."""
    Run = store.Run
    return {r.id for r in Run.select(Run.id).where(
        Run.id.in_(list(run_ids)) & (Run.runner_id == runner_id) & (Run.status == status))}


def taken_away_on(store, run_id, runner_id):
    """(ended_on, cancel_requested) of a run this runner executes: `ended_on` is None while
    the run is still ``running`` under this runner, else when it ended on this host's clock
    (timed out by someone: its finished_on, or now when it has none); `cancel_requested`: an
    operator asked the running run to stop."""
    Run = store.Run
    row = Run.select(Run.status, Run.runner_id, Run.finished_on, Run.cancel_requested_on
                     ).where(Run.id == run_id).first()
    if row is not None and row.status == RUNNING and row.runner_id == runner_id:
        return None, row.cancel_requested_on is not None
    if row is None or row.finished_on is None:
        return utcnow(), False
    return row.finished_on - store.clock_offset(), False


def chunk_taken_away_on(store, run_ids, runner_id):
    """`taken_away_on` of a chunk's runs (runner/chunks.py): None while every one of
    `run_ids` is ``running`` under this runner, else when the first that is not ended."""
    Run = store.Run
    rows = list(Run.select(Run.id, Run.status, Run.runner_id, Run.finished_on).where(
        Run.id.in_(list(run_ids))))
    gone = [row for row in rows if row.status != RUNNING or row.runner_id != runner_id]
    if not gone and len(rows) == len(run_ids):
        return None
    if len(rows) < len(run_ids) or any(row.finished_on is None for row in gone):
        return utcnow()
    return min(row.finished_on for row in gone) - store.clock_offset()


def report_chunk_progress(store, run_ids, runner_id, percent, now=None):
    """`report_progress` of every run of a chunk still this runner's, in one statement."""
    Run = store.Run
    with store.host_turn():
        return Run.update({Run.updated_on: store.database_time(now),
                           Run.percent_completed: percent}).where(
            Run.id.in_(list(run_ids)) & (Run.status == RUNNING)
            & (Run.runner_id == runner_id)).execute()


def report_progress(store, run_id, runner_id, percent=None, results=None, now=None):
    """Store progress and/or the results so far (JSON text) of a running run; its updated_on
    is what run_timeout counts from. False when the run is no longer this runner's (it was
    timed out)."""
    Run = store.Run
    values = {Run.updated_on: store.database_time(now)}
    if percent is not None:
        values[Run.percent_completed] = percent
    if results is not None:
        values[Run.results] = results
    with store.host_turn():
        return Run.update(values).where((Run.id == run_id) & (Run.status == RUNNING)
                                        & (Run.runner_id == runner_id)).execute() > 0


# -- ending -------------------------------------------------------------------------------------

def end_run(store, run_id, task_id, status, runner_id=None, results=None, error_code=None,
            error_message=None, now=None, periodic_task_id=None, retry_at=None, traceback=None,
            waiting_for=None, give_up=False):
    """End a running run with `status` and aggregate its task (`end_in_transaction`).
    Returns False when it lost the race of rule 4 (someone ended the run meanwhile).
    Whoever waits for a task on this host (`TaskQueue.wait`) is woken after the commit.
    `give_up`: a failure that gives its task up whatever its max_retries (TaskError
    ``retry=False``).
    """
    return _end_run(store, run_id, task_id, status, store.database_time(now), runner_id,
                    results, error_code, error_message, periodic_task_id,
                    _on_database_clock(store, retry_at), traceback, waiting_for, give_up)


def _end_run(store, run_id, task_id, status, at, runner_id=None, results=None, error_code=None,
             error_message=None, periodic_task_id=None, retry_at=None, traceback=None,
             waiting_for=None, give_up=False):
    """end_run() on the database's clock (`at`, `retry_at`)."""
    args = (store, run_id, task_id, status, runner_id, results, error_code, error_message, at,
            periodic_task_id, retry_at, traceback, waiting_for, give_up)
    ended = None
    if _single_statement_end(store, status, runner_id, periodic_task_id):
        ended = sql.end_success_alone(store, run_id, task_id, runner_id, results, at)
    if ended is None:       # not a lone success, or one whose task has dependents
        ended = store.write(lambda: _end(*args))
    if ended:
        store.wake_waiters()
    return ended


def end_run_and_claim(store, run_id, task_id, status, runner_id, results=None, error_code=None,
                      error_message=None, now=None, periodic_task_id=None, retry_at=None,
                      traceback=None, queues=(DEFAULT_QUEUE,), waiting_for=None,
                      give_up=False, held_queues=None, claim_now=None):
    """end_run() of a runner's own run and claim() of its next from `queues` in one
    transaction, so a busy runner pays one commit per job (one statement on PostgreSQL for
    a success and a run of the first queue). Same rules as the two calls; the claim happens
    even when the end lost its race. Returns (ended, ClaimedRun or None). `held_queues`:
    see `held`. `now` is the end's time (when the handler returned); `claim_now` the
    claim's, by default the time the transaction holds its lock (`_claim_now`); PostgreSQL's
    one statement, which waits for no lock, claims at `now`."""
    now = now or utcnow()
    at = store.database_time(now)
    if _single_statement_end(store, status, runner_id, periodic_task_id) and queues \
            and flow.claim_flow(store, queues[0]) is None:
        ended, row = sql.end_success_and_claim(store, run_id, task_id, runner_id, results, at,
                                               queues[0], held(queues[0], held_queues))
        claimed = None if row is None else ClaimedRun(*row, now)
        if ended is None:   # its task has dependents: ended with their release
            ended = store.write(lambda: _end(store, run_id, task_id, status, runner_id,
                                             results, None, None, at, None, None, None))
        if claimed is None and len(queues) > 1:
            claimed = _claim_now(store, runner_id, queues[1:], claim_now,
                                 held_queues=held_queues)
    else:
        retry_at = _on_database_clock(store, retry_at)
        ended, claimed = store.write(lambda: (
            _end(store, run_id, task_id, status, runner_id, results, error_code,
                 error_message, at, periodic_task_id, retry_at, traceback, waiting_for,
                 give_up),
            _claim_now(store, runner_id, queues, claim_now, held_queues=held_queues)))
    if ended:
        store.wake_waiters()
    return ended, claimed


def end_successes(store, runner_id, done):
    """Inside the caller's write transaction: a runner's successes, each (run id, task id,
    results, when it ended on the runner's clock, periodic task id or None), ended as
    `end_run` ends one (rule 4 for each). Returns the ids of the runs ended."""
    offset = store.clock_offset()
    done = [(run_id, task_id, results, finished_on + offset, periodic_task_id)
            for run_id, task_id, results, finished_on, periodic_task_id in done]
    ended = sql.end_successes(store, runner_id, [d[:4] for d in done])
    for run_id, _, _, at, periodic_task_id in done:
        if run_id in ended and periodic_task_id is not None:
            _outcome(store, periodic_task_id, SUCCESS, at)
        if ended.get(run_id) is not None:
            _release(store, ended[run_id], at)
    return set(ended)


def _single_statement_end(store, status, runner_id, periodic_task_id):
    """A runner's success of a plain task on PostgreSQL: one statement, no transaction."""
    return (store.backend == "postgresql" and status == SUCCESS and runner_id is not None
            and periodic_task_id is None)


def _on_database_clock(store, when):
    return None if when is None else store.database_time(when)


def end_in_transaction(store, run_id, task_id, status, runner_id, results, error_code,
                       error_message, now, periodic_task_id=None, retry_at=None, traceback=None,
                       waiting_for=None):
    """end_run() inside the caller's write transaction. `retry_at`: when a requeued task
    runs again, for a failure the earliest time of its retry (crash_grace), for a waiting
    one the end of its sleep or of its wait for the event `waiting_for` (None: no end)."""
    return _end(store, run_id, task_id, status, runner_id, results, error_code, error_message,
                store.database_time(now), periodic_task_id, _on_database_clock(store, retry_at),
                traceback, waiting_for)


def _end(store, run_id, task_id, status, runner_id, results, error_code, error_message, at,
         periodic_task_id, retry_at, traceback, waiting_for=None, give_up=False):
    """end_in_transaction() on the database's clock. A success is its runner's, and needs no
    read: the caller passes the periodic task id it knows from the claim."""
    if status == SUCCESS:
        ended = sql.end_success(store, run_id, task_id, runner_id, results, at)
        if ended and periodic_task_id is not None:
            _outcome(store, periodic_task_id, status, at)
        if ended == sql.RELEASE:
            _release(store, task_id, at)
        return bool(ended)
    if not sql.end_running(store, run_id, runner_id, status, at, error_code, error_message,
                           results, traceback and bounded_traceback(traceback)):
        return False
    Run = store.Run
    if status in (REQUEUED, WAITING) + FAILED and Run.select(Run.id).where(
            (Run.id == run_id) & Run.cancel_requested_on.is_null(False)).exists():
        # An operator cancelled it while it ran, and its runner died, timed out or handed it
        # back before honouring that: the task ends cancelled all the same, not run again.
        status = CANCELLED
    if status == REQUEUED:
        _requeue(store, task_id, at, retry_at)
    elif status == WAITING:
        _wait(store, task_id, at, retry_at, waiting_for)
    else:
        _aggregate(store, task_id, status, error_code, error_message, at, not_before=retry_at,
                   give_up=give_up)
    return True


def cancel_in_transaction(store, task_id, run_id=None, now=None):
    """Inside the caller's write transaction, the task locked and not ended: an operator's
    cancel. Its live run `run_id`, when ``scheduled``, ends ``cancelled`` with the task; when
    ``running``, it is asked to stop and its runner ends it ``cancelled`` (returns `run_id`).
    A task without a live run (delayed, waiting for a retry or for a concurrency slot) ends
    ``cancelled`` at once. Either way it ends as every run does: aggregated, and the hooks
    told. Returns None when the task is cancelled now.
    Race closed: a cancel against a runner claiming or ending the run — sql.cancel_scheduled
    and sql.ask_to_stop, each conditional on the run's state."""
    at = store.database_time(now)
    if run_id is not None and not sql.cancel_scheduled(store, run_id, at):
        if not sql.ask_to_stop(store, run_id, at):
            raise StateError("task %d: its run %d changed state meanwhile; try again"
                             % (task_id, run_id))
        return run_id
    _aggregate(store, task_id, CANCELLED, None, None, at)
    return None


def _requeue(store, task_id, now, retry_at):
    """The task of a requeued run: scheduled again, its failures not counted; a run at once
    when it is due now (a stopped runner's work must not wait for the next pass)."""
    Task = store.Task
    due = retry_at is None or retry_at <= now
    Task.update(last_status=SCHEDULED, next_run_on=now if due else retry_at,
                updated_on=now).where(Task.id == task_id).execute()
    if due:
        _create_runs(store, [task_id], now)
        store.wake_after_commit(1)


def _wait(store, task_id, now, until, event):
    if isinstance(event, list):
        return _wait_for_tasks(store, task_id, now, event)
    return _wait_for_time_or_event(store, task_id, now, until, event)


def _wait_for_tasks(store, task_id, now, task_ids):
    """The task of a run that ended waiting for the tasks `task_ids` (run.wait_for_tasks:
    children it added): it waits as their dependent (graph.py), released by the last of them
    to end, whatever that end (``on_parent_failure`` "run": the resumed attempt reads how
    each ended); a run at once when all have ended meanwhile.
    Race closed: a child ending while this run ends — both lock the child's row (its end
    first; parent_states here), so either this sees it ended, or its end sees the edge."""
    Task = store.Task
    store.locked(Task.select(Task.id).where(Task.id == task_id)).get()
    states = graph.parent_states(store, task_ids)
    pending = sorted(task for task, state in states.items() if state == "pending")
    Task.update(last_status=WAITING, waiting_for=None, runs_crashed=0,
                next_run_on=None if pending else now, updated_on=now,
                waiting_parents=len(pending) or None,
                on_parent_failure="run" if pending else Task.on_parent_failure).where(
        Task.id == task_id).execute()
    if pending:
        graph.insert_edges(store, [(0, parent, False) for parent in pending], [task_id])
    else:
        _create_runs(store, [task_id], now)
        store.wake_after_commit(1)


def _wait_for_time_or_event(store, task_id, now, until, event):
    """The task of a run that ended ``waiting`` (run.sleep, run.wait_for): ``waiting`` until
    `until` (None: for the event alone) or the event `event`, its failures not counted; a run
    at once when that time has come or the event was sent already.
    Race closed: an event sent while the run was ending (TaskQueue.send_event stores it and
    wakes only a task that waits for it) — both lock the task row first, and this reads the
    events with a locking read (MySQL's repeatable read would show an older snapshot)."""
    Task, Event = store.Task, store.Event
    store.locked(Task.select(Task.id).where(Task.id == task_id)).get()
    due = until is None and event is None or until is not None and until <= now
    if event is not None and not due:
        due = store.locked(Event.select(Event.id).where(
            (Event.task_id == task_id) & (Event.name == event)
            & Event.consumed_on.is_null()).limit(1)).first() is not None
    Task.update(last_status=WAITING, waiting_for=event, runs_crashed=0,
                next_run_on=now if due else until, updated_on=now).where(
        Task.id == task_id).execute()
    if due:
        _create_runs(store, [task_id], now)
        store.wake_after_commit(1)


def wake_waiting(store, task_id, now):
    """Inside the caller's write transaction, the task locked and ``waiting``: its run now
    (the event it waits for was sent)."""
    _create_runs(store, [task_id], now)
    store.wake_after_commit(1)


def _aggregate(store, task_id, status, error_code, error_message, now, not_before=None,
               give_up=False):
    """The task after its run ended with a failure, or ``cancelled``: last_status,
    runs_failed, the last error, and when (if ever) its next run may be created — none
    after max_retries failures in a row, or after a failure that says so (`give_up`); then
    the hooks, with the periodic task read from the (locked) task."""
    Task, config = store.Task, store.config
    task = store.locked(Task.select(Task.runs_failed, Task.runs_crashed, Task.max_retries,
                                    Task.retry_backoff, Task.periodic_task_id,
                                    Task.dependents).where(Task.id == task_id)).get()
    final = status == CANCELLED or give_up or task.runs_failed + 1 >= task.max_retries
    if status == CANCELLED:
        sql.end_task(store, task_id, CANCELLED, now)
    else:
        runs_failed = task.runs_failed + 1
        values = {"runs_failed": runs_failed, "last_error_code": error_code,
                  "last_error_message": error_message}
        if error_code == CRASHED:
            values["crash_count"] = Task.crash_count + 1
            values["runs_crashed"] = task.runs_crashed + 1
            not_before = crash_backoff(not_before, now, task.runs_crashed,
                                       config.task.retry_backoff_max)
        else:
            values["runs_crashed"] = 0      # a run that ended by itself: no crash loop
        if final:
            # Given up: final, with the reason kept in last_error_*.
            sql.end_task(store, task_id, status, now, **values)
        else:
            base = task.retry_backoff if task.retry_backoff is not None \
                else config.task.retry_backoff
            delay = retry_delay(runs_failed, base, config.task.retry_backoff_max)
            Task.update(last_status=status, updated_on=now, next_run_on=max(
                now + timedelta(seconds=delay), not_before or now), **values).where(
                Task.id == task_id).execute()
    if final and task.dependents:
        start_released(store, graph.parent_failed(store, task_id, status, now), now)
    if task.periodic_task_id is not None:
        _outcome(store, task.periodic_task_id, status, now, error_code)
    _failure(store, task_id, status, error_code, final)


# -- the graph (graph.py) ---------------------------------------------------------------------

def _release(store, task_id, at):
    """Inside the transaction of the task's success: its dependents whose last parent it was
    get their run now (rule 10: released in that transaction, exactly once)."""
    start_released(store, graph.release(store, task_id, at), at)


def start_released(store, ids, at):
    """Inside the caller's write transaction: the tasks `ids`, released from waiting for
    their parents, get their first run when due (or wait for their scheduled_on, or a slot
    of their concurrency key, as any task), and idle runners are woken for them. The runs
    are multi-row INSERTs of values: MariaDB fails an INSERT ... SELECT that waits on its
    table's AUTO-INC lock under concurrency (error 1467), which a success may meet."""
    Task, Run = store.Task, store.Run
    for chunk in graph.chunks(ids):
        due = list(Task.select(Task.id, Task.queue, Task.priority, Task.scheduled_on,
                               Task.run_count, Task.concurrency_key).where(
            Task.id.in_(chunk) & (Task.scheduled_on <= at)))
        if len(due) < len(chunk):
            Task.update(next_run_on=Task.scheduled_on).where(
                Task.id.in_(chunk) & (Task.scheduled_on > at)).execute()
        keyed = [t.id for t in due if t.concurrency_key is not None]
        if keyed:
            _create_runs(store, keyed, at)
        plain = [t for t in due if t.concurrency_key is None]
        if plain:
            store.db.execute_sql(*sql.insert_rows(store.backend, Run, [
                {"task_id": t.id, "created_on": at, "updated_on": at,
                 "attempt": t.run_count + 1, "active_task_id": t.id, "priority": t.priority,
                 "scheduled_on": t.scheduled_on, "status": SCHEDULED,
                 "percent_completed": 0, "queue": t.queue} for t in plain]))
            Task.update(next_run_on=None, run_count=Task.run_count + 1, last_status=SCHEDULED,
                        updated_on=at).where(Task.id.in_([t.id for t in plain])).execute()
        by_queue = {}
        for task in due:
            by_queue[task.queue] = by_queue.get(task.queue, 0) + 1
        for queue, count in by_queue.items():
            store.wake_after_commit(count, queue)


def timeout_overdue_runs(store, now=None, reachable_since=None, queues=None):
    """Mark ``timeout`` every running run with no update for its task's run_timeout, or
    running longer than its max_runtime, on the database's clock (the runs' times were
    written on it too). Returns [(run_id, runner_id)] of the runs marked, so the caller can
    stop the processes executing them (rule 8). Progress that could not be written during
    an outage does not count: run_timeout is counted from Store.writable_since at the
    earliest. `queues`: the runs of these queues only (as create_missing_runs)."""
    now = store.database_time(now)
    # Read in full before writing: on SQLite an open SELECT would make each end's write
    # transaction fail as soon as another process had committed meanwhile.
    query = running_runs_query(store)
    if queues is not None:
        query = query.where(store.Run.queue.in_(list(queues)))
    running = list(query.objects())
    since = None
    if any(run.updated_on + timedelta(seconds=run.run_timeout) < now for run in running):
        since = _on_database_clock(store, store.writable_since(reachable_since))  # when it matters
    ended = []
    for run in running:
        updated = max(run.updated_on, since) if since is not None else run.updated_on
        if updated + timedelta(seconds=run.run_timeout) < now:
            message = "no update for %gs (run_timeout)" % run.run_timeout
            code = "RunTimeout"
        elif run.max_runtime and run.started_on + timedelta(seconds=run.max_runtime) < now:
            message = "running longer than %gs (max_runtime)" % run.max_runtime
            code = "MaxRuntime"
        else:
            continue
        if store.write(lambda run=run, code=code, message=message: _end_overdue(
                store, run, now, code, message)):
            store.wake_waiters()
            log.warning("run %d of task %d timed out: %s", run.id, run.task_id, message)
            ended.append((run.id, run.runner_id))
    return ended


def _end_overdue(store, run, now, code, message):
    """End an overdue run ``timeout`` and, in the same transaction, show its runner as
    stopping (TimescaleDB's TERMINATING): the runner notices only at its next heartbeat,
    and its handler may run on until kill_grace — meanwhile `status` says why, and since
    when, not ``running`` with no run. The runner writes its own reason over it (keeping
    the time) and clears it when the run has ended (runner/loop.py)."""
    if not _end(store, run.id, run.task_id, TIMEOUT, None, None, code, message, now, None,
                None, None):
        return False
    Runner = store.Runner
    Runner.update(exit_reason="%srun %d timed out: %s" % (STOPPING_PREFIX, run.id, message),
                  stopping_since=now, stopping_run_id=run.id).where(
        (Runner.id == run.runner_id) & (Runner.status == RUNNING)
        & Runner.exit_reason.is_null()).execute()
    return True
