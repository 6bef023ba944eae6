"""The run lifecycle — rules 1 to 4: creating runs (rule 3), claiming them (rule 2), ending
them (rule 4), aggregating each task after its run, timing runs out, giving runs back.

Rule 1 (one live run per task) is the unique index on ``task_runs.active_task_id``; every
function here that changes more than one row runs in one write transaction of the store and
says which race it closes. What others do when a run ends (a periodic task's last status)
is a hook registered with `on_outcome`, so this module imports none of them.
"""
import logging
import random
from collections import namedtuple
from datetime import timedelta

import peewee as pw

from .concurrency import create_keyed_runs, release_waiting
from ..store.models import (CANCELLED, CRASHED, DEFAULT_QUEUE, FAILED, REQUEUED, RUNNING,
                            SCHEDULED, SUCCESS, TIMEOUT, TRACEBACK_LIMIT, run_status_is, utcnow)

log = logging.getLogger("taskrunner.lifecycle")

ClaimedRun = namedtuple("ClaimedRun", "run_id task_id attempt handler data max_runtime "
                                      "periodic_task_id started_on")

# Claiming and finishing happen once per job: plain SQL (peewee's query building costs more
# than the database work). PostgreSQL: one statement of data-modifying CTEs each, and a busy
# runner's end and next claim in one (one round trip and commit per job). SQLite: UPDATE ...
# RETURNING; MySQL: a locking SELECT of the run joined to its task. Each claims from one
# queue along task_runs_claim (queue, priority DESC, scheduled_on, id); queues in turn.
PG_CLAIM_CTES = """
    next AS (
        SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = %s
        ORDER BY priority DESC, scheduled_on, id LIMIT 1 FOR UPDATE SKIP LOCKED),
    claimed AS (
        UPDATE task_runs AS r SET status = 'running', runner_id = %s, started_on = %s,
            updated_on = %s
        FROM next WHERE r.id = next.id RETURNING r.id, r.task_id, r.attempt),
    claimed_task AS (
        UPDATE task_queue AS t SET last_status = 'running', updated_on = %s FROM claimed
        WHERE t.id = claimed.task_id
        RETURNING claimed.id, claimed.task_id, claimed.attempt, t.handler, t.data,
            t.max_runtime, t.periodic_task_id)"""
PG_SUCCESS_CTES = """
    ended AS (
        UPDATE task_runs SET status = 'success', finished_on = %s, updated_on = %s,
            active_task_id = NULL, concurrency_slot = NULL, error_code = NULL, error_message = NULL,
            percent_completed = 100, results = %s
        WHERE id = %s AND status = 'running' AND runner_id = %s RETURNING task_id),
    ended_task AS (
        UPDATE task_queue AS t SET last_status = 'success', runs_failed = 0,
            next_run_on = NULL, finished_on = %s, active_key = NULL, updated_on = %s
        FROM ended WHERE t.id = ended.task_id RETURNING t.id)"""
PG_CLAIM = "WITH" + PG_CLAIM_CTES + " SELECT * FROM claimed_task"
PG_SUCCESS = "WITH" + PG_SUCCESS_CTES + " SELECT count(*) FROM ended_task"
# Every data-modifying CTE runs to completion whether or not the final SELECT reads it.
PG_SUCCESS_AND_CLAIM = ("WITH" + PG_SUCCESS_CTES + "," + PG_CLAIM_CTES + """
    SELECT (SELECT count(*) FROM ended_task), c.* FROM (VALUES (1)) AS one
    LEFT JOIN claimed_task AS c ON true""")
SQLITE_CLAIM = ("""
    UPDATE task_runs SET status = 'running', runner_id = ?, started_on = ?, updated_on = ?
    WHERE id = (SELECT id FROM task_runs WHERE status = 'scheduled' AND queue = ?
                ORDER BY priority DESC, scheduled_on, id LIMIT 1)
    RETURNING id, task_id, attempt""", """
    UPDATE task_queue SET last_status = 'running', updated_on = ? WHERE id = ?
    RETURNING handler, data, max_runtime, periodic_task_id""")
SUCCESS_STATEMENTS = ("""
    UPDATE task_runs SET status = 'success', finished_on = ?, updated_on = ?,
        active_task_id = NULL, concurrency_slot = NULL, error_code = NULL, error_message = NULL,
        percent_completed = 100, results = ?
    WHERE id = ? AND status = 'running' AND runner_id = ?""", """
    UPDATE task_queue SET last_status = 'success', runs_failed = 0, next_run_on = NULL,
        finished_on = ?, active_key = NULL, updated_on = ? WHERE id = ?""")
