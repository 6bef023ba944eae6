"""Leadership: the fleet's maintenance is done by one process at a time, the holder of the
``maintenance`` lease (a row of ``task_leases``), instead of by every host.

What only a host can do stays with each host: its own runners' PIDs (liveness). What any
one process can do for everyone — time out overdue runs, create due runs, sweep other
hosts' dead runners and orphaned runs, clear stale periodic marks, run the periodic
scheduler (rotation is one of its tasks) — is done by the holder alone.

A lease is held by a runner row (an overseer's maintainer's, or an idle standalone
runner's) until ``expires_on``, written and compared on the database server's clock
(`Store.server_time`), so hosts whose clocks disagree agree on who holds it. It is taken and
renewed by one conditional UPDATE, atomic on every backend: it matches only when the row is
ours, free, expired, or (for a maintainer) held by a standalone runner — maintainers come
first, since only they run the periodic scheduler (an overseer of an earlier version, which
held it itself, counts as one). The holder renews it at every pass of its regular work
and checks it, again on the database's clock, before each fleet step: a holder that was
cut off (or paused) for longer than the lease finds it lost and does nothing before its
next renewal succeeds. A clean stop releases it, as does the end of its holder's row
(liveness), so a deploy hands over at the next check of another maintainer; a holder that
died unseen is replaced within `duration` plus one check.

The lease saves work, it does not make it safe: every fleet step already closes its races
with conditional updates, so two holders for a moment (one paused mid-step) do no harm.
"""
import logging
from datetime import datetime, timezone

import peewee as pw

from .liveness import host_id
from ..store.models import RUNNER

log = logging.getLogger("taskrunner.leadership")

MAINTENANCE = "maintenance"
# A lease outlives this many missed renewals, and at least MIN_DURATION seconds: a loaded
# holder does not lose it to one slow pass, a dead one is replaced within a few seconds.
RENEWALS = 3
MIN_DURATION = 5.0
NEVER = datetime(1970, 1, 1)


def duration(config, kind):
    """Seconds a lease lasts without renewal: max(5 s, 3 × how often its holder renews) —
    ``[runner] poll_interval`` for an idle standalone runner, ``[overseer] check_interval``
    for a maintainer."""
    every = config.runner.poll_interval if kind == RUNNER else config.overseer.check_interval
    return max(MIN_DURATION, RENEWALS * every)


class Lease:
    """The lease `name` as one holder (runner row `holder_id` of `kind`) sees it."""

    def __init__(self, store, holder_id, kind, name=MAINTENANCE):
        self.store = store
        self.name = name
        self.holder_id = holder_id
        self.kind = kind
        self.host = host_id(store)
        self.holding = False      # as of the last statement about it
        self.closed = False       # released for good: this holder is stopping
        self._row_known = False

    def renew(self):
        """Take the lease, or renew it if ours; returns whether we hold it now.

        Race closed: several processes taking a free or expired lease at once — the
        UPDATE's condition is evaluated on the row as it is when the UPDATE gets it (a row
        lock on PostgreSQL and MySQL, SQLite's single writer), so exactly one matches."""
        if self.closed:
            return False
        Lease, store = self.store.Lease, self.store
        if not self._row_known:
            Lease.insert(name=self.name, expires_on=NEVER).on_conflict_ignore().execute()
            self._row_known = True
        now = store.server_time()
        mine = Lease.holder_id == self.holder_id
        free = Lease.holder_id.is_null() | (Lease.expires_on < now)
        if self.kind != RUNNER:
            free = free | (Lease.holder_kind == RUNNER)
        taken = Lease.update(
            holder_id=self.holder_id, holder_kind=self.kind, host=self.host,
            taken_on=pw.Case(None, [(mine, Lease.taken_on)], now),
            expires_on=store.server_time(self.duration()),
        ).where((Lease.name == self.name) & (mine | free)).execute() == 1
        self._changed(taken)
        return taken

    def duration(self):
        """Read at every renewal: a reloaded config (HUP) applies at once."""
        return duration(self.store.config, self.kind)

    def held(self):
        """Still ours, by the database's clock: asked before each fleet step."""
        if not self.holding or self.closed:
            return False
        Lease = self.store.Lease
        held = Lease.select(Lease.name).where(
            (Lease.name == self.name) & (Lease.holder_id == self.holder_id)
            & (Lease.expires_on > self.store.server_time())).exists()
        self._changed(held)
        return held

    def release(self):
        """Give the lease up now (a clean stop) and never take it again."""
        self.closed = True
        if not self.holding:
            return
        Lease = self.store.Lease
        Lease.update(holder_id=None, holder_kind=None, host=None,
                     expires_on=self.store.server_time()).where(
            (Lease.name == self.name) & (Lease.holder_id == self.holder_id)).execute()
        self.holding = False
        log.info("released the %s lease", self.name)

    def _changed(self, holding):
        if holding and not self.holding:
            log.info("took the %s lease (%s %d on %s, %gs without renewal)", self.name,
                     self.kind, self.holder_id, self.host, self.duration())
        elif self.holding and not holding:
            log.warning("lost the %s lease: another process holds it or it expired",
                        self.name)
        self.holding = holding


def leases(store):
    """Every lease as operators see it (JSON-ready): name, whether it is held now by the
    database's clock, holder (id, kind, host), taken_on and expires_on (ISO 8601 UTC). The
    maintenance lease is listed, not held, before anyone has asked for it."""
    Lease = store.Lease
    live = (Lease.holder_id.is_null(False) & (Lease.expires_on > store.server_time()))
    rows = Lease.select(Lease, live.alias("live")).order_by(Lease.name)
    leases = [{"name": row.name, "held": bool(row.live), "holder_id": row.holder_id,
               "holder_kind": row.holder_kind, "host": row.host, "taken_on": _iso(row.taken_on),
               "expires_on": _iso(row.expires_on) if row.holder_id is not None else None}
              for row in rows]
    if MAINTENANCE not in [lease["name"] for lease in leases]:
        leases.insert(0, dict(name=MAINTENANCE, held=False, holder_id=None, holder_kind=None,
                              host=None, taken_on=None, expires_on=None))
    return leases


def _iso(value):
    return value.replace(tzinfo=timezone.utc).isoformat() if value is not None else None
