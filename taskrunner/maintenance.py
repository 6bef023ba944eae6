"""The queue's regular work (``run-event task-queue:OnProcess``, the overseer's check, an
idle standalone runner): mark dead runners and their runs ``timeout``, time out overdue
runs, create the runs that have come due."""
from .lifecycle import create_missing_runs, timeout_overdue_runs
from .liveness import refresh_runners
from .models import utcnow


def process_queue(store, now=None, own_children=(), reachable_since=None):
    """One pass; returns what it did: ``dead_runners`` (ids), ``timed_out_runs``
    ([(run_id, runner_id)]) and ``created_runs`` (a count). `own_children`: PIDs an overseer
    reaps itself (see liveness.refresh_runners). `reachable_since`: when the caller got the
    database back after losing it (see Store.writable_since)."""
    now = now or utcnow()
    dead = refresh_runners(store, now=now, own_children=own_children,
                           reachable_since=reachable_since)
    overdue = timeout_overdue_runs(store, now, reachable_since=reachable_since)
    created = create_missing_runs(store, now)
    return {"dead_runners": dead, "timed_out_runs": overdue, "created_runs": created}
