"""The maintainer: the overseer's database maintenance, in a child process of its own
(``tr-maintainer``), so the overseer's loop is about processes alone (Solid Queue's
supervisor forks a dispatcher and a scheduler; Oban keeps its Stager and Lifeline out of the
supervisor, too).

It registers a row of its own (kind ``maintainer``, no slot, its overseer's row as parent):
the lease and its periodic marks name the process doing the work, so when it dies — found by
its PID here, by its heartbeat's age elsewhere — both are free at once. It syncs the
periodic definitions of its config (a reload starts a new maintainer, see
`MaintainerProcess`). Then, every ``[overseer] check_interval``: the queue pass — this
host's dead runners by PID, and while it holds the fleet's maintenance lease (leadership.py),
the fleet's part (other hosts' runners, overdue runs, due runs) and stale periodic marks —
and its heartbeat; between checks, the periodic scheduler, whose tasks include rotation. It
leaves to the overseer the dead children of that overseer: the overseer marks each one as
it reaps it, since only it knows why it died (its own stop, which hands the runs back, or a
crash).

Unlike the overseer it waits on the database as long as the database needs: a locked or
unreachable database, or a full or read-only disk, delays maintenance, never the overseer's
signals, reaps and stops. No exception from one periodic task, one check or one database
call ends it: it is logged (an outage once when it begins, once when it ends) and the step is tried again at the next tick. A burst of due periodic
tasks is handled in slices of one check_interval, with a check between two slices.

Contract kept for the overseer: at every tick, at least once per check_interval, it writes a
byte on its notify pipe; one silent for ``[overseer] heartbeat_timeout`` is hung, and the
overseer KILLs and replaces it. TERM, INT, HUP or QUIT (the overseer's stop or reload; a
signal sent to its process group): it finishes the step under way, releases the lease,
retires its row and exits 0. It dies with its overseer: the kernel KILLs it, as everything
it writes is a transaction, and a maintainer without an overseer would only keep the lease
from the fleet.
"""
import contextlib
import logging
import os
import signal
import time

import peewee as pw
import psutil

from ..fleet import leadership, liveness, maintenance
from ..periodic import scheduler as periodic
from ..store import outage
from ..store.bound import Store
from ..store.models import MAINTAINER, utcnow
from .signals import SignalPipe

log = logging.getLogger("taskrunner.maintainer")