MYSQL_SUCCESS = tuple(s.replace("?", "%s") for s in SUCCESS_STATEMENTS)  # InnoDB keeps same values' index
# SQLite rewrites each index of a SET column even unchanged (a WAL page each): columns NULL for
# most runs are cleared apart when RETURNING shows a value (not IS NOT NULL: 3.40 gets it wrong).
SQLITE_SUCCESS = (
    SUCCESS_STATEMENTS[0].replace("concurrency_slot = NULL, ", "") + " RETURNING concurrency_slot",
    "UPDATE task_runs SET concurrency_slot = NULL WHERE id = ?",
    SUCCESS_STATEMENTS[1].replace(" next_run_on = NULL,", "").replace(" active_key = NULL,", "")
    + " RETURNING coalesce(next_run_on, active_key)",
    "UPDATE task_queue SET next_run_on = NULL, active_key = NULL WHERE id = ?")
# MySQL: the candidate and its task locked and read at once (InnoDB locks the joined task
# row too, which the claim updates anyway), then both marked.
MYSQL_CLAIM = """
    SELECT r.id, r.task_id, r.attempt, t.handler, t.data, t.max_runtime, t.periodic_task_id
    FROM task_runs AS r JOIN task_queue AS t ON t.id = r.task_id
    WHERE r.status = 'scheduled' AND r.queue = %s
    ORDER BY r.priority DESC, r.scheduled_on, r.id LIMIT 1
    FOR UPDATE SKIP LOCKED"""
MYSQL_START = (
    "UPDATE task_runs SET status = 'running', runner_id = %s, started_on = %s, updated_on = %s "
    "WHERE id = %s",
    "UPDATE task_queue SET last_status = 'running', updated_on = %s WHERE id = %s")
_OUTCOME_HOOKS = []


def on_outcome(hook):
    """Register ``hook(store, periodic_task_id, status, now, error_code)``, called inside the
    transaction that ends a run of a task submitted by a periodic task."""
    if hook not in _OUTCOME_HOOKS:
        _OUTCOME_HOOKS.append(hook)


def _outcome(store, periodic_task_id, status, now, error_code=None):
    for hook in _OUTCOME_HOOKS:
        hook(store, periodic_task_id, status, now, error_code)


def retry_delay(runs_failed, base, cap, rand=random.random):
    """Exponential backoff after `runs_failed` consecutive failures, capped, with jitter
    (half fixed, half random) so failed tasks don't all come back at the same moment."""
    # The exponent is capped: 2 ** 1025 no longer fits a float, and max_retries may be huge.
    delay = min(cap, base * 2 ** min(max(0, runs_failed - 1), 64))
    return delay / 2 + rand() * delay / 2


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

