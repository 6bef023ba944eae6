"""Named queues: which queues a runner claims from, in which order, and pausing a queue.

Every task belongs to a queue (``default`` unless named). A runner serves a set of queues;
one serving ``default`` also serves every queue that has no ``[queues.NAME]`` table in the
config, so a task in a queue nobody configured is still run. A queue's ``limit`` (runners
serving it at once on a host) is kept by the runner rows (liveness.register).

Pausing is stored in ``task_queues``: runners on every host re-read it every
``[overseer] check_interval`` and stop claiming from a paused queue; runs in flight finish.
So is a per-host limit set at run time (``queue limit``, `set_host_limit`), which replaces the
config's: every claim checks the runner's slot against it (SLOT_WITHIN_LIMIT in
runs/statements/shared.py), registrations take their slot under it, and overseers size their
runners by it (`host_limits`).
"""
import weakref

import peewee as pw

from ..config import check_queue_name
from ..errors import InputError
from ..store.models import DEFAULT_QUEUE, SCHEDULED, run_status_is, utcnow


def queue_rows_query(store, with_work=False, also=()):
    """(name, paused, host_limit) of every queue; with `with_work` also whether a run waits
    in it, read from the claim index (queue leads it), never the run history; then the
    columns made by `also` (functions of the store returning an expression, uncorrelated),
    read in the same statement."""
    Queue, Run = store.Queue, store.Run
    waiting = Run.select(Run.id).where(run_status_is(Run, SCHEDULED) & (Run.queue == Queue.name))
    return Queue.select(Queue.name, Queue.paused, Queue.host_limit,
                        *([pw.fn.EXISTS(waiting)] if with_work else []),
                        *(column(store) for column in also))


# store -> {(with_work, also): (sql, params)}: a store's look is one statement whose text and
# parameters never change; building it with peewee costs twice what running it does, and a
# busy runner runs it every check_interval.
_statements = weakref.WeakKeyDictionary()


def queue_rows(store, with_work=False, also=()):
    """The rows of `queue_rows_query`, its statement built once per store."""
    built = _statements.setdefault(store, {})
    key = (with_work, tuple(also))
    if key not in built:
        built[key] = queue_rows_query(store, with_work, also).sql()
    return store.db.execute_sql(*built[key]).fetchall()


def claim_order(store, serving=None, with_work=False, also=(), slots=None):
    """The queues to claim from now, in order: those in `serving` (None: every queue), plus,
    when it has ``default``, every queue not in the config; paused queues left out, and those
    of `slots` ({queue: the runner's slot of it}) whose limit in force the slot is above.
    Higher ``[queues.NAME] priority`` first, then as listed. With `with_work`, (that list,
    whether a run waits in one of them): the one read an idle runner polls, from the claim
    index. The expressions made by `also` (functions of the store; uncorrelated: one value
    for every row) are read in that same statement and returned third: their values, or None
    when there is no queue at all."""
    configured = store.config.queues
    found = {row[0]: row[1:] for row in queue_rows(store, with_work, also)}
    rows = {name: paused for name, (paused, *_) in found.items()}
    if serving is None:
        names = sorted(rows)
    else:
        names = list(serving)
        if DEFAULT_QUEUE in serving:
            names += sorted(n for n in rows if n not in configured and n not in serving)
    names = [n for n in names if not rows.get(n, False)]
    for name, slot in (slots or {}).items():
        if name in names and slot > limit_in_force(
                configured[name], found[name][1] if name in found else None):
            names.remove(name)
    order = sorted(names, key=lambda n: -getattr(configured.get(n), "priority", 0))
    if not with_work:
        return order
    work = any(found[n][2] for n in order if n in found)
    if not also:
        return order, work
    return order, work, next(iter(found.values()))[3:] if found else None


def limit_in_force(configured, stored):
    """A queue's per-host limit: the one stored on its row (``queue limit``), else its
    ``[queues.NAME] limit`` (`configured`: that table; None: no table, no limit)."""
    if stored is not None:
        return stored
    return configured.limit if configured is not None else None


