"""A runner's idle part: waiting for work and being woken. While no run waits it re-reads
the claim order (and whether a run waits in it) every poll_interval, sleeping in between on a
select() that a signal, this host's wake-up hub (wakeup.Listener) or PostgreSQL's NOTIFY
(wakeup.PostgresListener) ends at once; a runner without an overseer also does the fleet's
maintenance while idle when it holds the maintenance lease. A mixin of `loop.Runner`, whose
state it reads and sets (the claim order, the listeners, the wake-up pipe of its signals)."""
import logging
import os
import select
import time

from ..fleet import leadership, maintenance
from ..runs import flow, queues
from ..runs.statements.shared import GUARDED_BACKENDS
from ..store.models import RUNNER

log = logging.getLogger("taskrunner.runner")


class Idle:
    """Waiting for work, for `loop.Runner`."""
    TELL_AGAIN = 0.05         # seconds before telling a lagging hub again that it is idle

    def _wait(self, timeout):
        """Sleep until a signal, a wake-up from whoever added work, or `timeout`. Returns
        whether the hub woke this runner alone, for a run added (Listener.called)."""
        sources = [fd for fd in (self._wake_r, self._listener) if fd is not None]
        if self._pg_listener is not None:
            self._pg_listener.ensure()
            if self._pg_listener.drain():      # it came with another query's result
                log.debug("runner %d woken", self.runner_id)
                return False
            sources.append(self._pg_listener)
        if not sources:
            time.sleep(timeout)
            return False
        ready, _, _ = select.select(sources, [], [], timeout)
        called = False
        for source in ready:
            if source is self._wake_r:
                try:
                    os.read(self._wake_r, 512)
                except BlockingIOError:
                    pass
            elif source.drain():
                log.debug("runner %d woken", self.runner_id)
                called = called or source is self._listener and source.called
        return called

    def _claim_order(self):
        """The queues to claim from, re-read every check_interval (pauses, new queues, a
        queue's limit changed: a slot above it claims nothing, and looks again)."""
        if self._order_read_at is None or time.monotonic() - self._order_read_at \
                >= self.config.overseer.check_interval:
            self._look()
        return self.claim_order

    def _look(self):
        """Idle: re-read the claim order, whether a run waits in it and whether any rate key
        has a limit, in one read (no more before the claim of a runner woken for new work;
        with a queue's rate configured, its bucket is checked too)."""
        order, work, limited = queues.claim_order(self.store, self.serving, with_work=True,
                                                  also=(flow.keys_limited,),
                                                  slots=self.queue_slots)
        self.claim_order, self._order_read_at = tuple(order), time.monotonic()
        flow.prepare(self.store, order, limited[0] if limited else None)
        return work

    def _idle(self, standalone):
        """Wait for work: poll a cheap read every poll_interval (a signal or a wake-up wakes
        at once). The hub hears of it only when the runner goes idle and when it finds work
        by itself (see wakeup.Listener). A runner without an overseer also sweeps its host's
        runners while idle, and does the fleet's maintenance when it holds the maintenance
        lease (an overseer takes it over)."""
        interval = self.config.runner.poll_interval
        listener = self._listener
        while not self._should_exit():
            if standalone and (self._maintained_at is None
                               or time.monotonic() - self._maintained_at >= interval):
                self.lease = self.lease or leadership.Lease(self.store, self.runner_id, RUNNER)
                maintenance.process_queue(self.store, reachable_since=self.db_back_at,
                                          lease=self.lease)
                self._maintained_at = time.monotonic()
            # Told (and LISTENing) before looking: news sent after the look still wakes
            # this runner.
            told = listener is None or listener.idle(self.serving)
            if self._pg_listener is not None:
                self._pg_listener.ensure()
            if self._look():
                # Runs wait, but a rate limit holds them back: sleep until its next token
                # (a signal or news of other work wakes it sooner), never polling faster.
                throttled = flow.throttled_for(self.store, self.claim_order)
                if throttled > 0:
                    self._wait(min(throttled, interval))
                if listener is not None:
                    listener.drain()
                    listener.leave()
                return
            if told:
                if self._wait(interval) and self._claims_unlooked():
                    # The hub woke this runner alone for a run added: it claims at once,
                    # guarded, without a look first (one round trip less to the run's
                    # start); an empty claim brings it back here, to look.
                    self._unlooked = True
                    return
            else:
                self._tell_again(listener, interval)

    def _claims_unlooked(self):
        """Whether a claim may skip the look before it: a guarded claim (CLAIM_GUARD in
        runs/statements/shared.py) can stand in for it — one run at a time, on PostgreSQL or
        SQLite (on MySQL the guard would be a statement of its own, as the look is), and no
        queue of the last claim order under flow control (those claims read what the look
        read themselves)."""
        return self.batch is None and self._order_read_at is not None \
            and self.store.backend in GUARDED_BACKENDS and not any(
            flow.claim_flow(self.store, queue) for queue in self.claim_order)

    def _tell_again(self, listener, interval):
        """The hub lags (its queue is full): tell it again every TELL_AGAIN, without
        querying, until it hears (then the caller looks once more: news sent meanwhile
        woke nobody), a wake-up or a signal, or `interval` passes."""
        deadline = time.monotonic() + interval
        while not self._should_exit() and time.monotonic() < deadline:
            self._wait(min(self.TELL_AGAIN, max(0.0, deadline - time.monotonic())))
            if not listener.announced and listener.idle(self.serving):
                return
