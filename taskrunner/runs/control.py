"""The operator's verbs on tasks: retry a failed or given-up task, cancel one that has not
ended (a running one cooperatively). Each is one write transaction of the store that says
which race it closes.
"""
import peewee as pw

from ..errors import StateError, TaskNotFound
from .lifecycle import create_missing_runs
from ..store.models import CANCELLED, FAILED, RUNNING, SCHEDULED, utcnow


def _locked_task(store, task_id):
    Task = store.Task
    task = store.locked(Task.select().where(Task.id == task_id)).first()
    if task is None:
        raise TaskNotFound("no task with id %s" % task_id)
    return task


def retry(store, task_id, now=None):
    """Re-arm a failed or given-up task: runs_failed back to 0 and a run now.
    Race closed: retry against a runner finishing the task's run — the live-run unique index
    and the conditional state check inside one transaction."""
    now = now or utcnow()
    store.write(lambda: _rearm(store, task_id, now))
    create_missing_runs(store, now)


def retry_many(store, task_ids, now=None, batch=200, progress=None):
    """`retry` of each task of `task_ids`, `batch` of them per transaction, each batch
    followed by one pass creating their runs: re-armed one by one, a bulk retry paid a
    transaction and a fleet-wide pass per task (about 74 tasks/s). `progress(done)` after
    each batch. Returns {task id: None if re-armed, else the StateError or TaskNotFound
    that refused it}; a refusal leaves the others re-armed."""
    now = now or utcnow()
    task_ids = list(task_ids)
    outcome = {}

    def step(chunk):
        done = {}
        for task_id in chunk:
            try:
                _rearm(store, task_id, now)
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


def _rearm(store, task_id, now):
    """Inside the caller's write transaction: the task re-armed, or StateError."""
    Task, Run = store.Task, store.Run
    task = _locked_task(store, task_id)
    if task.last_status not in FAILED:
        raise StateError("task %d is %s; only a failed or given-up task can be retried"
                         % (task.id, task.last_status))
    if Run.select().where(Run.active_task_id == task.id).exists():
        raise StateError("task %d already has a run scheduled or running" % task.id)
    try:
        with store.db.atomic():
            Task.update(runs_failed=0, next_run_on=now, finished_on=None,
                        active_key=task.unique_key, updated_on=now
                        ).where(Task.id == task.id).execute()
    except pw.IntegrityError:
        raise StateError("task %d cannot be retried: another live task holds its "
                         "unique_key %r" % (task.id, task.unique_key)) from None


def cancel(store, task_id, now=None):
    """Cancel a task that has not ended. A scheduled run becomes ``cancelled`` with its task;
    a running run is asked to stop (cooperatively: its runner makes ``should_stop()`` true,
    interrupts the handler after kill_grace, and ends the run and the task ``cancelled``).
    Returns the id of the running run asked to stop, or None when the task is cancelled now.
    Race closed: cancel against a runner claiming or ending the run — the run is cancelled
    only WHERE status='scheduled', and asked to stop only WHERE status='running', in the
    same transaction as the task update."""
    Task, Run = store.Task, store.Run
    now = now or utcnow()

    def step():
        task = _locked_task(store, task_id)
        if task.last_status == CANCELLED or task.finished_on is not None:
            raise StateError("task %d has already ended (%s)" % (task.id, task.last_status))
        live = Run.select(Run.id, Run.status).where(Run.active_task_id == task.id).first()
        if live is not None:
            cancelled = Run.update(status=CANCELLED, finished_on=now, updated_on=now,
                                   active_task_id=None, concurrency_slot=None).where(
                (Run.id == live.id) & (Run.status == SCHEDULED)).execute()
            if not cancelled:
                if not Run.update(cancel_requested_on=now).where(
                        (Run.id == live.id) & (Run.status == RUNNING)).execute():
                    raise StateError("task %d: its run %d changed state meanwhile; try again"
                                     % (task.id, live.id))
                return live.id
        Task.update(last_status=CANCELLED, next_run_on=None, finished_on=now, active_key=None,
                    waiting_key=None, updated_on=now).where(Task.id == task.id).execute()
        return None
    running = store.write(step)
    store.wake_waiters()
    return running