def host_limits(store, names=None):
    """{queue: its stored per-host limit} of the queues (of `names`) that have one."""
    Queue = store.Queue
    query = Queue.select(Queue.name, Queue.host_limit).where(Queue.host_limit.is_null(False))
    if names is not None:
        query = query.where(Queue.name.in_(list(names)))
    return dict(query.tuples())


def set_host_limit(store, name, limit, now=None):
    """Store the per-host limit of the queue `name` (None: back to the config's ``[queues.NAME]
    limit``) on its row, for every host: runners take their slot of the queue under it (a
    higher one lets more register, and overseers start them within a check interval), and
    each claim checks its runner's slot against it (SLOT_WITHIN_LIMIT in
    runs/statements/shared.py): from the moment this commits, a slot above a lowered limit
    claims nothing more; its run in flight finishes. Refused (InputError, nothing stored): a
    limit that is not a whole number >= 1, a queue with no ``[queues.NAME]`` table in this
    config (its runs go to the runners of ``default``, which no per-queue limit counts).
    Returns (the limit in force now, whether that changed anything)."""
    Queue = store.Queue
    check_queue_name(name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise InputError("a queue's limit must be a whole number >= 1, not %r" % (limit,))
    configured = store.config.queues.get(name)
    if configured is None:
        raise InputError("queue %r has no [queues.%s] table in %s: its runs go to the runners "
                         "of the default queue, which no per-queue limit counts"
                         % (name, name, store.config.source))
    now = now or utcnow()

    def step():
        Queue.insert(name=name, paused=False, updated_on=now).on_conflict_ignore().execute()
        if store.locked(Queue.select(Queue.host_limit).where(Queue.name == name)).scalar() \
                == limit:
            return False
        Queue.update(host_limit=limit, updated_on=now).where(Queue.name == name).execute()
        return True
    # A higher limit: idle runners of this host look at once (one of them may now claim).
    changed = store.write_and_wake(step, lambda changed: changed, name)
    return limit_in_force(configured, limit), changed


def set_paused(store, name, paused, now=None, create=False):
    """Pause or resume the queue `name` on every host. A queue nobody used or configured is
    refused (InputError: a typo would otherwise become a queue of its own), unless `create`
    records it on purpose, so it can be paused before its first task. Returns whether that
    changed anything."""
    Queue = store.Queue
    check_queue_name(name)
    now = now or utcnow()

    def step():
        if create or name in store.config.queues or name == DEFAULT_QUEUE:
            Queue.insert(name=name, paused=False, updated_on=now).on_conflict_ignore().execute()
        elif not Queue.select().where(Queue.name == name).exists():
            raise InputError("no queue named %r (pause --create records a queue before its "
                             "first task)" % name)
        return Queue.update(paused=paused, paused_on=now if paused else None, updated_on=now
                            ).where((Queue.name == name) & (Queue.paused != paused)).execute() > 0
    # Resuming makes runs claimable again: idle runners of this host look at once.
    return store.write_and_wake(step, lambda changed: changed and not paused, name)


def remove_queue(store, name):
    """Forget the queue `name` (a typo, a queue no longer used): refused while any task is
    in it or the config names it. A process that added tasks to it before remembers it was
    recorded (enqueue.record_queues): a queue must be removed only once nothing adds to it."""
    Queue, Task = store.Queue, store.Task
    check_queue_name(name)
    if name in store.config.queues:
        raise InputError("queue %r is configured ([queues.%s]); remove it from the config"
                         % (name, name))

    def step():
        if not store.locked(Queue.select().where(Queue.name == name)).exists():
            raise InputError("no queue named %r" % name)
        tasks = Task.select().where(Task.queue == name).count()
        if tasks:
            raise InputError("queue %r has %d task%s; cancel them or wait for rotation"
                             % (name, tasks, "" if tasks == 1 else "s"))
        Queue.delete().where(Queue.name == name).execute()
    store.write(step)
    store.known_queues.discard(name)


def paused_queues(store):
    """Names of the paused queues."""
    Queue = store.Queue
    return [q.name for q in Queue.select(Queue.name).where(Queue.paused == True)  # noqa: E712
            .order_by(Queue.name)]
