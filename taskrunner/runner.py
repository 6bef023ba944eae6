"""The runner: one process that claims runs and executes them, one at a time.

Loop: claim the next run, execute it, record the outcome; wait only when idle (woken at
once by a signal). TERM, HUP or INT: finish the current run, claim nothing more, mark the
runner ``success`` and exit 0; USR1 interrupts the handler and hands the run back (the
signals are described on `Worker`). The runner also exits after its current run when its
RSS passes ``[runner] memory_limit``, after ``max_runs`` runs, when its parent overseer
is gone, or when someone declared it dead.

Contract kept for the overseer: a heartbeat thread refreshes the runner row every
``[runner] heartbeat_interval``, whatever the handler is doing, and stops a run that was
timed out (rule 8).
"""
import json
import logging
import os
import select
import signal
import threading
import time
from datetime import timedelta, timezone

import peewee as pw
import psutil

from . import lifecycle, liveness, maintenance, periodic, queues, wakeup
from .db import is_disconnect, is_transient
from .errors import HandlerError, Retry, RunnerLimitReached, TaskError
from .handler import RunContext, load_handler
from .models import CANCELLED, DEFAULT_QUEUE, ERROR, REQUEUED, RUNNER, SUCCESS, TIMEOUT, utcnow

log = logging.getLogger("taskrunner.runner")

MB = 1024 * 1024


