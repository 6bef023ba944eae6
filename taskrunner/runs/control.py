"""The operator's verbs on tasks: retry a failed or given-up task, re-run an ended durable
task from one of its steps, cancel one that has not ended (a running one cooperatively).
Each is one write transaction of the store that says which race it closes.
"""
import peewee as pw

from . import graph
from ..errors import InputError, StateError, TaskNotFound, check_text
from .lifecycle import cancel_in_transaction, create_missing_runs, start_released
from ..store.models import (CANCELLED, FAILED, LARGEST_ID, RUNNING, SUCCESS, run_status_is,
                            state_word, utcnow)

REASON_LIMIT = 1000     # characters of a re-run's reason


def _locked_task(store, task_id):
    Task = store.Task
    # An id no id column can hold names no task (the driver would raise OverflowError).
    task = store.locked(Task.select().where(Task.id == task_id)).first() \
        if 0 < task_id <= LARGEST_ID else None
    if task is None:
        raise TaskNotFound("no task with id %s" % task_id)
    return task


def retry(store, task_id, now=None, dependents=True):
    """Re-arm a failed or given-up task: runs_failed back to 0 and a run now. With
    `dependents`, the tasks its giving up cancelled (``ParentFailed``, and theirs in turn)
    wait for it again (graph.rearm). Returns how many dependents were re-armed.
    Race closed: retry against a runner finishing the task's run — the live-run unique index
    and the conditional state check inside one transaction."""
    now = now or utcnow()
    # next_run_on on the database's clock (create_missing_runs compares it with it).
    rearmed = store.write(lambda: _rearm(store, task_id, store.database_time(now),
                                         dependents))
    create_missing_runs(store, now)
    return rearmed


def retry_many(store, task_ids, now=None, batch=200, progress=None):
    """`retry` of each task of `task_ids`, `batch` of them per transaction, each batch
    followed by one pass creating their runs: re-armed one by one, a bulk retry paid a
    transaction and a fleet-wide pass per task (about 74 tasks/s). `progress(done)` after
    each batch. Returns {task id: None if re-armed, else the StateError or TaskNotFound
    that refused it}; a refusal leaves the others re-armed."""
    now = now or utcnow()
    at = store.database_time(now)
    task_ids = list(task_ids)
    outcome = {}

    def step(chunk):
        done = {}
        for task_id in chunk:
            try:
                _rearm(store, task_id, at, True)
                done[task_id] = None
            except (StateError, TaskNotFound) as exc:
                done[task_id] = exc
        return done
    for start in range(0, len(task_ids), batch):
        chunk = task_ids[start:start + batch]
        outcome.update(store.write(lambda: step(chunk)))
        create_missing_runs(store, now)
        if progress is not None:
            progress(len(outcome))
    return outcome


def _word(store, task):
    """The task's status word for a message (models.state_word): a claim writes the run
    alone, so a task whose run is running says so on its run."""
    Run = store.Run
    running = Run.select().where((Run.active_task_id == task.id)
                                 & run_status_is(Run, RUNNING)).exists()
    return state_word(task.last_status, task.finished_on, running)


def _rearm(store, task_id, at, dependents=False):
    """Inside the caller's write transaction: the task re-armed with a run due `at` (the
    database's clock), or StateError; with `dependents`, those its failure cancelled too.
    Returns how many dependents were re-armed."""
    Task, Run = store.Task, store.Run
    task = _locked_task(store, task_id)
    if task.last_status not in FAILED:
        raise StateError("task %d is %s; only a failed or given-up task can be retried"
                         % (task.id, _word(store, task)))
    if Run.select().where(Run.active_task_id == task.id).exists():
        raise StateError("task %d already has a run scheduled or running" % task.id)
    try:
        with store.db.atomic():
            Task.update(runs_failed=0, runs_crashed=0, next_run_on=at, finished_on=None,
                        active_key=task.unique_key, updated_on=at
                        ).where(Task.id == task.id).execute()
    except pw.IntegrityError:
        raise StateError("task %d cannot be retried: another live task holds its "
                         "unique_key %r" % (task.id, task.unique_key)) from None
    if not (dependents and task.dependents):
        return 0
    count, released = graph.rearm(store, task.id, at)
    start_released(store, released, at)
    return count


