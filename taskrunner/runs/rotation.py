"""Rotation (``taskrunner rotate``, ``run-event task-queue:OnRotate``): delete ended tasks
with their runs (and steps and events) once they are old enough, and finished runner rows, in batches so a large
backlog never holds one long transaction; and an operator's delete of ended tasks."""
import logging
from datetime import timedelta

from peewee import SQL, fn

from . import durable
from ..errors import StateError, TaskNotFound
from ..store.models import CANCELLED, FAILED, RUNNING, SUCCESS

log = logging.getLogger("taskrunner.rotation")


def _forget(store, gone, workflows):
    """Inside the caller's transaction, after the tasks `gone` were deleted: their steps and
    events; their edges whose other end is gone too (an edge to a task still kept stays with
    it, read by its graph); the workflows among `workflows` that have no task left. Each
    DELETE walks an index: the edge's (task_id, parent_id) and (parent_id, task_id), the
    tasks' workflow_id."""
    if not gone:
        return
    gone = list(gone)
    Task, Dependency, Workflow = store.Task, store.Dependency, store.Workflow
    durable.forget_tasks(store, gone)
    for end, other in ((Dependency.task_id, Dependency.parent_id),
                       (Dependency.parent_id, Dependency.task_id)):
        kept = Task.select(SQL("1")).where(Task.id == other)
        Dependency.delete().where(end.in_(gone) & ~fn.EXISTS(kept)).execute()
    workflows = [w for w in set(workflows) if w is not None]
    if workflows:
        left = {w for (w,) in Task.select(Task.workflow_id).where(
            Task.workflow_id.in_(workflows)).distinct().tuples()}
        empty = [w for w in workflows if w not in left]
        if empty:
            Workflow.delete().where(Workflow.id.in_(empty)).execute()


def _delete_tasks(store, condition):
    """Delete the tasks matching `condition`, a batch per transaction. Race closed: an
    operator's ``retry`` committed between the SELECT and the DELETE — the DELETE repeats the
    condition (re-read under the row lock it waits for), so a task live again survives, and
    runs go only with a task that went."""
    Task, Run = store.Task, store.Run
    batch, deleted = store.config.rotation.batch_size, 0
    while True:
        def step():
            rows = list(Task.select(Task.id, Task.workflow_id).where(condition)
                        .order_by(Task.id).limit(batch).tuples())
            if not rows:
                return 0, 0
            ids = [i for i, _ in rows]
            count = Task.delete().where(Task.id.in_(ids) & condition).execute()
            Run.delete().where(Run.task_id.in_(ids) & Run.task_id.not_in(
                Task.select(Task.id).where(Task.id.in_(ids)))).execute()
            if count:
                _forget(store, set(ids) - {t.id for t in Task.select(Task.id).where(
                    Task.id.in_(ids))}, [w for _, w in rows])
            return len(ids), count
        selected, count = store.write(step)
        deleted += count
        if selected < batch:
            return deleted


def delete_finished(store, task_ids, batch=200, progress=None):
    """An operator's delete of the tasks `task_ids` with their runs, `batch` per
    transaction; only ended tasks (success, given up, cancelled) go. `progress(done)` after
    each batch. Returns {task id: None if deleted, else the TaskNotFound or StateError
    saying why not}. Race closed: a retry committed meanwhile — the DELETE repeats
    "finished_on IS NOT NULL" under the row lock, so a task live again stays."""
    Task, Run = store.Task, store.Run
    task_ids = list(task_ids)
    outcome = {}

    def step(chunk):
        ended = Task.id.in_(chunk) & Task.finished_on.is_null(False)
        rows = list(Task.select(Task.id, Task.last_status, Task.workflow_id).where(
            Task.id.in_(chunk)).tuples())
        found = {i: status for i, status, _ in rows}
        Task.delete().where(ended).execute()
        gone = set(chunk) - {row.id for row in Task.select(Task.id).where(Task.id.in_(chunk))}
        if gone:
            Run.delete().where(Run.task_id.in_(list(gone))).execute()
            _forget(store, gone, [w for i, _, w in rows if i in gone])
        return {i: None if i in gone and i in found else
                TaskNotFound("no task with id %d" % i) if i not in found else
                StateError("task %d has not ended (%s); cancel it first" % (i, found[i]))
                for i in chunk}
    for start in range(0, len(task_ids), batch):
        chunk = task_ids[start:start + batch]
        outcome.update(store.write(lambda: step(chunk)))
        if progress is not None:
            progress(len(outcome))
    return outcome


def rotate(store, now):
    """Delete successful tasks ended before now - keep_success; failed, given-up and
    cancelled ones ended before now - keep_failed; runner rows finished before
    now - keep_runners. Only ended tasks have finished_on, so nothing live is touched."""
    Task, Runner = store.Task, store.Runner
    settings = store.config.rotation
    success = _delete_tasks(store, (Task.last_status == SUCCESS) & (
        Task.finished_on < now - timedelta(seconds=settings.keep_success)))
    failed = _delete_tasks(store, Task.last_status.in_(FAILED + (CANCELLED,)) & (
        Task.finished_on < now - timedelta(seconds=settings.keep_failed)))
    runners = 0
    ended = (Runner.status != RUNNING) & (
        Runner.finished_on < now - timedelta(seconds=settings.keep_runners))
    while True:
        ids = [r.id for r in Runner.select(Runner.id).where(ended).limit(settings.batch_size)]
        if not ids:
            break
        runners += Runner.delete().where(Runner.id.in_(ids) & ended).execute()
    if success or failed or runners:
        log.info("rotation deleted %d successful and %d failed tasks, %d runner rows",
                 success, failed, runners)
    return {"success": success, "failed": failed, "runners": runners}
