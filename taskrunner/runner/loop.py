"""The runner: one process that claims runs and executes them, one at a time (`Runner`).

Loop (this module): claim the next run, execute it (execute.py), record the outcome; wait
only when idle (idle.py; woken at once by a signal). With ``[runner] batch`` > 1 it claims
several runs at once and records their successes together (batches.py). TERM, HUP or INT:
finish the current run, claim nothing more, mark the runner ``success`` and exit 0; USR1
interrupts the handler and hands the run back (the signals are described on `Runner`). The
runner also exits after its current run when its RSS passes ``[runner] memory_limit``, after
``max_runs`` runs, when its parent overseer is gone, or when someone declared it dead.

Contract kept for the overseer: a heartbeat thread refreshes the runner row every
``[runner] heartbeat_interval``, whatever the handler is doing, and stops a run that was
timed out (rule 8). A database outage, however long, ends neither: both wait it out
(outage.py), and a run in flight keeps its outcome until the database is back. A disk that
is full or read-only is such an outage: nothing is written until it takes writes again,
and the runner neither crashes nor exits for it.
"""
import logging
import os
import signal
import time
from datetime import datetime, timedelta, timezone

import peewee as pw

from . import batches, stops, versions
from . import reload as reload_module
from ..fleet import liveness, maintenance
from .. import tracing
from ..runs import lifecycle
from ..store import outage
from ..store.bound import BRIEF
from ..host import wakeup
from ..errors import RunnerLimitReached
from .chunks import Chunks
from .execute import Execution
from .heartbeat import Heartbeat
from .idle import Idle
from ..store.models import DEFAULT_QUEUE, RUNNER, utcnow
from .outcomes import Interrupted

log = logging.getLogger("taskrunner.runner")

MB = 1024 * 1024


