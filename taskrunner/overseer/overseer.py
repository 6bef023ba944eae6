"""The overseer: the pre-fork parent that supervisord or systemd starts.

It registers itself (kind ``overseer``), forks runners up to ``[runner] limit`` (``limit``
of them for each ``[queues.NAME]``, the rest serving ``default``) and keeps them alive,
reaps and replaces the ones that exit (with a backoff when they fail before registering,
and a non-zero exit if that goes on), checks every runner of this host every
``[overseer] check_interval`` (rule 7: PID, and heartbeat for hung runners) and, while it
holds the maintenance lease (leadership.py), processes the queue for the whole fleet and
runs the periodic scheduler (rotation is one of its periodic tasks). Runs that time out
are stopped by the runners executing them (rule 8, see runner.py).

Every decision is made in `tick(now)` with the monotonic clock passed in (tests inject it);
`run()` only sets up, ticks and sleeps. Signal handlers only record: TERM/INT graceful stop
(a second: fast), QUIT immediate, HUP reload and replace the runners, TTIN/TTOU one runner
more/less. No database connection crosses a fork; the wake-up hub is a child (hub.py). An
outage is logged once and waited out; heartbeats are judged only heartbeat_timeout after it
(`db_back_at`, Store.writable_since).
"""
import contextlib
import logging
import os
import random
import select
import signal
import time

import peewee as pw
import psutil

from ..fleet import leadership, liveness, maintenance
from ..periodic import scheduler as periodic
from ..host import wakeup
from ..config import Config
from ..store.db import is_disconnect
from ..errors import ConfigError, InputError, RunnerLimitReached
from ..host.hub import HubProcess
from ..store.models import DEFAULT_QUEUE, OVERSEER, utcnow
from ..api import TaskQueue
from ..runner.process import Worker
from ..store.bound import Store

log = logging.getLogger("taskrunner.overseer")

# A runner that dies of these (or exits non-zero) crashed by itself, not killed by someone.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)


class Child:
    """One forked runner, as the overseer sees it."""

    def __init__(self, pid, started, serving):
        self.pid = pid
        self.started = started
        self.serving = serving     # the queues it serves (a key of Config.queue_groups())
        self.retiring = False      # told to stop (TERM sent); not counted as capacity
        self.interrupted = False   # USR1 sent: interrupt the handler
        self.killed_by_stop = None   # why this overseer's own stop KILLed it: its run is handed back


