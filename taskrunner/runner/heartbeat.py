"""A runner's second thread, the heartbeat: every heartbeat_interval it writes the runner
row's heartbeat (rule 7) and enforces rule 8 on the run the main thread executes — when that
run is no longer ``running`` under this runner (timed out by anyone, on any host), has passed
its max_runtime or was cancelled by an operator, the handler is interrupted, and the runner
exits hard if the handler has not returned within kill_grace. Every RESULTS_INTERVAL it
stores the handler's run.results when they changed. Whatever the handler and the database
do, it carries on until the runner exits (an outage is logged once, for the whole process:
outage.note_lost)."""
import logging
import os
import signal
import threading
import time
from typing import Any, Optional, Protocol

import peewee as pw

from ..runs import lifecycle
from ..fleet import liveness
from ..store import outage
from ..store.models import TIMEOUT, utcnow
from .current import CurrentRun

log = logging.getLogger("taskrunner.runner")


class Beating(Protocol):
    """What the heartbeat thread reads of its runner (`loop.Runner`), and its one write to
    it (`disown`); the state of the run executing is that run's CurrentRun."""
    EXIT_HARD: int
    ABORT_SIGNAL: str
    store: Any
    config: Any
    install_signals: bool
    runner_id: Optional[int]
    runs_done: int
    stop_reason: Optional[str]
    current: Optional[CurrentRun]
    rss: Any

    def disown(self, reason: str) -> None: ...