class Runner(Idle, Execution, Chunks):
    """One runner process's loop; waiting for work is `Idle`'s, one run's execution
    `Execution`'s, a chunk handler's runs `Chunks`'. Signals, one per intent:

    - TERM, INT, HUP: stop gracefully — finish the current run, claim nothing more, exit 0 —
      however many arrive and from whomever (a supervisor signalling the whole process
      group, a terminal's Ctrl-C, the overseer relaying its own stop).
    - USR1: interrupt the handler now (the overseer's fast stop, or an operator on purpose);
      the run is handed back and the runner exits.
    - A runner without an overseer also takes a TERM or INT repeated more than
      REPEAT_WINDOW after the first as "interrupt" (Ctrl-C pressed again); a repeat inside
      the window is the same stop delivered twice and changes nothing.
    - USR2 (sent by the runner to itself): its run was timed out — by anyone, anywhere — or
      passed max_runtime; the handler is interrupted and the runner carries on, or exits
      hard when the handler has not returned within kill_grace (rule 8).
    """
    STOP_SIGNALS = stops.STOP_SIGNALS
    INTERRUPT_SIGNAL = "SIGUSR1"
    ABORT_SIGNAL = "SIGUSR2"
    REPEAT_WINDOW = 1.0
    EXIT_HARD = 4             # the handler did not return after its run was taken away

    def __init__(self, store, install_signals=True, parent_pid=None, parent_id=None,
                 memory_limit=True, clock=None, serving=None, facade=None, held_stops=(),
                 wait_for_slot=False, code_watch=None):
        self.store = store
        # --reload: a reload.CodeWatch; a changed file stops the runner (`code_changed`).
        self.code_watch = code_watch
        self.code_changed = None
        # Stop signals caught before this runner's handlers were in place (stops.hold).
        self.held_stops = held_stops
        # At the host's (or a queue's) limit: wait for a slot rather than exit (_register).
        self.wait_for_slot = wait_for_slot
        # Builds the handle a handler sees as ``run.queue`` from this runner's store (the
        # user's facade, `TaskQueue`): passed in by whoever starts the runner, so the runner
        # never imports the facade that imports it (run_pending).
        self.facade = facade
        # The queues it serves (None: all); `claim_order` is re-read every check_interval.
        self.serving = tuple(serving) if serving is not None else None
        self.claim_order, self._order_read_at = (), None
        self.queue_slots = {}       # {queue: its slot of the queue's per-host limit}
        self.held_queues = None     # the queues its claims check that slot in (lifecycle.held)
        self._unlooked = False      # the next claim is guarded, without a look (_idle)
        # Off for work run inside someone else's process (run_pending): its RSS is the
        # application's, not a runner's that may be replaced, and it takes no runner slot.
        self.memory_limit = memory_limit
        # run_pending(now=...): the time claims, ends and backoffs are computed at.
        self.clock = clock
        self.config = store.config
        self._facade = None
        self.install_signals = install_signals
        self.parent_pid = parent_pid
        self.parent_id = parent_id
        self.runner_id = None
        self.code_version = None      # of the handler code it runs (versions.py), at work()
        self.stop_reason = None
        self.told_to_stop = None      # monotonic time of the first stop signal
        self.stop_signal = None       # its name ("SIGHUP")
        # The run executing, shared with the heartbeat thread (current.py): a new CurrentRun
        # for each run, so that nothing decided about one run lands on the next.
        self.current = None
        self.runs_done = 0
        self.max_runs = None
        self.disowned = False
        self.db_back_at = None        # when the database answered again after an outage
        self.lease = None             # standalone: the maintenance lease (leadership.py)
        self._maintained_at = None    # standalone: monotonic time of its last queue pass
        self._handlers = {}
        self.rss = None
        self._wake_r = self._wake_w = self._listener = self._pg_listener = None
        self.heartbeat = Heartbeat(self)
        self.batch = None             # a batches.Batch with [runner] batch > 1
        self.burst = False            # until no run is left: a chunk waits for no more

    # -- signals ------------------------------------------------------------------------

    def _setup_signals(self):
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The C-level handler writes to the pipe, so an idle select() wakes at once.
        signal.set_wakeup_fd(self._wake_w)
        for name in self.STOP_SIGNALS + (self.INTERRUPT_SIGNAL, self.ABORT_SIGNAL):
            signal.signal(getattr(signal, name), self._on_signal)
        for name in ("SIGTTIN", "SIGTTOU"):
            # The overseer's signals; their default action would suspend a runner.
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        for signum in self.held_stops:
            self._on_signal(signum, None)
        self.held_stops = ()

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if name == self.ABORT_SIGNAL:
            # Only the run it was sent for: a signal that comes late finds that run closed,
            # or the next one with no abort reason.
            run = self.current
            if run is not None and run.in_handler and run.abort_reason is not None:
                raise Interrupted(run.abort_reason)
            return
        now = time.monotonic()
        self.stop_signal = self.stop_signal or name
        if name == self.INTERRUPT_SIGNAL:
            self._stop("received %s" % name, now)
            self._interrupt("interrupted by %s" % name)
        elif self.told_to_stop is None:
            self._stop("received %s" % name, now)
        elif self.parent_pid is None and name != "SIGHUP" \
                and now - self.told_to_stop > self.REPEAT_WINDOW:
            self._interrupt("interrupted by %s repeated" % name)

    def _stop(self, reason, now):
        if self.told_to_stop is None:
            self.told_to_stop = now
        self.stop_reason = self.stop_reason or reason

    def _interrupt(self, reason):
        run = self.current
        if run is not None and run.in_handler:
            raise Interrupted(reason)

    STOP_REASONS = {"SIGHUP": "hup", "SIGTERM": "term", "SIGINT": "int",
                    INTERRUPT_SIGNAL: "interrupt"}

    def _stop_info(self, run):
        """(why, by when: aware UTC) the handler of `run` (a CurrentRun) is asked to stop,
        or (None, None): cancelled or taken away, kill_grace from then; told to stop by a
        signal, graceful_timeout from its arrival (what an overseer gives its runners)."""
        if run.cancel_reason is not None or run.abort_reason is not None:
            return ("cancel" if run.cancel_reason is not None else "timeout",
                    _wall_time(run.abort_deadline))
        if self.told_to_stop is not None:
            return (self.STOP_REASONS.get(self.stop_signal, "term"), _wall_time(
                self.told_to_stop + self.config.overseer.graceful_timeout))
        return None, None

    def disown(self, reason):
        """Its row is no longer ``running`` (someone declared it dead): it claims nothing
        more and retires no row. The heartbeat thread's only write to the runner."""
        self.disowned = True
        self.stop_reason = self.stop_reason or reason

    # -- the loop -----------------------------------------------------------------------

    def now(self):
        """Naive UTC now, or the time run_pending(now=...) was given."""
        return self.clock if self.clock is not None else utcnow()

    def _with_database(self, fn, reconnected=None, while_stopping=True):
        """fn(), riding out a database restart or outage however long it lasts (see
        outage.call_through). Without `while_stopping`, a runner told to stop gives up
        waiting (DatabaseLost) instead."""
        result, lost_for = outage.call_through(
            self.store.db, fn, reconnected,
            give_up=None if while_stopping else lambda: self.stop_reason)
        if lost_for is not None:
            self.db_back_at = utcnow()
        return result

    def _should_exit(self):
        max_runs = self.max_runs
        if self.stop_reason is not None:
            return True
        if max_runs and self.runs_done >= max_runs:
            self.stop_reason = "max_runs (%d) reached" % max_runs
        elif self.memory_limit and self.runs_done \
                and self.rss() > self.config.runner.memory_limit * MB:
            # Checked after a run, never before the first: a runner must always do some work.
            self.stop_reason = "memory_limit (%d MB) exceeded" % self.config.runner.memory_limit
        elif self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.stop_reason = "overseer %d is gone" % self.parent_pid
        elif self.code_watch is not None:
            self.code_changed = self.code_watch.changed()
            if self.code_changed is not None:
                self.stop_reason = "%s changed; restarting (--reload)" % self.code_changed
        return self.stop_reason is not None

    def _give_back_lost_claims(self, keep=None):
        """After the connection dropped during a claim: whether that claim committed is
        unknown, so every run still ``running`` under this runner, but the one it is
        ending (`keep`), goes back to the queue."""
        count = lifecycle.release_runs_of(self.store, self.runner_id, keep=keep)
        if count:
            log.warning("gave back %d run(s) claimed as the connection was lost", count)

    def _unless_stopping(self, claimed):
        """A run claimed together with the last outcome, kept unless a stop signal came in
        meanwhile: then it is given back unstarted, since a stopping runner claims nothing."""
        if claimed is None or self.stop_reason is None:
            return claimed
        if self._with_database(lambda: lifecycle.release_runs_of(
                self.store, self.runner_id, only=claimed.run_id)):
            log.info("run %d of task %d given back unstarted: %s", claimed.run_id,
                     claimed.task_id, self.stop_reason)
        return None

    def work(self, burst=False, max_runs=None):
        """Register, then claim and execute until told to stop (or, with burst, until no run
        is left); told to stop before it registered, it returns at once. Returns the number
        of runs executed."""
        max_runs = self.max_runs = max_runs if max_runs is not None else self.config.runner.max_runs
        self.burst = burst
        if self.install_signals:
            self._setup_signals()
            if self.told_to_stop is not None:
                # Stopped while it started (stops.hold): it takes no slot and claims nothing.
                log.info("runner not started: %s", self.stop_reason)
                return 0
        if self.memory_limit:       # a process of its own (not run_pending's): group sync
            self.store.use_group_sync()
        self.code_version = versions.code_version(self.config)
        row = self._register()
        if row is None:
            log.info("runner not started: %s", self.stop_reason)
            return 0
        self.runner_id, self.queue_slots = row.id, getattr(row, "queue_slots", {})
        self.held_queues = lifecycle.held_queues(self.queue_slots)
        if not burst:
            self._listener = wakeup.open_listener(self.store.wakeup_directory)
            # Under an overseer its hub LISTENs for the host: a busy runner's connection
            # then holds no notifications.
            if self.parent_pid is None and wakeup.listen_url(self.config.database,
                                                             standalone=True):
                self._pg_listener = wakeup.PostgresListener(self.store.db)
        if row.slot is not None:        # a process of its own, not run_pending's caller
            liveness.name_process("tr-runner-%d" % row.slot)
        log.info("runner %d started (pid %d, slot %s, queues %s)", row.id, row.pid, row.slot,
                 ",".join(self.serving or ("all",)))
        self.rss = liveness.ResidentSize()
        self.heartbeat.start()
        claimed = None
        try:
            if self.config.runner.batch > 1 and self.install_signals:
                self._work_batched(burst)       # returns when the runner is to exit
            while claimed is not None or not self._should_exit():
                if claimed is None:
                    claimed = self._with_database(self._claim,
                                                  reconnected=self._give_back_lost_claims,
                                                  while_stopping=False)
                    if claimed is None:
                        if burst:
                            self.stop_reason = "no work left"
                            break
                        self._with_database(lambda: self._idle(standalone=self.parent_pid is None),
                                            while_stopping=False)
                        continue
                claimed = self._unless_stopping(self.execute(claimed, claim_next=True))
        except outage.DatabaseLost:
            pass         # told to stop, idle, while the database is unreachable: just go
        finally:
            if self.batch is not None:   # successes written, unstarted runs given back
                self.batch.close_through(self._with_database, self.now(), self.stop_reason)
            if self._listener is not None:
                self._listener.close()
            self.heartbeat.stop(BRIEF if self.told_to_stop is not None else 5.0)
            self.stop_reason = self.stop_reason or "an error"
            if not self.disowned:
                self._retire()
            self.rss.close()
            log.info("runner %d exiting after %d runs: %s", self.runner_id, self.runs_done,
                     self.stop_reason)
        return self.runs_done

    def _claim(self):
        """One claim of a run; right after the hub woke this runner, a guarded one on the
        claim order of its last look, however old (see _idle). The claims it makes while
        busy after that one trust the order for check_interval after it was read: so the
        next reads it again first."""
        # The claim's time: the pinned clock, else when the claim holds the write lock
        # (lifecycle._claim_now), not now, before the wait for it.
        if not self._unlooked:
            return lifecycle.claim(self.store, self.runner_id, self._claim_order(), self.clock,
                                   held_queues=self.held_queues)
        self._unlooked, self._order_read_at = False, None
        return lifecycle.claim(self.store, self.runner_id, self.claim_order, self.clock,
                               guarded=True, held_queues=self.held_queues)

    def _register(self):
        """The runner row (None: stopped while the disk could not take it); RunnerLimitReached
        at the host's (or a queue's) limit — unless `wait_for_slot`: then it waits, holding no
        slot, and registers as soon as one is free, checking every poll_interval until a stop
        signal. Supervisord restarts a
        process that exits however it exits, so `numprocs` above the limit would otherwise
        respawn the refused ones in a loop; waiting, they are standbys."""
        waiting = False
        while True:
            try:
                row = liveness.register(self.store, kind=RUNNER, parent_id=self.parent_id,
                                        take_slot=self.memory_limit, serving=self.serving,
                                        code_version=self.code_version)
                outage.note_back(self.store.db)
                return row
            except (pw.OperationalError, pw.InterfaceError) as exc:
                # A full or read-only disk wrote nothing (unlike a connection lost in the
                # commit, after which the row may exist): wait until it takes writes, so a
                # runner forked meanwhile neither crashes nor counts as failing to start.
                if not outage.is_unwritable(exc):
                    raise
                outage.note_lost(self.store.db, exc)
                outage.close_quietly(self.store.db)
                if self.stop_reason is not None:
                    return None
                self._wait(outage.RECONNECT_DELAY)
                continue
            except RunnerLimitReached as exc:
                if not self.wait_for_slot or self.stop_reason is not None:
                    raise
                if not waiting:
                    log.info("waiting for a free slot: %s", exc)
                    waiting = True
            self._wait(self.config.runner.poll_interval)

    def _work_batched(self, burst):
        """work() with [runner] batch > 1 (batches.py): up to `batch` runs claimed at once,
        executed one by one, their successes written together."""
        size = self.config.runner.batch
        batch = self.batch = batches.Batch(self.store, self.runner_id, size,
                                           self.config.runner.flush_interval,
                                           self.held_queues)
        batch.start()
        while not self._should_exit():
            left = self.max_runs - self.runs_done if self.max_runs else size
            claimed = self._with_database(lambda: batch.next(self._claim_order(), self.clock,
                                                             left),
                                          reconnected=batch.give_back_lost_claims,
                                          while_stopping=False)
            if claimed is not None:
                self.execute(claimed)
            elif burst:
                self.stop_reason = "no work left"
            else:
                self._with_database(lambda: self._idle(standalone=self.parent_pid is None),
                                    while_stopping=False)

    def _retire(self):
        if self.told_to_stop is not None:
            self._retire_briefly()
            return
        try:
            self._with_database(lambda: liveness.retire(
                self.store, self.runner_id, self.stop_reason, rss=self.rss(),
                runs_done=self.runs_done), while_stopping=False)
        except outage.DatabaseLost:
            # Its row stays `running` until an overseer or a runner of this host finds the
            # PID gone; it holds no run.
            log.warning("runner %d could not retire its row: the database is unreachable",
                        self.runner_id)

    def _retire_briefly(self):
        """Told to stop: tries on a bounded store, so that a locked or unreachable database
        never keeps a stopping runner from exiting (its overseer's graceful_timeout, a
        supervisor's stop timeout); a row left ``running`` is swept by its PID. SQLite: a
        try that found the database busy is made again while other writers commit (this
        host's runners stopping at once, each retire with its fsync), until graceful_timeout
        from the stop signal; a lock held by a writer that commits nothing (another program,
        a writer waiting behind it) ends the tries at once."""
        store = self.store.bounded()
        deadline = self.told_to_stop + self.config.overseer.graceful_timeout
        try:
            seen = store.commit_count()
            while True:
                try:
                    liveness.retire(store, self.runner_id, self.stop_reason, rss=self.rss(),
                                    runs_done=self.runs_done)
                    return
                except (pw.OperationalError, pw.InterfaceError) as exc:
                    now = store.commit_count()
                    if now is None or now == seen or time.monotonic() >= deadline:
                        log.warning("runner %d could not retire its row (%s): its PID will "
                                    "tell", self.runner_id, outage.first_line(exc))
                        return
                    seen = now
        finally:
            store.close()