class Overseer:
    SIGNALS = ("SIGHUP", "SIGQUIT", "SIGINT", "SIGTERM", "SIGTTIN", "SIGTTOU", "SIGCHLD")
    EXIT_OK = 0
    EXIT_START_FAILED = 1
    # A child exits with this when the host is at its limit (not a crash).
    EXIT_LIMIT = 3
    START_WINDOW = 5.0           # a runner dying sooner than this after its start "failed to start"
    MAX_START_BACKOFF = 30.0
    CRASH_RESPAWN = 0.2          # a registered runner that crashed soon: the next one waits
    RECOUNT = 10                 # check_intervals between counts of others' runners

    def __init__(self, config, config_path=None, database_url=None):
        self.config = config
        self.config_path = config_path
        self.database_url = database_url
        self.store = Store(config)
        self.now = time.monotonic()   # the clock of the current tick
        self.pid = os.getpid()
        self._process = psutil.Process(self.pid)
        self.row_id = None
        self.children = {}
        self.num_runners = config.runner.limit
        self.groups = config.queue_groups()
        self.spawning = (DEFAULT_QUEUE,)
        self.signals = []
        self.stopping = None          # None, "graceful", "fast" or "immediate"
        self.stop_deadline = None
        self.start_failures = 0
        self.next_spawn_at = 0.0
        self.next_manage = 0.0        # manage_runners: at once after a change, else per check
        self.exit_code = self.EXIT_OK
        self.exit_reason = None
        self.next_check = 0.0
        self.scheduler = None
        self.lease = None             # the maintenance lease, as this overseer holds it or not
        self.next_periodic = 0.0
        self.db_lost_at = None        # tick time of the first failure of an outage
        self.db_back_at = None        # UTC of the attempt that found the database back
        self._wake_r = self._wake_w = None
        self.hub = HubProcess(self.store.wakeup_directory, config.queues,
                              wakeup.listen_url(config.database))

    # -- signals ------------------------------------------------------------------------

    def _setup_signals(self):
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w)
        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, frame):  # record only; SIGCHLD just wakes the loop to reap
        if signum != signal.SIGCHLD:
            self.signals.append(signum)

    def _sleep(self, timeout):
        """Until a signal or `timeout`."""
        if timeout > 0 and select.select([self._wake_r], [], [], timeout)[0]:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 512):
                    pass

    def handle_term(self):
        """Graceful stop; a second one stops fast."""
        self._begin_stop()

    handle_int = handle_term

    def handle_quit(self):
        self.stopping = "immediate"

    def handle_hup(self):
        try:
            config = Config.load(self.config_path, self.database_url)
            if config.database.url != self.config.database.url:
                raise ConfigError("[database] url cannot change while running")
            periodic.check_periodic_handlers(config)
            periodic.sync_definitions(self.store, config, import_handlers=False)
        except (ConfigError, InputError, pw.DatabaseError) as exc:
            # A database hiccup during a reload must not stop the overseer either.
            log.error("reload failed, keeping the current config: %s", exc)
            return
        self.next_periodic = 0.0
        log.info("config reloaded from %s; replacing runners", config.source)
        self.config = self.store.config = config
        self.num_runners = config.runner.limit
        self.groups = config.queue_groups()
        self.hub.restart(config.queues)
        self.next_manage = 0.0
        for child in self.children.values():
            self._retire(child)

    def handle_ttin(self, change=1):
        self.num_runners = max(0, min(self.num_runners + change, self.config.runner.limit))
        self.next_manage = 0.0
        log.info("runners wanted: %d", self.num_runners)

    def handle_ttou(self):
        self.handle_ttin(-1)

    def _begin_stop(self):
        if self.stopping is None:
            log.info("stopping gracefully: runners finish their current run (up to %gs)",
                     self.config.overseer.graceful_timeout)
            self.stopping = "graceful"
            self.stop_deadline = self.now + self.config.overseer.graceful_timeout
            for child in self.children.values():
                self._retire(child)
        elif self.stopping == "graceful":
            log.info("stopping fast: interrupting the runners' handlers")
            self.stopping = "fast"
            grace = self.config.overseer.kill_grace
            self.stop_deadline = min(self.stop_deadline, self.now + grace)
            for child in self.children.values():
                self._interrupt(child)

    # -- children -----------------------------------------------------------------------

    def _signal(self, pid, sig):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _kill(self, child, why):
        """KILL a child with its process group: the handler's own subprocesses go too."""
        log.warning("%s: killing runner pid %d", why, child.pid)
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self._signal(child.pid, signal.SIGKILL)

    def _retire(self, child):
        """TERM: finish the current run, claim nothing more, exit."""
        if not child.retiring:
            child.retiring = True
            self._signal(child.pid, signal.SIGTERM)

    def _interrupt(self, child):
        """USR1: the runner interrupts its handler and hands its run back. A signal of its
        own: a TERM that reaches a runner twice (its group and this overseer) only stops it."""
        self._retire(child)
        if not child.interrupted:
            child.interrupted = True
            self._signal(child.pid, signal.SIGUSR1)

    def spawn_runner(self, serving=(DEFAULT_QUEUE,)):
        jitter = random.randint(0, max(1, self.config.runner.max_runs // 10)) \
            if self.config.runner.max_runs else 0
        self.spawning = serving       # what the child serves
        pid = self._fork(lambda: self.run_child(jitter), "runner")
        self.children[pid] = Child(pid, self.now, serving)
        log.debug("spawned runner pid %d for queues %s", pid, ",".join(serving))
        return pid

    def start_hub(self):
        """Fork the wake-up hub (hub.py) unless it runs; it forks nothing itself."""
        if not self.stopping and self.hub.due(self.now):
            self.hub.started(self._fork(lambda: self.hub.serve(
                self.config.overseer.check_interval, self.pid), "wake-up hub", "tr-hub"))

    def _fork(self, body, what, name=None):
        """Fork a child running `body()` (its exit code; it never returns into the loop);
        returns its pid. No connection crosses the fork. The child has its own process group:
        KILL takes a handler's subprocesses along, and a signal to the overseer's group
        (supervisord, Ctrl-C) reaches the child only through the overseer, once."""
        self.store.close()
        previous = liveness.name_process(name) if name else None   # the child is born named
        pid = os.fork()
        if pid:
            if previous:
                liveness.name_process(previous)
            return pid
        code = 1
        try:
            for sig in self.SIGNALS:
                signal.signal(getattr(signal, sig), signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            liveness.die_with_parent(signal.SIGTERM)
            os.setpgid(0, 0)
            code = body()
        except BaseException:
            log.exception("%s crashed", what)
        finally:
            logging.shutdown()
        os._exit(code)

    def run_child(self, jitter):
        """The body of a forked runner; returns its exit code."""
        worker = Worker(Store(self.config), parent_pid=self.pid, parent_id=self.row_id,
                        serving=self.spawning, facade=TaskQueue)
        try:
            worker.work(max_runs=(self.config.runner.max_runs + jitter) or None)
            return 0
        except RunnerLimitReached as exc:
            log.info("runner not started: %s", exc)
            return self.EXIT_LIMIT

    def reap_runners(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            child = self.children.pop(pid, None)
            if child is None:
                self.hub.exited(pid, code, self.now, bool(self.stopping))
                continue
            self._account_exit(child, code, self._registered(pid))
            # Rows of runners that died without retiring are marked at once, not at the
            # next check (rule 7); a run this overseer's stop killed is handed back.
            reason = "exited with %s" % _describe_exit(code)
            if child.killed_by_stop:
                reason = "killed by the overseer's stop (%s)" % child.killed_by_stop
            self._guarded(lambda: liveness.mark_child_dead(
                self.store, self.row_id, pid, reason, stopped=bool(child.killed_by_stop)))
            # Its run may need a retry run now, not one check_interval later.
            self.next_check = self.next_manage = 0.0

    def _registered(self, pid):
        """Did this child register its runner row? (False when the database cannot say.)"""
        try:
            return liveness.child_registered(self.store, self.row_id, pid)
        except (pw.OperationalError, pw.InterfaceError):
            return False

    def _account_exit(self, child, code, registered=False):
        lived = self.now - child.started
        # A runner that registered has started, whatever its exit: a crash during a run
        # (os._exit in a handler, a segfault, kill -9) is a crash of that run, never a
        # failure to start.
        if code == self.EXIT_LIMIT:
            self.next_spawn_at = self.now + self.config.overseer.check_interval
        elif code != 0 and not child.retiring and not registered and lived < self.START_WINDOW:
            self.start_failures += 1
            delay = min(self.MAX_START_BACKOFF, 0.5 * 2 ** (self.start_failures - 1))
            self.next_spawn_at = self.now + delay
            log.error("runner pid %d failed at start (%s); %d in a row, next start in %.1fs",
                      child.pid, _describe_exit(code), self.start_failures, delay)
            if self.start_failures >= self.config.overseer.max_start_failures:
                self.exit_code = self.EXIT_START_FAILED
                self.exit_reason = ("runners keep failing at start (%d in a row, last: %s)"
                                    % (self.start_failures, _describe_exit(code)))
                self.stopping = self.stopping or "graceful"
                self.stop_deadline = self.stop_deadline or self.now
        else:
            if code != 0 and not child.retiring:
                log.warning("runner pid %d exited with %s", child.pid, _describe_exit(code))
                if lived < self.START_WINDOW and (code > 0 or -code in CRASH_SIGNALS):
                    # Crashing runs must not make the overseer fork in a tight loop.
                    self.next_spawn_at = max(self.next_spawn_at, self.now + self.CRASH_RESPAWN)
            if lived >= self.START_WINDOW or code == 0 or registered:
                self.start_failures = 0

    def manage_runners(self):
        """Keep the wanted number of runners of each queue group, within each queue's limit
        and the host's (rule 5): runners started by others (supervisord, cron) count, and are
        counted at once after a change (a child gone, a reload, TTIN/TTOU), else every RECOUNT
        checks (a runner refuses to register past the limit anyway)."""
        if self.now < self.next_manage:
            return
        self.next_manage = self.now + self.RECOUNT * self.config.overseer.check_interval
        wanted = self._wanted()
        for group in set(wanted) | {c.serving for c in self.children.values()}:
            active = [c for c in self.children.values()
                      if not c.retiring and c.serving == group]
            surplus = len(active) - wanted.get(group, 0)
            for child in sorted(active, key=lambda c: c.started)[:max(0, surplus)]:
                self._retire(child)
        if self.stopping or self.now < self.next_spawn_at:
            self.next_manage = min(self.next_manage, self.next_spawn_at)
            return
        # Retiring children still hold their slots: count them until they are gone.
        room = min(self.num_runners, self.config.runner.limit
                   - liveness.others_running(self.store, self.row_id)) - len(self.children)
        for group, count in wanted.items():
            have = sum(1 for c in self.children.values() if c.serving == group)
            for _ in range(max(0, min(count - have, room))):
                self.spawn_runner(group)
                room -= 1

    def _wanted(self):
        """{queues: runners wanted}: each configured queue's limit less the runners of this
        host that others started for it; then ``default`` — all within num_runners."""
        others = {} if self.stopping else liveness.others_serving(self.store, self.row_id)
        budget, wanted = self.num_runners, {}
        for group, count in self.groups.items():
            wanted[group] = max(0, min(count - others.get(group[0], 0), budget))
            budget -= wanted[group]
        return wanted

    # -- regular work -------------------------------------------------------------------

    def check(self):
        """Once per check_interval: this host's runners, our heartbeat; while holding the
        maintenance lease, the fleet's part too (other hosts' runners, overdue and missing runs,
        stale periodic marks, planning the periodic scheduler). A stopping overseer lets go."""
        if self.db_lost_at is not None:
            # If this pass gets through, the database is back as of now: heartbeats and
            # progress count from then (Store.writable_since).
            self.db_back_at = utcnow()
        if self.stopping:
            self.lease.release()
        maintenance.process_queue(self.store, own_children=frozenset(self.children),
                                  reachable_since=self.db_back_at, lease=self.lease)
        if self.db_lost_at is not None:
            log.info("database reachable again after %.1fs", self.now - self.db_lost_at)
            self.db_lost_at = None
        liveness.heartbeat(self.store, self.row_id, rss=self._process.memory_info().rss)
        if self.lease.held():
            self.scheduler.clear_stale_marks()
        self._plan_periodic()

    def run_periodic(self):
        """The lease holder only: submit due periodic tasks, then sleep until the next due
        time (replanned at every check: a new holder plans at once, and changes are seen)."""
        if self.lease.held():
            self.scheduler.run_pending()
        self._plan_periodic()

    def _plan_periodic(self):
        due = self.scheduler.next_due() if self.lease.holding else None
        wait = float("inf") if due is None else (due - utcnow()).total_seconds()
        self.next_periodic = self.now + max(0.0, wait)

    # -- the loop -----------------------------------------------------------------------

    def prepare(self):
        """Before the first tick: migrate, sweep what earlier processes of this host left
        behind (dead PIDs, an older boot), sync the periodic definitions, register."""
        self.store.migrate()
        swept = liveness.refresh_runners(self.store, other_hosts=False,
                                         crash_grace=self.config.overseer.crash_grace)
        if swept:
            log.info("swept %d stale runner rows", len(swept))
        periodic.check_periodic_handlers(self.config)
        periodic.sync_definitions(self.store, import_handlers=False)
        self.scheduler = periodic.PeriodicScheduler(self.store)
        self.scheduler.clear_stale_marks()
        self.row_id = liveness.register(self.store, kind=OVERSEER).id
        self.lease = leadership.Lease(self.store, self.row_id, OVERSEER)
        liveness.name_process("tr-overseer")
        log.info("overseer %d started (pid %d): %d runners, check every %gs", self.row_id,
                 self.pid, self.num_runners, self.config.overseer.check_interval)

    def run(self):
        self._setup_signals()
        self.prepare()
        try:
            while (delay := self.tick(time.monotonic())) is not None:
                self._sleep(delay)
        finally:
            self.shutdown()
        return self.exit_code

    def tick(self, now):
        """One pass of the loop at monotonic time `now`: handle the signals received, reap,
        check, run the scheduler, kill what is overdue, keep the runners. Returns how long to
        sleep before the next pass, or None when the overseer is done."""
        self.now = now
        while self.signals:
            name = signal.Signals(self.signals.pop(0)).name
            log.info("received %s", name)
            getattr(self, "handle_" + name[3:].lower())()
        self.reap_runners()
        if self.stopping == "immediate" or (self.stopping and self._stopped()):
            return None
        if now >= self.next_check:
            self.next_check = now + self.config.overseer.check_interval
            self._guarded(self.check)
        if not self.stopping and now >= self.next_periodic:
            # Planned again by a run that succeeds; after a database error, the next try is
            # one check_interval away, not at once.
            self.next_periodic = now + self.config.overseer.check_interval
            self._guarded(self.run_periodic)
        self.start_hub()                # before the first runner; again if it died
        self._guarded(self.manage_runners)
        wake = self.next_check if self.stopping else min(self.next_check, self.next_periodic)
        return max(0.0, min(wake - now, 1.0))

    def _guarded(self, step):
        """No exception from one step ends the overseer: a database hiccup is logged in one
        line (an outage once; `check` logs its end), anything else with its traceback; the
        step is tried again on a later tick."""
        try:
            step()
        except (pw.OperationalError, pw.InterfaceError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if is_disconnect(exc) and self.db_lost_at is None:
                self.db_lost_at = self.now
                log.warning("database unavailable (%s); retrying", text)
            elif self.db_lost_at is None:
                log.warning("database error (will retry): %s", text)
            self._close_quietly()
        except Exception:
            log.exception("%s failed (will retry)", getattr(step, "__name__", "a step"))
            self._close_quietly()

    def _close_quietly(self):
        with contextlib.suppress(pw.DatabaseError):
            self.store.close()

    def _stopped(self):
        """During a stop: True once every child is gone; KILL them at the deadline."""
        if not self.children:
            return True
        if self.now >= self.stop_deadline:
            for child in self.children.values():
                child.killed_by_stop = "graceful_timeout" if self.stopping == "graceful" \
                    else "kill_grace of a fast stop"
                self._kill(child, child.killed_by_stop)
            self.stop_deadline = float("inf")
        return False

    def shutdown(self):
        """After the last tick: KILL what is left, mark its rows, retire this overseer."""
        for child in list(self.children.values()):
            self._kill(child, "overseer stopping")
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self._guarded(lambda: liveness.mark_child_dead(
                self.store, self.row_id, pid, "killed at overseer stop", stopped=True))
        self.children.clear()
        if self.row_id is not None:      # retiring the row frees its lease (liveness)
            self._guarded(lambda: liveness.retire(self.store, self.row_id,
                                                  self.exit_reason or "stopped"))
        self.hub.stop()
        (log.error if self.exit_reason else log.info)(
            "overseer %s", "exiting: %s" % self.exit_reason if self.exit_reason else "stopped")


def _describe_exit(code):
    return "signal %s" % signal.Signals(-code).name if code < 0 else "exit code %d" % code


def run_overseer(config, config_path=None, database_url=None):
    """Entry point of ``taskrunner overseer``; returns the exit code."""
    return Overseer(config, config_path, database_url).run()