class Heartbeat:
    """The heartbeat thread of one runner (`runner`, as `Beating` says). Of the runner it
    reads the runner-wide state (its row, its stop reason) and, when its row is no longer
    ``running``, disowns it; what it decides about a run goes to that run's CurrentRun
    (current.py), the object it examined, never to whichever run the runner executes by
    then."""
    RESULTS_INTERVAL = 0.5    # how often changed run.results are stored

    def __init__(self, runner: Beating):
        self.runner = runner
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
        w = self.runner
        interval = w.config.runner.heartbeat_interval
        wait, beat_at = min(interval, self.RESULTS_INTERVAL), time.monotonic() + interval
        shown_stopping = failing = None
        while not self.stopped.wait(wait):
            run = w.current
            try:
                context = run.context if run is not None else None
                if context is not None and not run.closed:
                    context.flush_results()
                # A run being stopped shows as such (`status`: stopping) until the runner exits.
                stopping = (run.stopping() or w.stop_reason) if run is not None else None
                if shown_stopping and stopping is None and w.stop_reason is None:
                    stopping = ""            # its stopped run has ended and the runner goes on
                # While kill_grace runs out, every turn checks the run (rule 8).
                closing_in = run is not None and run.abort_deadline is not None
                if time.monotonic() >= beat_at or closing_in \
                        or (stopping is not None and stopping != shown_stopping):
                    beat_at = time.monotonic() + interval
                    rss = w.rss()
                    if not liveness.heartbeat(w.store, w.runner_id, rss=rss,
                                              runs_done=w.runs_done, stopping=stopping,
                                              stopping_run_id=run and run.claimed.run_id):
                        w.disown("runner row is no longer running")
                    shown_stopping = shown_stopping if stopping is None else stopping
                    outage.note_back(w.store.db)
                    if failing is not None:
                        log.info("heartbeat written again after %.1fs",
                                 time.monotonic() - failing)
                        failing = None
                    self.watch_current_run()
            except (pw.DatabaseError, pw.InterfaceError) as exc:
                # An outage (lost connection, full disk) is logged once for the process,
                # whichever thread meets it first; anything else here once per streak.
                if not outage.note_lost(w.store.db, exc) and failing is None:
                    failing = time.monotonic()
                    log.warning("heartbeat failed: %s", outage.first_line(exc))
                outage.close_quietly(w.store.db)
            except Exception:      # never let the heartbeat stop: the runner would be "hung"
                log.exception("heartbeat failed")
                outage.close_quietly(w.store.db)
            run = w.current
            deadline = run.abort_deadline if run is not None else None
            wait = min(interval, self.RESULTS_INTERVAL) if deadline is None else \
                max(0.05, min(interval, deadline - time.monotonic()))
            if failing is None and run is not None \
                    and (run.stopping() or w.stop_reason) not in (None, shown_stopping):
                wait = 0.0      # a new reason to stop is shown now, not a heartbeat later
        outage.close_quietly(w.store.db)

    def watch_current_run(self):
        """Rule 8, enforced by the process that executes the run: when the run is no longer
        ``running`` under this runner (timed out by anyone, on any host) or has passed its
        max_runtime, interrupt the handler; if it has not returned after kill_grace, exit
        hard — two executions of one task never overlap for longer than that. A run an
        operator cancelled gets kill_grace to see should_stop() before it is interrupted.
        Everything here is about the run read at the start (`run`): the runner may end it
        and start the next meanwhile, and the next is left alone."""
        w = self.runner
        run = w.current
        if run is None or not w.install_signals:
            return
        claimed, grace = run.claimed, w.config.overseer.kill_grace
        if run.abort_reason is not None:
            if time.monotonic() >= run.abort_deadline:
                with run.lock:       # held to the end: the run cannot be closed meanwhile
                    if run.closed:
                        return
                    log.error("run %d of task %d: the handler did not return within "
                              "kill_grace (%gs) after %s; exiting", claimed.run_id,
                              claimed.task_id, grace, run.abort_reason)
                    logging.shutdown()
                    os._exit(w.EXIT_HARD)
            return
        if run.cancel_reason is not None:
            if time.monotonic() >= run.abort_deadline:     # kill_grace to see should_stop()
                self.interrupt_run(run, "it was cancelled and still ran after kill_grace")
            return
        now = utcnow()
        if run.hard_deadline is not None and now >= run.hard_deadline:
            lifecycle.end_run(w.store, claimed.run_id, claimed.task_id, TIMEOUT,
                              runner_id=w.runner_id, error_code="MaxRuntime",
                              error_message="running longer than %gs (max_runtime)"
                              % claimed.max_runtime, now=now)
            reason, ended_on = "its max_runtime (%gs) passed" % claimed.max_runtime, now
        else:
            if run.chunk_ids is not None:       # its cancels are the chunk's end's
                ended_on, cancelled = lifecycle.chunk_taken_away_on(
                    w.store, run.chunk_ids, w.runner_id), False
            else:
                ended_on, cancelled = lifecycle.taken_away_on(w.store, claimed.run_id,
                                                              w.runner_id)
            if ended_on is None and not cancelled:
                return
            if ended_on is None:
                # Cooperative first: should_stop() turns true; interrupted after kill_grace.
                if run.cancel("cancelled by an operator while running", grace):
                    log.warning("run %d of task %d: cancelled by an operator; stopping it",
                                claimed.run_id, claimed.task_id)
                return
            reason = "it was ended by someone else (timed out)"
        self.interrupt_run(run, reason, ended_on)

    def interrupt_run(self, run, reason, ended_on=None):
        """Interrupt the handler of `run` (SIGUSR2 to this process) unless it has returned;
        exit hard after kill_grace, counted from `ended_on`, the end of the run, not from
        noticing it a heartbeat later: its retry may start at once, and two executions of
        one task must not overlap for longer."""
        w = self.runner
        claimed, grace = run.claimed, w.config.overseer.kill_grace
        late = 0.0 if ended_on is None else \
            min(grace, max(0.0, (utcnow() - ended_on).total_seconds()))
        # Aimed a little early (a tenth of kill_grace, at most 0.1 s): exiting takes its
        # own time on a loaded host, and the promise is the overlap, not the aim.
        deadline = time.monotonic() + grace - late - min(0.1, grace / 10)
        if not run.abort("run %d interrupted: %s" % (claimed.run_id, reason), deadline):
            return          # it ended here meanwhile (its own outcome, not a timeout)
        log.warning("run %d of task %d: interrupting the handler: %s", claimed.run_id,
                    claimed.task_id, reason)
        # Sent after the lock: the signal handler interrupts only a handler still running
        # with an abort reason of its own run (Runner._on_signal).
        os.kill(os.getpid(), getattr(signal, w.ABORT_SIGNAL))