def _wall_time(monotonic):
    """A time of the monotonic clock as an aware UTC datetime (None stays None)."""
    if monotonic is None:
        return None
    return datetime.now(timezone.utc) + timedelta(seconds=monotonic - time.monotonic())


def run_runner(store, refuse_quietly=False, burst=False, max_runs=None, serving=(DEFAULT_QUEUE,),
               report=None, facade=None, held_stops=(), wait_for_slot=False, reload=False):
    """Entry point of ``taskrunner runner`` and ``run-event task-runner:OnProcess``, serving
    the queues `serving`; returns the exit code. At the host's limit (or a queue's): exit 1,
    or 0 with `refuse_quietly` (cron use) or when stopped while it waited (`wait_for_slot`).
    `report`, a dict, receives ``runs`` (executed) and ``refused`` (why the runner did not
    start, or None). `facade` builds the handlers' ``run.queue`` from the store;
    `held_stops`, the stop signals caught while the command started (stops.hold). `reload`:
    a change to the code it imported stops it, and ``code_changed`` in `report` names the
    file (reload.py; the caller restarts the process)."""
    tracing.set_up(store.config.tracing.setup)
    runner = Runner(store, serving=serving, facade=facade, held_stops=held_stops,
                    wait_for_slot=wait_for_slot,
                    code_watch=reload_module.CodeWatch() if reload else None)
    report = {} if report is None else report
    report.update(runs=0, refused=None)
    try:
        if burst:
            maintenance.process_queue(store)
        report["runs"] = runner.work(burst=burst, max_runs=max_runs)
        if reload:
            report["code_changed"] = runner.code_changed
    except RunnerLimitReached as exc:
        report["refused"] = str(exc)
        if refuse_quietly or runner.stop_reason is not None:
            log.info("not starting: %s", exc)
            return 0
        log.error("not starting: %s", exc)
        return 1
    return 0
