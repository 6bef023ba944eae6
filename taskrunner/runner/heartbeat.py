"""A runner's second thread, the heartbeat: every heartbeat_interval it writes the runner
row's heartbeat (rule 7) and enforces rule 8 on the run the main thread executes — when that
run is no longer ``running`` under this runner (timed out by anyone, on any host), has passed
its max_runtime or was cancelled by an operator, the handler is interrupted, and the runner
exits hard if the handler has not returned within kill_grace. Every RESULTS_INTERVAL it
stores the handler's run.results when they changed. Whatever the handler and the database
do, it carries on until the runner exits (an outage is logged once)."""
import logging
import os
import signal
import threading
import time

import peewee as pw

from ..runs import lifecycle
from ..fleet import liveness
from ..store import outage
from ..store.models import TIMEOUT, utcnow

log = logging.getLogger("taskrunner.runner")


class Heartbeat:
    """The heartbeat thread of one runner (`worker`, a runner.Worker): it reads the state
    the main thread publishes (``current``, the stop and abort reasons) and sets the abort
    reason and deadline; ``worker.switch`` is held while either side switches or aborts a
    run."""
    RESULTS_INTERVAL = 0.5    # how often changed run.results are stored

    def __init__(self, worker):
        self.worker = worker
        self.stopped = threading.Event()
        self.thread = None

    def start(self):
        self.thread = threading.Thread(target=self.loop, name="heartbeat", daemon=True)
        self.thread.start()

    def stop(self, wait=5.0):
        """End the thread, waiting up to `wait` seconds for a write under way (a runner told
        to stop does not wait on a locked database: the thread is a daemon, and its writes
        touch a ``running`` row only)."""
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=wait)

    def loop(self):
        """Every heartbeat_interval: the runner row and rule 8; every RESULTS_INTERVAL while
        a handler runs: its run.results, when they changed. Whatever the handler does and
        whatever the database does: an outage is logged once, and the thread carries on until
        the runner exits."""
        w = self.worker
        interval = w.config.runner.heartbeat_interval
        wait, beat_at = min(interval, self.RESULTS_INTERVAL), time.monotonic() + interval
        shown_stopping = failing = None
        while not self.stopped.wait(wait):
            try:
                context = w.context
                if context is not None:
                    context.flush_results()
                # A run being stopped shows as such (`status`: stopping) until the runner exits.
                stopping = (w.abort_reason or w.cancel_reason or w.stop_reason) \
                    if w.current else None
                if shown_stopping and stopping is None and w.stop_reason is None:
                    stopping = ""            # its stopped run has ended and the runner goes on
                if time.monotonic() >= beat_at or w.abort_deadline is not None \
                        or (stopping is not None and stopping != shown_stopping):
                    beat_at = time.monotonic() + interval
                    rss = w.rss()
                    if not liveness.heartbeat(w.store, w.runner_id, rss=rss,
                                              runs_done=w.runs_done, stopping=stopping):
                        w.disowned = True
                        w.stop_reason = w.stop_reason or "runner row is no longer running"
                    shown_stopping = shown_stopping if stopping is None else stopping
                    if failing is not None:
                        log.info("heartbeat written again after %.1fs",
                                 time.monotonic() - failing)
                        failing = None
                    self.watch_current_run()
            except (pw.DatabaseError, pw.InterfaceError) as exc:
                if failing is None:
                    failing = time.monotonic()
                    log.warning("heartbeat failed: %s", outage.first_line(exc))
                outage.close_quietly(w.store.db)
            except Exception:      # never let the heartbeat stop: the runner would be "hung"
                log.exception("heartbeat failed")
                outage.close_quietly(w.store.db)
            deadline = w.abort_deadline
            wait = min(interval, self.RESULTS_INTERVAL) if deadline is None else \
                max(0.05, min(interval, deadline - time.monotonic()))
        outage.close_quietly(w.store.db)

    def watch_current_run(self):
        """Rule 8, enforced by the process that executes the run: when the run is no longer
        ``running`` under this runner (timed out by anyone, on any host) or has passed its
        max_runtime, interrupt the handler; if it has not returned after kill_grace, exit
        hard — two executions of one task never overlap for longer than that."""
        w = self.worker
        current = w.current
        if current is None or not w.install_signals:
            return
        claimed, hard_deadline = current
        if w.cancel_reason is not None and w.abort_reason is None:
            if time.monotonic() >= w.abort_deadline:     # kill_grace to see should_stop()
                self.interrupt_run(current, "it was cancelled and still ran after kill_grace")
            return
        if w.abort_reason is not None:
            if w.current is current and time.monotonic() >= w.abort_deadline:
                log.error("run %d of task %d: the handler did not return within kill_grace "
                          "(%gs) after %s; exiting", claimed.run_id, claimed.task_id,
                          w.config.overseer.kill_grace, w.abort_reason)
                logging.shutdown()
                os._exit(w.EXIT_HARD)
            return
        now = utcnow()
        if hard_deadline is not None and now >= hard_deadline:
            lifecycle.end_run(w.store, claimed.run_id, claimed.task_id, TIMEOUT,
                              runner_id=w.runner_id, error_code="MaxRuntime",
                              error_message="running longer than %gs (max_runtime)"
                              % claimed.max_runtime, now=now)
            reason, ended_on = "its max_runtime (%gs) passed" % claimed.max_runtime, now
        else:
            ended_on, cancelled = lifecycle.taken_away_on(w.store, claimed.run_id,
                                                          w.runner_id)
            if ended_on is None and not cancelled:
                return
            if ended_on is None:
                # Cooperative first: should_stop() turns true; interrupted after kill_grace.
                log.warning("run %d of task %d: cancelled by an operator; stopping it",
                            claimed.run_id, claimed.task_id)
                w.cancel_reason = "cancelled by an operator while running"
                w.abort_deadline = time.monotonic() + w.config.overseer.kill_grace
                return
            reason = "it was ended by someone else (timed out)"
        self.interrupt_run(current, reason, ended_on)

    def interrupt_run(self, current, reason, ended_on=None):
        """Interrupt the handler (SIGUSR2 to this process); exit hard after kill_grace, counted
        from `ended_on`, the end of the run, not from noticing it a heartbeat later: its retry
        may start at once, and two executions of one task must not overlap for longer."""
        w = self.worker
        claimed, grace = current[0], w.config.overseer.kill_grace
        late = 0.0 if ended_on is None else \
            min(grace, max(0.0, (utcnow() - ended_on).total_seconds()))
        with w.switch:
            if w.current is not current:
                return          # it ended here meanwhile (its own outcome, not a timeout)
            log.warning("run %d of task %d: interrupting the handler: %s", claimed.run_id,
                        claimed.task_id, reason)
            # Aimed a little early (a tenth of kill_grace, at most 0.1 s): exiting takes its
            # own time on a loaded host, and the promise is the overlap, not the aim.
            w.abort_deadline = time.monotonic() + grace - late - min(0.1, grace / 10)
            w.abort_reason = "run %d interrupted: %s" % (claimed.run_id, reason)
            os.kill(os.getpid(), getattr(signal, w.ABORT_SIGNAL))
