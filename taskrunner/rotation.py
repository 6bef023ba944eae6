"""Rotation (``taskrunner rotate``, ``run-event task-queue:OnRotate``): delete ended tasks
with their runs once they are old enough, and finished runner rows, in batches so a large
backlog never holds one long transaction."""
import logging
from datetime import timedelta

from .models import CANCELLED, FAILED, RUNNING, SUCCESS

log = logging.getLogger("taskrunner.rotation")


def _delete_tasks(store, condition):
    Task, Run = store.Task, store.Run
    batch, deleted = store.config.rotation.batch_size, 0
    while True:
        def step():
            ids = [t.id for t in Task.select(Task.id).where(condition).order_by(Task.id).limit(batch)]
            if ids:
                Run.delete().where(Run.task_id.in_(ids)).execute()
                Task.delete().where(Task.id.in_(ids)).execute()
            return len(ids)
        count = store.write(step)
        deleted += count
        if count < batch:
            return deleted


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
    while True:
        ids = [r.id for r in Runner.select(Runner.id).where(
            (Runner.status != RUNNING)
            & (Runner.finished_on < now - timedelta(seconds=settings.keep_runners))
        ).limit(settings.batch_size)]
        if not ids:
            break
        runners += Runner.delete().where(Runner.id.in_(ids)).execute()
    if success or failed or runners:
        log.info("rotation deleted %d successful and %d failed tasks, %d runner rows",
                 success, failed, runners)
    return {"success": success, "failed": failed, "runners": runners}