class ResidentSize:
    """This process's RSS in bytes, cheap enough to read after every run: /proc/PID/statm
    through a descriptor kept open (psutil opens and parses the file on every call, which
    costs more than a no-op run's handler); psutil where there is no /proc."""

    def __init__(self):
        self._page = os.sysconf("SC_PAGE_SIZE")
        try:
            self._fd = os.open("/proc/%d/statm" % os.getpid(), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd, self._process = None, psutil.Process()

    def __call__(self):
        if self._fd is None:
            return self._process.memory_info().rss
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Interrupted(BaseException):
    """Raised inside a handler to interrupt it. BaseException so that a handler's
    ``except Exception`` does not swallow it."""


class Worker:
    """One runner process's loop. Signals, one per intent:

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
    STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
    INTERRUPT_SIGNAL = "SIGUSR1"
    ABORT_SIGNAL = "SIGUSR2"
    REPEAT_WINDOW = 1.0
    EXIT_HARD = 4             # the handler did not return after its run was taken away

    def __init__(self, store, install_signals=True, parent_pid=None, parent_id=None,
                 memory_limit=True, serving=None):
        self.store = store
        # The queues it serves (None: all); `claim_order` is re-read every check_interval.
        self.serving = tuple(serving) if serving is not None else None
        self.claim_order, self._order_read_at = (), None
        # Off for work run inside someone else's process (run_pending): its RSS is the
        # application's, not a runner's that may be replaced.
        self.memory_limit = memory_limit
        self.config = store.config
        self._facade = None
        self.install_signals = install_signals
        self.parent_pid = parent_pid
        self.parent_id = parent_id
        self.runner_id = None
        self.stop_reason = None
        self.told_to_stop = None      # monotonic time of the first stop signal
        self.current = None           # (ClaimedRun, hard deadline as naive UTC or None)
        self.abort_reason = None
        self.abort_deadline = None
        self.in_handler = False
        self.runs_done = 0
        self.max_runs = None
        self.disowned = False
        self._handlers = {}
        self._rss = None
        self._wake_r = self._wake_w = None
        self._listener = self._pg_listener = None
        self._heartbeat_stop = threading.Event()

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

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if name == self.ABORT_SIGNAL:
            if self.in_handler and self.abort_reason is not None:
                raise Interrupted(self.abort_reason)
            return
        now = time.monotonic()
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
        if self.in_handler:
            raise Interrupted(reason)

    def _wait(self, timeout):
        """Sleep until a signal, a wake-up from whoever added work, or `timeout`."""
        sources = [fd for fd in (self._wake_r, self._listener) if fd is not None]
        if self._pg_listener is not None:
            self._pg_listener.ensure()
            sources.append(self._pg_listener)
        if not sources:
            time.sleep(timeout)
            return
        ready, _, _ = select.select(sources, [], [], timeout)
        for source in ready:
            if source is self._wake_r:
                try:
                    os.read(self._wake_r, 512)
                except BlockingIOError:
                    pass
            else:
                source.drain()

    # -- heartbeat ----------------------------------------------------------------------

    def _queue_facade(self):
        """The `TaskQueue` a handler sees as ``run.queue``, on this runner's store."""
        if self._facade is None:
            from .queue import TaskQueue
            self._facade = TaskQueue(self.store)
        return self._facade

    def _heartbeat_loop(self):
        interval = wait = self.config.runner.heartbeat_interval
        while not self._heartbeat_stop.wait(wait):
            try:
                rss = self._rss()
                if not liveness.heartbeat(self.store, self.runner_id, rss=rss,
                                          runs_done=self.runs_done):
                    self.disowned = True
                    self.stop_reason = self.stop_reason or "runner row is no longer running"
                self._watch_current_run()
            except pw.DatabaseError as exc:
                log.warning("heartbeat failed: %s", exc)
                self.store.db.close()
            deadline = self.abort_deadline
            wait = interval if deadline is None else \
                max(0.05, min(interval, deadline - time.monotonic()))
        if not self.store.db.is_closed():
            self.store.db.close()

    def _watch_current_run(self):
        """Rule 8, enforced by the process that executes the run: when the run is no longer
        ``running`` under this runner (timed out by anyone, on any host) or has passed its
        max_runtime, interrupt the handler; if it has not returned after kill_grace, exit
        hard — two executions of one task never overlap for longer than that."""
        current = self.current
        if current is None or not self.install_signals:
            return
        claimed, hard_deadline = current
        if self.abort_reason is not None:
            if self.current is current and time.monotonic() >= self.abort_deadline:
                log.error("run %d of task %d: the handler did not return within kill_grace "
                          "(%gs) after %s; exiting", claimed.run_id, claimed.task_id,
                          self.config.overseer.kill_grace, self.abort_reason)
                logging.shutdown()
                os._exit(self.EXIT_HARD)
            return
        if hard_deadline is not None and utcnow() >= hard_deadline:
            lifecycle.end_run(self.store, claimed.run_id, claimed.task_id, TIMEOUT,
                              runner_id=self.runner_id, error_code="MaxRuntime",
                              error_message="running longer than %gs (max_runtime)"
                              % claimed.max_runtime)
            reason = "its max_runtime (%gs) passed" % claimed.max_runtime
        elif not lifecycle.runs_under(self.store, claimed.run_id, self.runner_id):
            reason = "it was ended by someone else (timed out)"
        else:
            return
        log.warning("run %d of task %d: interrupting the handler: %s", claimed.run_id,
                    claimed.task_id, reason)
        self.abort_deadline = time.monotonic() + self.config.overseer.kill_grace
        self.abort_reason = "run %d interrupted: %s" % (claimed.run_id, reason)
        os.kill(os.getpid(), getattr(signal, self.ABORT_SIGNAL))

    # -- executing one run --------------------------------------------------------------

    def _handler_class(self, path):
        cls = self._handlers.get(path)
        if cls is None:
            cls = self._handlers[path] = load_handler(path, self.config.handlers.allow)
        return cls

    def execute(self, claimed, claim_next=False):
        """Run one claimed run's handler and record its outcome. With `claim_next`, unless
        the runner is now due to exit, the outcome and the claim of its next run are one
        transaction (one commit per job); returns that run, or None."""
        started = time.monotonic()
        log.debug("run %d of task %d started: %s (attempt %d)", claimed.run_id, claimed.task_id,
                  claimed.handler, claimed.attempt)
        hard_deadline = claimed.started_on + timedelta(seconds=claimed.max_runtime) \
            if claimed.max_runtime else None
        self.abort_reason = self.abort_deadline = None
        self.current = (claimed, hard_deadline)
        try:
            status, code, message, results, retry_at = self._run_handler(claimed)
        finally:
            self.current = None
        self.runs_done += 1
        args = (claimed.run_id, claimed.task_id, status, self.runner_id, results, code, message)
        options = dict(periodic_task_id=claimed.periodic_task_id, retry_at=retry_at)
        if claim_next and not self._should_exit():
            ended, following = self._with_database(lambda: lifecycle.end_run_and_claim(
                self.store, *args, queues=self._claim_order(), **options),
                reconnected=lambda: self._give_back_lost_claims(keep=claimed.run_id))
        else:
            ended, following = self._with_database(lambda: lifecycle.end_run(
                self.store, *args, **options)), None
        if not ended:
            # Refused, or the connection was lost after the end committed: which one?
            ended = self._with_database(lambda: lifecycle.was_ended_by(
                self.store, claimed.run_id, self.runner_id, status))
        elapsed = time.monotonic() - started
        if ended:
            log.info("run %d of task %d finished: %s %s in %.3fs%s", claimed.run_id,
                     claimed.task_id, claimed.handler, status, elapsed,
                     " (%s: %s)" % (code, message) if code else "")
        else:
            log.warning("run %d of task %d finished %s in %.3fs, but it had been ended meanwhile "
                        "(timeout); its outcome is discarded", claimed.run_id, claimed.task_id,
                        status, elapsed)
        return following

    def _run_handler(self, claimed):
        """Decode the data, load the handler and run it; returns (status, error_code,
        error_message, results as JSON text, retry_at of a requeued run)."""
        status, code, message, results, retry_at = SUCCESS, None, None, None, None
        try:
            data = json.loads(claimed.data)
        except ValueError as exc:
            return ERROR, "DataDecodeError", "task data is not JSON: %s" % exc, None, None
        try:
            cls = self._handler_class(claimed.handler)
        except HandlerError as exc:
            return ERROR, "HandlerError", str(exc), None, None
        if claimed.periodic_task_id is not None and claimed.attempt == 1 \
                and not periodic.allow_start(self.store, claimed.periodic_task_id):
            # Nuntium's tolerance: the previous task of this periodic task started too recently
            # (a retry of the same task is not a new occurrence).
            return CANCELLED, "MinSpacing", "dropped: the previous task of this periodic task " \
                "started less than min_spacing ago", None, None
        deadline = None
        if claimed.max_runtime:
            # The handler's deadline comes a grace before the hard limit, so a handler that
            # watches it and returns is not timed out.
            grace = min(self.config.overseer.kill_grace, claimed.max_runtime / 10)
            deadline = (claimed.started_on + timedelta(seconds=claimed.max_runtime - grace)
                        ).replace(tzinfo=timezone.utc)
        context = RunContext(
            claimed.run_id, claimed.task_id, claimed.attempt, data, deadline=deadline,
            report=lambda pct: lifecycle.report_progress(self.store, claimed.run_id,
                                                         self.runner_id, pct),
            stopping=lambda: self.told_to_stop is not None or self.abort_reason is not None,
            queue=self._queue_facade())
        try:
            self.in_handler = True
            try:
                cls().handle(context)
            finally:
                self.in_handler = False
        except Interrupted as exc:
            if self.abort_reason is not None:     # its run was taken away: rule 8
                status, code, message = TIMEOUT, "Interrupted", str(exc)
            else:
                status, code, message = REQUEUED, "Stopped", "handed back: %s" % exc
        except Retry as exc:
            status, code = REQUEUED, "Snoozed" if exc.in_seconds else "Retry"
            message = exc.reason or ("run again in %gs" % exc.in_seconds if exc.in_seconds
                                     else "run again")
            if exc.in_seconds:
                retry_at = utcnow() + timedelta(seconds=exc.in_seconds)
        except (Exception, SystemExit) as exc:
            code = exc.code if isinstance(exc, TaskError) and exc.code else type(exc).__name__
            text = str(exc) or repr(exc)
            if self.told_to_stop is not None:
                # It ended early because its runner was told to stop: handed back.
                status, code = REQUEUED, "Stopped"
                message = "handed back: %s; the handler ended with %s: %s" % (
                    self.stop_reason, code, text)
            else:
                status, code, message = ERROR, code, text
        # Progress the database could not take during the run (a restart) is written now,
        # before the outcome; it never reached the handler as an error.
        context.flush_progress()
        if context.results is not None:
            try:
                results = json.dumps(context.results, allow_nan=False)
            except (TypeError, ValueError) as exc:
                status, code = ERROR, "ResultsNotJSON"
                message = "run.results is not JSON-serialisable: %s" % exc
        return status, code, message, results, retry_at

    # -- the loop -----------------------------------------------------------------------

    def _with_database(self, fn, patience=60.0, reconnected=None):
        """Call fn, riding out a database restart: on a lost connection, reconnect with
        backoff for up to `patience` seconds (or until asked to stop). `reconnected` runs
        first on the new connection, before fn is tried again."""
        delay, deadline = 0.1, time.monotonic() + patience
        lost = False
        while True:
            try:
                if lost and reconnected is not None:
                    reconnected()
                return fn()
            except (pw.OperationalError, pw.InterfaceError) as exc:
                if not (is_disconnect(exc) or is_transient(exc)) or time.monotonic() > deadline:
                    raise
                log.warning("database unavailable (%s); retrying in %.1fs",
                            str(exc).strip().splitlines()[0] if str(exc).strip() else exc, delay)
                # A deadlock or a busy database rolled back the transaction and left the
                # connection usable (closing it would also drop PostgreSQL's LISTEN).
                if is_disconnect(exc):
                    lost = True
                    if not self.store.db.is_closed():
                        try:
                            self.store.db.close()
                        except pw.DatabaseError:
                            pass
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _should_exit(self):
        max_runs = self.max_runs
        if self.stop_reason is not None:
            return True
        if max_runs and self.runs_done >= max_runs:
            self.stop_reason = "max_runs (%d) reached" % max_runs
        elif self.memory_limit and self.runs_done \
                and self._rss() > self.config.runner.memory_limit * MB:
            # Checked after a run, never before the first: a runner must always do some work.
            self.stop_reason = "memory_limit (%d MB) exceeded" % self.config.runner.memory_limit
        elif self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.stop_reason = "overseer %d is gone" % self.parent_pid
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

    def _claim_order(self):
        """The queues to claim from, re-read every check_interval (pauses, new queues)."""
        if self._order_read_at is None or time.monotonic() - self._order_read_at \
                >= self.config.overseer.check_interval:
            self._look()
        return self.claim_order

    def _look(self):
        """Idle: re-read the claim order and whether a run waits in it, in one read."""
        order, work = queues.claim_order(self.store, self.serving, with_work=True)
        self.claim_order, self._order_read_at = tuple(order), time.monotonic()
        return work

    def _idle(self, standalone):
        """Wait for work: poll a cheap read every poll_interval (a signal wakes at once).
        A runner without an overseer also does the queue's regular work while idle."""
        interval = self.config.runner.poll_interval
        while not self._should_exit():
            if standalone:
                maintenance.process_queue(self.store)
            if self._look():
                return
            self._wait(interval)

    def work(self, burst=False, max_runs=None):
        """Register, then claim and execute until told to stop (or, with burst, until no run
        is left). Returns the number of runs executed."""
        max_runs = self.max_runs = max_runs if max_runs is not None else self.config.runner.max_runs
        if self.install_signals:
            self._setup_signals()
        row = liveness.register(self.store, kind=RUNNER, parent_id=self.parent_id,
                                serving=self.serving)
        self.runner_id = row.id
        if not burst:
            self._listener = wakeup.Listener(self.config.database.url)
            if self.store.backend == "postgresql":
                self._pg_listener = wakeup.PostgresListener(self.store.db)
        log.info("runner %d started (pid %d, slot %d, queues %s)", row.id, row.pid, row.slot,
                 ",".join(self.serving or ("all",)))
        self._rss = ResidentSize()
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        claimed = None
        try:
            while claimed is not None or not self._should_exit():
                if claimed is None:
                    claimed = self._with_database(lambda: lifecycle.claim(
                        self.store, self.runner_id, self._claim_order()),
                                                  reconnected=self._give_back_lost_claims)
                    if claimed is None:
                        if burst:
                            self.stop_reason = "no work left"
                            break
                        self._with_database(lambda: self._idle(standalone=self.parent_pid is None))
                        continue
                claimed = self._unless_stopping(self.execute(claimed, claim_next=True))
        finally:
            if self._listener is not None:
                self._listener.close()
            self._heartbeat_stop.set()
            beat.join(timeout=5)
            self._rss.close()
            if not self.disowned:
                self._with_database(lambda: liveness.retire(self.store, self.runner_id,
                                                            self.stop_reason))
            log.info("runner %d exiting after %d runs: %s", self.runner_id, self.runs_done,
                     self.stop_reason)
        return self.runs_done


def run_runner(store, refuse_quietly=False, burst=False, max_runs=None, serving=(DEFAULT_QUEUE,)):
    """Entry point of ``taskrunner runner`` and ``run-event task-runner:OnProcess``, serving
    the queues `serving`; returns the exit code. At the host's limit (or a queue's): exit 1,
    or 0 with `refuse_quietly` (cron use)."""
    worker = Worker(store, serving=serving)
    try:
        if burst:
            maintenance.process_queue(store)
        worker.work(burst=burst, max_runs=max_runs)
    except RunnerLimitReached as exc:
        if refuse_quietly:
            log.info("not starting: %s", exc)
            return 0
        log.error("not starting: %s", exc)
        return 1
    return 0
