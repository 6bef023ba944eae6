"""The queue's regular work (``run-event task-queue:OnProcess``, the overseer's maintainer,
an idle standalone runner): mark dead runners and their runs ``timeout``, time out overdue
runs, create the runs that have come due.

With a lease (leadership.Lease), only its holder does what is fleet-wide — other hosts'
runners, orphaned runs, overdue runs, due runs — each step after checking, on the database's
clock, that the lease is still held; every caller still sweeps its own host's runners by PID.
Every time this pass compares is the database server's, whatever this host's clock says:
heartbeats and the lease in their queries, run timeouts, max_runtime, backoff and due times
through the lifecycle (`Store.database_time`), so a holder whose clock is off neither times
out a fresh run nor creates a run early.
"""
import logging

from ..runs import flow
from ..runs.lifecycle import create_missing_runs, timeout_overdue_runs
from .liveness import refresh_runners
from ..store.models import utcnow

log = logging.getLogger("taskrunner.maintenance")


def process_queue(store, now=None, reaped_by=None, reachable_since=None, lease=None):
    """One pass; returns what it did: ``dead_runners`` (ids), ``timed_out_runs``
    ([(run_id, runner_id)]) and ``created_runs`` (a count). `reaped_by`: the row id of the
    overseer whose dead children are its own to mark (see liveness.refresh_runners).
    `reachable_since`: when the caller got the database back after losing it (see
    Store.writable_since). `lease`: taken or renewed first; while it is not held, only this
    host's runners are swept. `now` is this host's time (a test's injected one): the
    lifecycle puts it on the database's clock."""
    now = now or utcnow()
    fleet = lease is None or lease.renew()
    dead = refresh_runners(store, now=now, other_hosts=fleet, reaped_by=reaped_by,
                           reachable_since=reachable_since)
    overdue, created = [], 0
    if fleet and (lease is None or lease.held()):
        # Runs timed out here are stopped by the runners executing them (rule 8), wherever
        # they are; a runner too hung to do so is found by its heartbeat and killed.
        overdue = timeout_overdue_runs(store, now, reachable_since=reachable_since)
    if fleet and (lease is None or lease.held()):
        created = create_missing_runs(store, now)
        flow.age_runs(store, now)          # the queues with [queues.NAME] aging
        flow.sync_keys(store, now)
    if fleet:
        log.debug("fleet maintenance pass: %d dead runners, %d runs timed out, %d runs created",
                  len(dead), len(overdue), created)
    return {"dead_runners": dead, "timed_out_runs": overdue, "created_runs": created}