def create_missing_runs(store, now=None, batch=500):
    """Create the next run of every task whose next_run_on has come: due delayed tasks and
    failed tasks whose backoff has passed (given-up and final tasks have no next_run_on).
    Race closed: two processes creating runs at once — the candidate tasks are locked (SKIP
    LOCKED / SQLite's write lock) and the unique index on task_runs.active_task_id refuses a
    second live run whatever happens."""
    Task = store.Task
    now = now or utcnow()
    created = 0
    release_waiting(store, now)
    # A cheap read first: most passes find nothing and need no write lock.
    if not Task.select(Task.id).where(Task.next_run_on <= now).exists():
        return 0
    while True:
        def step():
            query = (Task.select(Task.id).where(Task.next_run_on <= now)
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
    """The next run of each task in `ids` (locked by the caller), inside its transaction."""
    Task, Run = store.Task, store.Run
    ids = create_keyed_runs(store, ids, now)      # leaves the tasks without a key
    if not ids:
        return
    live = Run.select(Run.id).where(Run.active_task_id == Task.id)
    source = (Task.select(Task.id, pw.Value(now), pw.Value(now), Task.run_count + 1,
                          Task.id, Task.priority, Task.scheduled_on,
                          pw.Value(SCHEDULED), pw.Value(0), Task.queue)
              .where(Task.id.in_(ids) & ~pw.fn.EXISTS(live)))
    Run.insert_from(source, [Run.task_id, Run.created_on, Run.updated_on, Run.attempt,
                             Run.active_task_id, Run.priority, Run.scheduled_on, Run.status,
                             Run.percent_completed, Run.queue]).execute()
    (Task.update(next_run_on=None, run_count=Task.run_count + 1, last_status=SCHEDULED,
                 updated_on=now).where(Task.id.in_(ids)).execute())


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


def claim(store, runner_id, queues=(DEFAULT_QUEUE,), now=None):
    """Start the next run for `runner_id` from the first of `queues` (names, in the order
    to try) that has one: highest priority first, FIFO within a priority within a queue
    (rule 2). Race closed: two runners taking the same run — PostgreSQL and MySQL lock the
    candidate FOR UPDATE SKIP LOCKED, so a concurrent claimer passes over it instead of
    waiting; SQLite takes the write lock up front (BEGIN IMMEDIATE), so the select and the
    update are one step. Returns a ClaimedRun or None."""
    now = now or utcnow()
    if store.backend == "postgresql":
        # One statement per queue tried, each its own transaction.
        return _claim_step(store, runner_id, queues, now)
    return store.write(lambda: _claim_step(store, runner_id, queues, now))


def _claim_step(store, runner_id, queues, now):
    """claim() inside the caller's write transaction: each queue in turn."""
    return next(filter(None, (_claim_from(store, runner_id, q, now) for q in queues)), None)


def _claim_from(store, runner_id, queue, now):
    sql = store.db.execute_sql
    if store.backend == "postgresql":
        row = sql(PG_CLAIM, (queue, runner_id, now, now, now)).fetchone()
        return None if row is None else ClaimedRun(*row, now)
    if store.is_sqlite:
        (claim_run, claim_task), stamp = SQLITE_CLAIM, now.isoformat(" ")   # bound as text once
        run = sql(claim_run, (runner_id, stamp, stamp, queue)).fetchone()
        if run is None:
            return None
        task = sql(claim_task, (stamp, run[1])).fetchone()
        return ClaimedRun(*run, *task, now)
    row = sql(MYSQL_CLAIM, (queue,)).fetchone()
    if row is None:
        return None
    sql(MYSQL_START[0], (runner_id, now, now, row[0]))
    sql(MYSQL_START[1], (now, row[1]))
    return ClaimedRun(*row, now)


def release_runs_of(store, runner_id, only=None, keep=None, now=None):
    """Give back, unstarted, the runs `runner_id` has ``running`` (just `only`, or all but
    `keep`): a runner told to stop between a claim and the start, or one that lost its
    connection while claiming and cannot know whether the claim committed (such a run would
    otherwise stay ``running`` until its run_timeout). Returns how many were given back."""
    Task, Run = store.Task, store.Run
    now = now or utcnow()

    def step():
        query = runs_of_runner_query(store, runner_id)
        if only is not None:
            query = query.where(Run.id == only)
        if keep is not None:
            query = query.where(Run.id != keep)
        released = 0
        for run in list(query):
            # Conditional like every end (rule 4): an overseer may have timed it out since.
            if Run.update(status=SCHEDULED, runner_id=None, started_on=None, updated_on=now
                          ).where((Run.id == run.id) & run_status_is(Run, RUNNING)
                                  & (Run.runner_id == runner_id)).execute():
                Task.update(last_status=SCHEDULED, updated_on=now).where(
                    Task.id == run.task_id).execute()
                released += 1
        return released
    return store.write_and_wake(step, lambda released: released)


def was_ended_by(store, run_id, runner_id, status):
    """Whether the run ended with `status` by `runner_id`'s own end (not a timeout set by
    someone else): after a lost connection, did the end commit?"""
    Run = store.Run
    return Run.select().where((Run.id == run_id) & (Run.runner_id == runner_id)
                              & (Run.status == status)).exists()


def taken_away_on(store, run_id, runner_id):
    """(ended_on, cancel_requested) of a run this runner executes: `ended_on` is None while
    the run is still ``running`` under this runner, else when it ended (timed out by someone:
    its finished_on, or now when it has none); `cancel_requested`: an operator asked the
    running run to stop."""
    Run = store.Run
    row = Run.select(Run.status, Run.runner_id, Run.finished_on, Run.cancel_requested_on
                     ).where(Run.id == run_id).first()
    if row is not None and row.status == RUNNING and row.runner_id == runner_id:
        return None, row.cancel_requested_on is not None
    return (row.finished_on if row is not None else None) or utcnow(), False


def report_progress(store, run_id, runner_id, percent=None, results=None, now=None):
    """Store progress and/or the results so far (JSON text) of a running run; False when the
    run is no longer this runner's (it was timed out)."""
    Run = store.Run
    values = {Run.updated_on: now or utcnow()}
    if percent is not None:
        values[Run.percent_completed] = percent
    if results is not None:
        values[Run.results] = results
    with store.host_turn():
        return Run.update(values).where((Run.id == run_id) & (Run.status == RUNNING)
                                        & (Run.runner_id == runner_id)).execute() > 0


# -- ending -------------------------------------------------------------------------------------

def end_run(store, run_id, task_id, status, runner_id=None, results=None, error_code=None,
            error_message=None, now=None, periodic_task_id=None, retry_at=None, traceback=None):
    """End a running run with `status` and aggregate its task.

    Rule 4: the update is conditional on the run still being ``running`` (and, for a runner
    finishing its own run, on its runner_id), so a runner that comes back late cannot
    overwrite a ``timeout`` set meanwhile. Returns False when it lost that race.
    ``requeued``: the task runs again at `retry_at` (None: at once), not counted as failed.
    Whoever waits for a task on this host (`TaskQueue.wait`) is woken after the commit.
    """
    now = now or utcnow()
    args = (run_id, task_id, status, runner_id, results, error_code, error_message, now,
            periodic_task_id)
    if _single_statement_end(store, status, runner_id, periodic_task_id):
        ended = end_in_transaction(store, *args)
    else:
        ended = store.write(lambda: end_in_transaction(store, *args, retry_at=retry_at,
                                                       traceback=traceback))
    if ended:
        store.wake_waiters()
    return ended


def end_run_and_claim(store, run_id, task_id, status, runner_id, results=None, error_code=None,
                      error_message=None, now=None, periodic_task_id=None, retry_at=None,
                      traceback=None, queues=(DEFAULT_QUEUE,)):
    """end_run() of a runner's own run and claim() of its next from `queues` in one
    transaction, so a busy runner pays one commit per job (one statement on PostgreSQL for
    a success and a run of the first queue). Same rules as the two calls; the claim happens
    even when the end lost its race. Returns (ended, ClaimedRun or None)."""
    now = now or utcnow()
    if _single_statement_end(store, status, runner_id, periodic_task_id) and queues:
        row = store.db.execute_sql(PG_SUCCESS_AND_CLAIM, (
            now, now, results, run_id, runner_id, now, now,
            queues[0], runner_id, now, now, now)).fetchone()
        claimed = None if row[1] is None else ClaimedRun(*row[1:], now)
        ended = row[0] > 0
        if claimed is None and len(queues) > 1:
            claimed = _claim_step(store, runner_id, queues[1:], now)
    else:
        ended, claimed = store.write(lambda: (
            end_in_transaction(store, run_id, task_id, status, runner_id, results, error_code,
                               error_message, now, periodic_task_id, retry_at, traceback),
            _claim_step(store, runner_id, queues, now)))
    if ended:
        store.wake_waiters()
    return ended, claimed


def _single_statement_end(store, status, runner_id, periodic_task_id):
    """A runner's success of a plain task on PostgreSQL: one statement, no transaction."""
    return (store.backend == "postgresql" and status == SUCCESS and runner_id is not None
            and periodic_task_id is None)


def end_in_transaction(store, run_id, task_id, status, runner_id, results, error_code,
                       error_message, now, periodic_task_id=None, retry_at=None, traceback=None):
    """end_run() inside the caller's write transaction. `retry_at`: when a requeued task
    runs again, or for a failure the earliest time of its retry (crash_grace)."""
    Run = store.Run
    if status == SUCCESS and runner_id is not None:
        ended = end_success(store, run_id, task_id, runner_id, results, now)
        if ended and periodic_task_id is not None:
            _outcome(store, periodic_task_id, status, now)
        return ended
    values = {Run.status: status, Run.finished_on: now, Run.updated_on: now,
              Run.active_task_id: None, Run.concurrency_slot: None, Run.error_code: error_code,
              Run.error_message: error_message}
    if status == SUCCESS:
        values[Run.percent_completed] = 100
    if results is not None:
        values[Run.results] = results
    if traceback is not None:
        values[Run.traceback] = bounded_traceback(traceback)
    condition = (Run.id == run_id) & (Run.status == RUNNING)
    if runner_id is not None:
        condition &= Run.runner_id == runner_id
    if not Run.update(values).where(condition).execute():
        return False
    if status in (REQUEUED,) + FAILED and Run.select(Run.id).where(
            (Run.id == run_id) & Run.cancel_requested_on.is_null(False)).exists():
        # An operator cancelled it while it ran, and its runner died, timed out or handed it
        # back before honouring that: the task ends cancelled all the same, not run again.
        status = CANCELLED
    if status == REQUEUED:
        _requeue(store, task_id, now, retry_at)
    else:
        _aggregate(store, task_id, status, error_code, error_message, now, periodic_task_id,
                   not_before=retry_at)
    return True


def end_success(store, run_id, task_id, runner_id, results, now):
    """Inside the caller's transaction: a runner's success of its run, as plain SQL with
    end_in_transaction's conditions (the hot path; batches.py ends many with it). Returns
    whether it ended the run; a periodic task's outcome is the caller's."""
    sql = store.db.execute_sql
    if store.backend == "postgresql":
        return sql(PG_SUCCESS, (now, now, results, run_id, runner_id, now, now)).fetchone()[0] > 0
    if store.is_sqlite:
        return _sqlite_success(sql, run_id, task_id, runner_id, results, now.isoformat(" "))
    ended = sql(MYSQL_SUCCESS[0], (now, now, results, run_id, runner_id)).rowcount > 0
    if ended:
        sql(MYSQL_SUCCESS[1], (now, now, task_id))
    return ended


def _sqlite_success(sql, run_id, task_id, runner_id, results, at):
    end_run, clear_slot, end_task, clear_keys = SQLITE_SUCCESS
    slot = sql(end_run, (at, at, results, run_id, runner_id)).fetchone()
    if slot is not None and slot[0] is not None:
        sql(clear_slot, (run_id,))
    if slot is not None and sql(end_task, (at, at, task_id)).fetchone() not in (None, (None,)):
        sql(clear_keys, (task_id,))
    return slot is not None


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


def _aggregate(store, task_id, status, error_code, error_message, now, periodic_task_id=None,
               not_before=None):
    """The task after a run ended: last_status, runs_failed (reset by a success), the last
    error, and when (if ever) its next run may be created. A success needs no read; the
    caller passes the periodic task id it knows from the claim."""
    Task, config = store.Task, store.config
    if status in (SUCCESS, CANCELLED):
        values = {Task.last_status: status, Task.next_run_on: None, Task.finished_on: now,
                  Task.active_key: None, Task.updated_on: now}
        if status == SUCCESS:
            values[Task.runs_failed] = 0
        Task.update(values).where(Task.id == task_id).execute()
        if periodic_task_id is not None:
            _outcome(store, periodic_task_id, status, now)
        return
    task = store.locked(Task.select(Task.runs_failed, Task.max_retries, Task.retry_backoff,
                                    Task.periodic_task_id).where(Task.id == task_id)).get()
    runs_failed = task.runs_failed + 1
    values = {Task.last_status: status, Task.runs_failed: runs_failed,
              Task.last_error_code: error_code, Task.last_error_message: error_message,
              Task.updated_on: now}
    if error_code == CRASHED:
        values[Task.crash_count] = Task.crash_count + 1
    if runs_failed >= task.max_retries:
        # Given up: final, with the reason kept in last_error_*.
        values.update({Task.next_run_on: None, Task.finished_on: now, Task.active_key: None})
    else:
        base = task.retry_backoff if task.retry_backoff is not None else config.task.retry_backoff
        delay = retry_delay(runs_failed, base, config.task.retry_backoff_max)
        values[Task.next_run_on] = max(now + timedelta(seconds=delay), not_before or now)
    Task.update(values).where(Task.id == task_id).execute()
    if task.periodic_task_id is not None:
        _outcome(store, task.periodic_task_id, status, now, error_code)


def timeout_overdue_runs(store, now=None, reachable_since=None):
    """Mark ``timeout`` every running run with no update for its task's run_timeout, or
    running longer than its max_runtime. Returns [(run_id, runner_id)] of the runs marked,
    so the caller can stop the processes executing them (rule 8). Progress that could not
    be written during an outage does not count: run_timeout is counted from
    Store.writable_since at the earliest."""
    now = now or utcnow()
    # Read in full before writing: on SQLite an open SELECT would make each end's write
    # transaction fail as soon as another process had committed meanwhile.
    running = list(running_runs_query(store).objects())
    since = None
    if any(run.updated_on + timedelta(seconds=run.run_timeout) < now for run in running):
        since = store.writable_since(reachable_since)     # asked only when it matters
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
        if end_run(store, run.id, run.task_id, TIMEOUT, error_code=code, error_message=message,
                   now=now):
            log.warning("run %d of task %d timed out: %s", run.id, run.task_id, message)
            ended.append((run.id, run.runner_id))
    return ended