def rerun_from(store, task_id, step, reason=None, requested_by=None, now=None):
    """Run an ended durable task again from its step `step` (DBOS's fork): the steps
    recorded before it keep their results, that step and every one recorded after it are
    dropped and run again, its checkpoint is cleared (it may hold progress past the step),
    and the task gets a run now — a new run of the same task, its failures counted from
    zero. A task that gave up has the dependents its giving up cancelled wait for it again,
    as `retry` does. Recorded in ``task_reruns`` with `requested_by`, `reason` and the run.
    Returns the id of that run.
    StateError unless the task succeeded or gave up and has no live run; InputError for a
    step it never recorded.
    Race closed: a re-run against another re-run, a retry or a runner — the task row is
    locked, the state checked and the steps dropped in one transaction, and the live-run
    unique index refuses a second run whoever creates it."""
    check_text("the step", step, 255, empty=False)
    check_text("the reason", reason, REASON_LIMIT)
    check_text("requested_by", requested_by)
    now = now or utcnow()
    at = store.database_time(now)
    rerun_id = store.write(lambda: _rerun(store, task_id, step, reason, requested_by, at))
    create_missing_runs(store, now)
    Run, Rerun = store.Run, store.Rerun
    run = Run.select(Run.id).where(Run.task_id == task_id).order_by(Run.id.desc()).first()
    store.write(lambda: Rerun.update(run_id=run.id).where(
        (Rerun.id == rerun_id) & Rerun.run_id.is_null()).execute())
    return run.id


def _rerun(store, task_id, step, reason, requested_by, at):
    Task, Run, Step, Rerun = store.Task, store.Run, store.Step, store.Rerun
    task = _locked_task(store, task_id)
    ended = task.finished_on is not None and (task.last_status == SUCCESS
                                              or task.last_status in FAILED)
    if not ended:
        raise StateError("task %d is %s; only a task that succeeded or gave up can be re-run "
                         "from a step" % (task.id, _word(store, task)))
    if Run.select().where(Run.active_task_id == task.id).exists():
        raise StateError("task %d already has a run scheduled or running" % task.id)
    mark = Step.select(Step.id).where((Step.task_id == task.id) & (Step.name == step)).first()
    if mark is None:
        names = [name for (name,) in Step.select(Step.name).where(
            Step.task_id == task.id).order_by(Step.id).limit(6).tuples()]
        recorded = ("its steps: " + ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                    if names else "it recorded none")
        if task.last_status in FAILED:
            # The step a task gave up in is never recorded: a retry runs it again.
            recorded += "; a step that failed is never recorded: retry runs it again keeping " \
                        "every step recorded"
        raise InputError("task %d has no step %r (%s)" % (task.id, step, recorded))
    dropped = Step.delete().where((Step.task_id == task.id) & (Step.id >= mark.id)).execute()
    try:
        with store.db.atomic():
            Task.update(runs_failed=0, runs_crashed=0, next_run_on=at, finished_on=None,
                        active_key=task.unique_key, checkpoint=None, checkpoint_on=None,
                        waiting_for=None, updated_on=at).where(Task.id == task.id).execute()
    except pw.IntegrityError:
        raise StateError("task %d cannot be re-run: another live task holds its unique_key "
                         "%r" % (task.id, task.unique_key)) from None
    rerun_id = Rerun.insert(task_id=task.id, from_step=step, steps_dropped=dropped,
                            requested_by=requested_by, reason=reason,
                            requested_on=at).execute()
    if task.last_status in FAILED and task.dependents:
        _count, released = graph.rearm(store, task.id, at)
        start_released(store, released, at)
    return rerun_id


def cancel(store, task_id, now=None):
    """Cancel a task that has not ended, through the run lifecycle like every end of a run
    (lifecycle.cancel_in_transaction): a scheduled run becomes ``cancelled`` with its task;
    a running run is asked to stop (cooperatively: its runner makes ``should_stop()`` true,
    interrupts the handler after kill_grace, and ends the run and the task ``cancelled``).
    Returns the id of the running run asked to stop, or None when the task is cancelled now.
    Race closed: two cancels, or a cancel and a retry, of one task — the task row is locked
    first; the run's own races are the lifecycle's."""
    Run = store.Run

    def step():
        task = _locked_task(store, task_id)
        if task.last_status == CANCELLED or task.finished_on is not None:
            raise StateError("task %d has already ended (%s)" % (task.id, task.last_status))
        live = Run.select(Run.id).where(Run.active_task_id == task.id).first()
        return cancel_in_transaction(store, task.id, live.id if live else None, now)
    running = store.write(step)
    store.wake_waiters()
    return running


def cancel_workflow(store, task_ids, now=None, batch=200):
    """Cancel every task of `task_ids` (a workflow's unfinished tasks) that has not ended, as
    `cancel` does, `batch` per transaction; a task that ended meanwhile is left alone.
    Returns (how many were cancelled now, how many running ones were asked to stop)."""
    Run = store.Run
    cancelled = stopping = 0

    def step(chunk):
        done = asked = 0
        for task_id in chunk:
            task = _locked_task(store, task_id)
            if task.last_status == CANCELLED or task.finished_on is not None:
                continue
            live = Run.select(Run.id).where(Run.active_task_id == task.id).first()
            if cancel_in_transaction(store, task.id, live.id if live else None, now) is None:
                done += 1
            else:
                asked += 1
        return done, asked
    task_ids = list(task_ids)
    for start in range(0, len(task_ids), batch):
        done, asked = store.write(lambda: step(task_ids[start:start + batch]))
        cancelled, stopping = cancelled + done, stopping + asked
    store.wake_waiters()
    return cancelled, stopping