class Maintainer:
    """The maintainer's loop, in its own process. Every decision is made in `tick(now)` with
    the monotonic clock passed in; `run()` sets up, ticks and sleeps."""

    SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    EXIT_OK = 0
    EXIT_DISOWNED = 1        # someone declared its row dead: the overseer starts another

    def __init__(self, config, overseer_id, overseer_pid, notify_fd=None):
        self.config = config
        periodic.install_hooks()
        self.store = Store(config)
        self.overseer_id = overseer_id
        self.overseer_pid = overseer_pid
        self.notify_fd = notify_fd
        self.row_id = None
        self.lease = None
        self.scheduler = None
        self.stop_reason = None
        self.exit_code = self.EXIT_OK
        self.now = time.monotonic()
        self.next_check = 0.0
        self.next_periodic = 0.0
        self.db_lost_at = None        # tick time of the first failure of an outage
        self.db_back_at = None        # UTC of the attempt that found the database back
        self._process = psutil.Process()
        self.signal_pipe = SignalPipe(self.SIGNALS, self._on_signal)

    # -- signals ------------------------------------------------------------------------

    def _on_signal(self, signum, frame):   # record only: the step under way finishes
        if self.stop_reason is None:
            self.stop_reason = "received %s" % signal.Signals(signum).name

    def notify(self):
        """A sign of life for the overseer (MaintainerProcess.listen)."""
        if self.notify_fd is not None:
            # A full pipe has signs enough; a closed one means the overseer is gone.
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(self.notify_fd, b".")

    # -- the work -----------------------------------------------------------------------

    def start(self):
        """Sync the periodic definitions of this config, then register this maintainer's row
        and make its lease and scheduler (both retried at the next tick if the database
        fails: syncing twice changes nothing)."""
        periodic.sync_definitions(self.store, import_handlers=False)
        row = liveness.register(self.store, kind=MAINTAINER, parent_id=self.overseer_id,
                                take_slot=False)
        self.row_id = row.id
        self.lease = leadership.Lease(self.store, row.id, MAINTAINER)
        self.scheduler = periodic.PeriodicScheduler(self.store)
        log.info("maintainer %d started (pid %d) for overseer %d", row.id, os.getpid(),
                 self.overseer_id)

    def check(self):
        """Once per check_interval: the queue pass (the fleet's part while holding the
        lease), the heartbeat, stale periodic marks, and when the scheduler runs next. A
        maintainer whose row was declared dead meanwhile (no heartbeat while it was cut off
        from the database) exits: it lost the lease with its row, and the overseer starts
        another, with a row of its own."""
        if self.db_lost_at is not None:
            # If this pass gets through, the database is back as of now: heartbeats and
            # progress count from then (Store.writable_since).
            self.db_back_at = utcnow()
        maintenance.process_queue(self.store, reaped_by=self.overseer_id,
                                  reachable_since=self.db_back_at, lease=self.lease)
        if self.db_lost_at is not None:
            outage.note_back(self.store.db)
            self.db_lost_at = None
        if not liveness.heartbeat(self.store, self.row_id, rss=self._process.memory_info().rss):
            log.warning("maintainer %d: its row was declared dead; exiting", self.row_id)
            self.stop_reason = "its row was declared dead"
            self.exit_code = self.EXIT_DISOWNED
            return
        if self.lease.held():
            self.scheduler.clear_stale_marks()
        self._plan_periodic()

    def run_periodic(self):
        """The lease holder only: submit due periodic tasks for up to one check_interval
        (or until a stop), then plan the next pass — at once if some are still due."""
        if self.lease.held():
            deadline = time.monotonic() + self.config.overseer.check_interval
            self.scheduler.run_pending(until=lambda: self.stop_reason is not None
                                       or time.monotonic() >= deadline)
        self._plan_periodic()

    def _plan_periodic(self):
        # Due times are on the database's clock: so is the wait until the next one.
        due = self.scheduler.next_due() if self.lease.holding else None
        wait = float("inf") if due is None else (
            due - self.store.database_time()).total_seconds()
        self.next_periodic = self.now + max(0.0, wait)

    # -- the loop -----------------------------------------------------------------------

    def run(self):
        """The body of the forked maintainer; returns its exit code."""
        self.signal_pipe.install()
        try:
            while (wake := self.tick(time.monotonic())) is not None:
                self.signal_pipe.sleep(wake - time.monotonic())
        finally:
            self.shutdown()
        return self.exit_code

    def tick(self, now):
        """One pass at monotonic time `now`: a sign of life, then whatever is due. Returns
        the monotonic time to wake at, or None when the maintainer is done."""
        self.now = now
        self.notify()
        if self.stop_reason is None and os.getppid() != self.overseer_pid:
            # The kernel's death signal may have been set too late, after the overseer died.
            self.stop_reason = "overseer %d is gone" % self.overseer_pid
        if self.stop_reason is not None:
            return None
        interval = self.config.overseer.check_interval
        if self.row_id is None:
            self._guarded(self.start)
            if self.row_id is None:
                return now + interval
        if now >= self.next_check:
            self.next_check = now + interval
            self._guarded(self.check)
        if self.stop_reason is None and now >= self.next_periodic:
            # Planned again by a pass that succeeds; after a database error, the next try
            # is one check_interval away, not at once.
            self.next_periodic = now + interval
            self._guarded(self.run_periodic)
        return min(self.next_check, self.next_periodic)

    def _guarded(self, step):
        """No exception from one step ends the maintainer: a database hiccup is logged in one
        line (an outage once; `check` logs its end), anything else with its traceback; the
        step is tried again at a later tick."""
        try:
            step()
        except (pw.OperationalError, pw.InterfaceError) as exc:
            # An outage — a lost connection, a full or read-only disk — is logged when it
            # begins and when `check` gets through again (outage.note_lost, note_back).
            if outage.note_lost(self.store.db, exc):
                if self.db_lost_at is None:
                    self.db_lost_at = self.now
            elif self.db_lost_at is None:
                log.warning("database error (will retry): %s", outage.first_line(exc))
            outage.close_quietly(self.store.db)
        except Exception:
            log.exception("%s failed (will retry)", getattr(step, "__name__", "a step"))
            outage.close_quietly(self.store.db)

    def shutdown(self):
        """Release the lease and retire the row (its lease goes with it anyway)."""
        if self.lease is not None:
            self._guarded(self.lease.release)
        if self.row_id is not None:
            self._guarded(lambda: liveness.retire(self.store, self.row_id, self.stop_reason))
        outage.close_quietly(self.store.db)
        log.info("maintainer %s exiting: %s", self.row_id, self.stop_reason)


class MaintainerProcess:
    """The overseer's side of its maintainer: when to fork one (`due`, `started`), signs of
    life (`listen`, `hung`), its exit (`exited`), a stop or a reload (`retire`, `kill`). The
    overseer forks it like a runner, in a process group of its own (a group signal reaches it
    through the overseer, once) and with a notify pipe (`pipe`, the read end)."""

    RESTART_DELAY = 1.0          # after an exit, the next start waits this long
    STOP_WAIT = 2.0              # after TERM, KILL: what it was doing is a transaction

    def __init__(self):
        self.pid = None
        self.pipe = None
        self.heard_at = None
        self.next_start = 0.0
        self.kill_at = None           # TERM sent: KILL at this time if it is still there
        self.killed = None            # why the overseer KILLed it

    def due(self, now):
        """Whether the overseer should fork a maintainer now."""
        return self.pid is None and now >= self.next_start

    def started(self, pid, pipe, now):
        self.pid, self.pipe, self.heard_at = pid, pipe, now
        self.kill_at = self.killed = None

    def listen(self, now):
        """Read its signs of life; returns for how long it has been silent."""
        if self.pipe is not None:
            with contextlib.suppress(BlockingIOError):
                while os.read(self.pipe, 4096):
                    self.heard_at = now
        return now - self.heard_at if self.pid is not None else 0.0

    def retire(self, now):
        """TERM once: it finishes its step and exits; KILLed after STOP_WAIT."""
        if self.pid is not None and self.kill_at is None:
            self.kill_at = now + self.STOP_WAIT
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill(self, why):
        if self.pid is not None and self.killed is None:
            log.warning("%s: killing the maintainer, pid %d", why, self.pid)
            self.killed = why
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def exited(self, pid, code, now, stopping=False):
        """The overseer reaped it, pid `pid`: the next one starts RESTART_DELAY later, or at
        once after a clean exit on TERM (a reload)."""
        clean = code == 0 and self.kill_at is not None
        if not clean and not stopping:
            log.warning("maintainer pid %d exited with %s; starting another", pid,
                        "signal %s" % signal.Signals(-code).name if code < 0
                        else "exit code %d" % code)
        self.next_start = now if clean else now + self.RESTART_DELAY
        self.pid = self.kill_at = None
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None
