"""Named queues: which queues a runner claims from, in which order, and pausing a queue.

Every task belongs to a queue (``default`` unless named). A runner serves a set of queues;
one serving ``default`` also serves every queue that has no ``[queues.NAME]`` table in the
config, so a task in a queue nobody configured is still run. A queue's ``limit`` (runners
serving it at once on a host) is kept by the runner rows (liveness.register).

Pausing is stored in ``task_queues``: runners on every host re-read it every
``[overseer] check_interval`` and stop claiming from a paused queue; runs in flight finish.
"""
import peewee as pw

from ..config import check_queue_name
from ..store.models import DEFAULT_QUEUE, SCHEDULED, run_status_is, utcnow


def queue_rows_query(store, with_work=False):
    """(name, paused) of every queue; with `with_work` also whether a run waits in it, read
    from the claim index (queue leads it), never the run history."""
    Queue, Run = store.Queue, store.Run
    waiting = Run.select(Run.id).where(run_status_is(Run, SCHEDULED) & (Run.queue == Queue.name))
    return Queue.select(Queue.name, Queue.paused, *([pw.fn.EXISTS(waiting)] if with_work else []))


def claim_order(store, serving=None, with_work=False):
    """The queues to claim from now, in order: those in `serving` (None: every queue), plus,
    when it has ``default``, every queue not in the config; paused queues left out. Higher
    ``[queues.NAME] priority`` first, then as listed. With `with_work`, (that list, whether
    a run waits in one of them): the one read an idle runner polls, from the claim index."""
    configured = store.config.queues
    found = {row[0]: row[1:] for row in queue_rows_query(store, with_work).tuples()}
    rows = {name: paused for name, (paused, *_) in found.items()}
    if serving is None:
        names = sorted(rows)
    else:
        names = list(serving)
        if DEFAULT_QUEUE in serving:
            names += sorted(n for n in rows if n not in configured and n not in serving)
    names = [n for n in names if not rows.get(n, False)]
    order = sorted(names, key=lambda n: -getattr(configured.get(n), "priority", 0))
    if not with_work:
        return order
    return order, any(found[n][1] for n in order if n in found)


def set_paused(store, name, paused, now=None):
    """Pause or resume the queue `name` on every host (a queue not used yet is recorded, so
    it can be paused before its first task). Returns whether that changed anything."""
    Queue = store.Queue
    check_queue_name(name)
    now = now or utcnow()

    def step():
        Queue.insert(name=name, paused=False, updated_on=now).on_conflict_ignore().execute()
        return Queue.update(paused=paused, paused_on=now if paused else None, updated_on=now
                            ).where((Queue.name == name) & (Queue.paused != paused)).execute() > 0
    # Resuming makes runs claimable again: idle runners of this host look at once.
    return store.write_and_wake(step, lambda changed: changed and not paused, name)


def paused_queues(store):
    """Names of the paused queues."""
    Queue = store.Queue
    return [q.name for q in Queue.select(Queue.name).where(Queue.paused == True)  # noqa: E712
            .order_by(Queue.name)]
