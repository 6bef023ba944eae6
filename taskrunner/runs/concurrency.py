"""Concurrency keys: at most ``concurrency_limit`` live runs of the tasks that share a
``concurrency_key``, on every host at once (Solid Queue's limits_concurrency).

A database rule, like rule 1: a run of such a task is created holding a slot 1..limit of its
key (``task_runs.concurrency_slot``, cleared when the run ends, wherever it ends), under a
unique index on (concurrency_key, concurrency_slot). A task that finds no free slot waits
(``task_queue.waiting_key``) and is made due again by `release_waiting`, which every pass of
the queue runs (the overseer's check, an idle standalone runner), once its key has a free
slot. A slot is held from the run's creation, so ``scheduled`` runs count too.
"""
import peewee as pw

from ..store.models import SCHEDULED


def has_waiting(store):
    """Whether any task waits for a slot of its concurrency key."""
    Task = store.Task
    return Task.select(Task.id).where(Task.waiting_key.is_null(False)).exists()


def release_waiting(store, now, queues=None):
    """Tasks waiting for a slot of their concurrency key become due again when their key
    has a free slot; creating their run takes the slot (or they wait again). `queues`: the
    tasks of these queues only."""
    Task, Run = store.Task, store.Run
    if not has_waiting(store):
        return
    taken = (Run.select(pw.fn.COUNT(Run.id)).where(
        (Run.concurrency_key == Task.waiting_key) & Run.concurrency_slot.is_null(False)))
    waiting = Task.waiting_key.is_null(False) & (taken < Task.concurrency_limit)
    if queues is not None:
        waiting &= Task.queue.in_(list(queues))
    ids = [t.id for t in Task.select(Task.id).where(waiting)]
    if ids:
        store.write(lambda: Task.update(waiting_key=None, next_run_on=now).where(
            Task.id.in_(ids) & Task.waiting_key.is_null(False)).execute())


def create_keyed_run(store, task_id, now):
    """Inside the transaction of lifecycle's run creation (the task locked): the next run of a task with a concurrency key, with
    a free slot of its key; without one the task waits (waiting_key). Race closed: two
    processes creating runs of one key at once — the unique index on (concurrency_key,
    concurrency_slot) refuses a slot taken twice, and this one tries the next."""
    Task, Run = store.Task, store.Run
    task = Task.select(Task.id, Task.concurrency_key, Task.concurrency_limit, Task.run_count,
                       Task.priority, Task.scheduled_on, Task.queue, Task.rate_key,
                       Task.tenant).where(
        Task.id == task_id).get()
    if Run.select(Run.id).where(Run.active_task_id == task_id).exists():
        return
    taken = {r.concurrency_slot for r in Run.select(Run.concurrency_slot).where(
        (Run.concurrency_key == task.concurrency_key) & Run.concurrency_slot.is_null(False))}
    for slot in range(1, task.concurrency_limit + 1):
        if slot in taken:
            continue
        try:
            with store.db.atomic():
                Run.insert(task_id=task_id, created_on=now, updated_on=now,
                           attempt=task.run_count + 1, active_task_id=task_id,
                           priority=task.priority, scheduled_on=task.scheduled_on,
                           status=SCHEDULED, percent_completed=0, queue=task.queue,
                           concurrency_key=task.concurrency_key, concurrency_slot=slot,
                           rate_key=task.rate_key, tenant=task.tenant).execute()
        except pw.IntegrityError:
            continue          # taken a moment ago by another process
        Task.update(next_run_on=None, run_count=Task.run_count + 1, last_status=SCHEDULED,
                    updated_on=now).where(Task.id == task_id).execute()
        return
    Task.update(next_run_on=None, waiting_key=task.concurrency_key, updated_on=now).where(
        Task.id == task_id).execute()


def create_keyed_runs(store, ids, now):
    """Inside lifecycle's run creation: the runs of the tasks in `ids` that have a
    concurrency key (create_keyed_run); returns the other ids, for the caller to create."""
    Task = store.Task
    keyed = [t.id for t in Task.select(Task.id).where(
        Task.id.in_(ids) & Task.concurrency_key.is_null(False)).order_by(Task.id)]
    for task_id in keyed:
        create_keyed_run(store, task_id, now)
    return [i for i in ids if i not in set(keyed)]
