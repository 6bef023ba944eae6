"""The overseer: the pre-fork parent that supervisord or systemd starts.

It registers itself (kind ``overseer``), forks runners up to ``[runner] limit`` (``limit``
of them for each ``[queues.NAME]``, the rest serving ``default``) and keeps them alive,
reaps and replaces the ones that exit (with a backoff when they fail before registering;
after ``max_start_failures`` in a row it stops as on TERM and exits 1), and keeps two more
children: the wake-up hub (hub.py) and the maintainer (maintainer.py), which does the
database maintenance — the queue pass for this host and, while it holds the lease, the fleet
(rule 7 for runners of other hosts and hung ones), the periodic scheduler and so rotation.
Runs that time out are stopped by the runners executing them (rule 8, see runner/).

So the overseer's loop is about processes: signals, forks, reaps, its children's signs of
life. What it still writes itself is about its own children, because only it knows why each
died: the row (and runs) of a child it reaped — a crash, or killed by its own stop, whose runs
are handed back — and its own heartbeat and retirement. These go through a bounded store
(Store patience, BRIEF): no statement waits longer than half a second for a lock or a
connection, and none is tried twice in a row; one the database refuses is tried again at the
next check, and at the end is left to the next start's sweep. Reading which children
registered and how many runners others started on this host is bounded likewise. So a locked
or unreachable database never delays a stop, a reap or a fork for longer than one short
statement; the maintainer waits on it instead, and is killed when it hangs.

Every decision is made in `tick(now)` with the monotonic clock passed in (tests inject it);
`run()` only sets up, ticks and sleeps. Signal handlers only record: TERM/INT graceful stop
(a second: fast), QUIT immediate, HUP reload and replace the runners and the maintainer,
TTIN/TTOU one runner more/less. No database connection crosses a fork, and the overseer
imports no handler module (runners forked after HUP run the code on disk).
"""
import contextlib
import logging
import os
import random
import signal
import time

import peewee as pw
import psutil

from ..fleet import liveness
from ..periodic import scheduler as periodic
from ..runs import queues
from ..host import wakeup
from ..config import Config
from ..errors import ConfigError, InputError, RunnerLimitReached
from ..host.hub import HubProcess
from ..store.models import DEFAULT_QUEUE, OVERSEER
from ..api import TaskQueue
from ..runner.loop import Runner
from ..store import outage
from ..store.bound import BRIEF, Store
from .maintainer import Maintainer, MaintainerProcess
from .signals import SignalPipe

log = logging.getLogger("taskrunner.overseer")

# A runner that dies of these (or exits non-zero) crashed by itself, not killed by someone.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)


class Child:
    """One forked runner, as the overseer sees it (the hub and the maintainer are kept by
    HubProcess and MaintainerProcess)."""

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
        periodic.install_hooks()     # for its forked runners too
        self.store = Store(config, patience=BRIEF)
        self.now = time.monotonic()   # the clock of the current tick
        self.pid = os.getpid()
        self._process = psutil.Process(self.pid)
        self.row_id = None
        self.children = {}
        self.num_runners = config.runner.limit
        self.stored_limits = {}       # {queue: limit stored on its row} (`queue limit`)
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
        self.marks = []               # (pid, reason, stopped) of children reaped, to mark
        self.db_lost_at = None        # tick time of the first failure of a database streak
        self.db_refused_at = None     # tick time of the last statement the database refused
        self.signal_pipe = SignalPipe(self.SIGNALS, self._on_signal)
        self.hub = HubProcess(self.store.wakeup_directory, config.queues,
                              wakeup.listen_url(config.database))
        self.maintainer = MaintainerProcess()

    # -- signals ------------------------------------------------------------------------

    def _on_signal(self, signum, frame):  # record only; SIGCHLD just wakes the loop to reap
        if signum != signal.SIGCHLD:
            self.signals.append(signum)

    def handle_term(self):
        """Graceful stop; a second one stops fast."""
        self._begin_stop()

    handle_int = handle_term

    def handle_quit(self):
        self.stopping = "immediate"

    def handle_hup(self):
        """Reload the config; the maintainer that replaces the current one syncs its
        periodic definitions (checked here first: a bad file keeps the old config)."""
        try:
            config = Config.load(self.config_path, self.database_url)
            if config.database.url != self.config.database.url:
                raise ConfigError("[database] url cannot change while running")
            periodic.check_periodic_handlers(config)
            periodic.validate_definitions(config, import_handlers=False)
        except (ConfigError, InputError) as exc:
            log.error("reload failed, keeping the current config: %s", exc)
            return
        log.info("config reloaded from %s; replacing runners and the maintainer", config.source)
        for warning in config.warnings:
            log.warning("%s", warning)
        self.config = self.store.config = config
        self.num_runners = config.runner.limit
        self.groups = config.queue_groups(self.stored_limits)
        self.hub.restart(config.queues)
        self.maintainer.retire(self.now)
        self.next_manage = 0.0
        for child in self.children.values():
            # HUP, not TERM: the handler learns it is a reload (run.stop_reason "hup").
            self._retire(child, signal.SIGHUP)

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
            self.maintainer.retire(self.now)
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

    def _retire(self, child, sig=signal.SIGTERM):
        """TERM (HUP for a reload): finish the current run, claim nothing more, exit."""
        if not child.retiring:
            child.retiring = True
            self._signal(child.pid, sig)

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

    def start_maintainer(self):
        """Fork the maintainer (maintainer.py) unless it runs, with the write end of its
        notify pipe. It dies with the overseer by KILL: all it does is transactions."""
        if self.stopping or not self.maintainer.due(self.now):
            return
        pipe, notify = os.pipe()
        for fd in (pipe, notify):
            os.set_blocking(fd, False)
        try:
            pid = self._fork(lambda: Maintainer(self.config, self.row_id, self.pid, notify).run(),
                             "maintainer", "tr-maintainer", signal.SIGKILL, close=(pipe,))
        except BaseException:
            os.close(pipe)
            raise
        finally:
            os.close(notify)
        self.maintainer.started(pid, pipe, self.now)

    def watch_maintainer(self):
        """Its signs of life: silent for heartbeat_timeout, it is hung; told to stop and still
        there after STOP_WAIT, it is stuck (in the database): KILLed either way, and the
        next one takes over."""
        maintainer = self.maintainer
        if maintainer.pid is None:
            return
        silent = maintainer.listen(self.now)
        if maintainer.kill_at is not None and self.now >= maintainer.kill_at:
            maintainer.kill("it did not stop within %gs of TERM" % maintainer.STOP_WAIT)
        elif silent > self.config.overseer.heartbeat_timeout:
            maintainer.kill("hung: no sign of life for over %gs (heartbeat_timeout)"
                            % self.config.overseer.heartbeat_timeout)

    def _fork(self, body, what, name=None, death_signal=signal.SIGTERM, close=()):
        """Fork a child running `body()` (its exit code; it never returns into the loop);
        returns its pid. No connection crosses the fork, nor any of the overseer's pipes but
        what `body` needs (`close`: more of them to close in the child). The child has its
        own process group: KILL takes a handler's subprocesses along, and a signal to the
        overseer's group (supervisord, Ctrl-C) reaches the child only through the overseer,
        once. The kernel sends it `death_signal` when the overseer dies."""
        self.store.close()
        previous = liveness.name_process(name) if name else None   # the child is born named
        pid = os.fork()
        if pid:
            if previous:
                liveness.name_process(previous)
            return pid
        code = 1
        try:
            self.signal_pipe.uninstall_in_child()
            for fd in (self.maintainer.pipe,) + tuple(close):
                if fd is not None:
                    os.close(fd)
            liveness.die_with_parent(death_signal)
            os.setpgid(0, 0)
            code = body()
        except BaseException:
            log.exception("%s crashed", what)
        finally:
            logging.shutdown()
        os._exit(code)

    def run_child(self, jitter):
        """The body of a forked runner; returns its exit code."""
        worker = Runner(Store(self.config), parent_pid=self.pid, parent_id=self.row_id,
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
            if pid == self.maintainer.pid:
                killed = self.maintainer.killed
                self.maintainer.exited(pid, code, self.now, bool(self.stopping))
                self.marks.append((pid, "killed by the overseer: %s" % killed if killed
                                   else "exited with %s" % _describe_exit(code), False))
                self.next_check = 0.0
                continue
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
            self.marks.append((pid, reason, bool(child.killed_by_stop)))
            self.next_check = self.next_manage = 0.0

    def _registered(self, pid):
        """Did this child register its runner row? (False when the database cannot say.)"""
        if self._refused():
            return False
        try:
            return liveness.child_registered(self.store, self.row_id, pid)
        except (pw.OperationalError, pw.InterfaceError):
            self.db_refused_at = self.now
            return False

    def _refused(self):
        """Whether the database refused a statement in this tick: the tick tries no other
        (each waits up to the store's patience; libpq's connect at least 2 s)."""
        return self.db_refused_at == self.now

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
                # A graceful stop like TERM's: the runners that did start finish their run
                # (or hand it back at graceful_timeout); no one is killed at once.
                log.error("giving up: %s", self.exit_reason)
                self._begin_stop()
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
        slots = None
        for group in set(wanted) | {c.serving for c in self.children.values()}:
            active = [c for c in self.children.values()
                      if not c.retiring and c.serving == group]
            surplus = len(active) - wanted.get(group, 0)
            if surplus <= 0:
                continue
            # Highest slot first, then the oldest: after a queue's limit was lowered, the
            # runners above it (which claim nothing more) go, not those within it.
            slots = slots if slots is not None else liveness.children_queue_slots(
                self.store, self.row_id)
            for child in sorted(active, key=lambda c: (-slots.get(c.pid, 0), c.started)
                                )[:surplus]:
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
        """Once per check_interval, and at once after a child exited: the rows of the
        children reaped since, then this overseer's heartbeat — bounded statements; the
        database's maintenance is the maintainer's."""
        self.mark_children()
        if not liveness.heartbeat(self.store, self.row_id, rss=self._process.memory_info().rss):
            self.register_again()
        self.read_queue_limits()
        if self.db_lost_at is not None:
            log.info("database answering again after %.1fs", self.now - self.db_lost_at)
            self.db_lost_at = None

    def read_queue_limits(self):
        """The per-host limits stored on the configured queues' rows (``queue limit``): a
        change resizes the runners kept for those queues at once (more are started; those
        above a lowered limit, which claim nothing more, are retired)."""
        stored = queues.host_limits(self.store, self.config.queues)
        if stored != self.stored_limits:
            log.info("queue limits stored: %s", ", ".join(
                "%s=%d" % item for item in sorted(stored.items())) or "none (the config's)")
            self.stored_limits = stored
            self.groups = self.config.queue_groups(stored)
            self.next_manage = 0.0

    def register_again(self):
        """Its row was declared dead while it lived (cut off from the database for longer
        than heartbeat_timeout): it registers again, so that no live process of this host
        goes unseen by the fleet, and replaces its maintainer, which works for the old row
        (its runners, declared dead with it, exit by themselves and are replaced)."""
        old = self.row_id
        self.row_id = liveness.register_again(self.store, old).id
        log.warning("overseer row %d was declared dead; registered again as %d", old,
                    self.row_id)
        self.maintainer.retire(self.now)

    def mark_children(self):
        """Each child reaped since: its row, if it did not retire, and its runs end now
        (rule 7) — handed back when this overseer's stop killed it. In order; the first the
        database refuses stops the rest until the next try."""
        while self.marks:
            pid, reason, stopped = self.marks[0]
            liveness.mark_child_dead(self.store, self.row_id, pid, reason, stopped=stopped)
            self.marks.pop(0)

    # -- the loop -----------------------------------------------------------------------

    def prepare(self):
        """Before the first tick: migrate, sweep what earlier processes of this host left
        behind (dead PIDs, an older boot), check the periodic definitions (the maintainer
        syncs them), register. The one time the overseer waits on the database for as long
        as it takes, with a store of its own: it cannot start without its row."""
        periodic.check_periodic_handlers(self.config)
        periodic.validate_definitions(self.config, import_handlers=False)
        for warning in self.config.warnings:
            log.warning("%s", warning)
        store = Store(self.config)
        try:
            store.migrate()
            swept = liveness.refresh_runners(store, other_hosts=False,
                                             crash_grace=self.config.overseer.crash_grace)
            if swept:
                log.info("swept %d stale runner rows", len(swept))
            self.row_id = liveness.register(store, kind=OVERSEER).id
        finally:
            store.close()
        liveness.name_process("tr-overseer")
        log.info("overseer %d started (pid %d): %d runners, check every %gs", self.row_id,
                 self.pid, self.num_runners, self.config.overseer.check_interval)

    def run(self):
        self.signal_pipe.install()
        self.prepare()
        try:
            while (delay := self.tick(time.monotonic())) is not None:
                self.signal_pipe.sleep(delay)
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
        self.watch_maintainer()
        if self.stopping == "immediate" or (self.stopping and self._stopped()):
            return None
        if now >= self.next_check and not self.stopping and not self._refused():
            # A stopping overseer marks its children once, at the end (shutdown): a database
            # that refuses meanwhile must not hold up the KILL at the deadline.
            self.next_check = now + self.config.overseer.check_interval
            self._guarded(self.check)
        self.start_hub()                # before the first runner; again if it died
        self._guarded(self.start_maintainer)
        if not self._refused():
            self._guarded(self.manage_runners)
        wake = self.stop_deadline if self.stopping else self.next_check
        if self.maintainer.kill_at is not None:
            wake = min(wake, self.maintainer.kill_at)
        return max(0.0, min(wake - now, 1.0))

    def _guarded(self, step):
        """No exception from one step ends the overseer: a database that refuses a bounded
        statement (busy, locked, unreachable, a full or read-only disk) is logged once until `check` gets through
        again, anything else with its traceback; the step is tried again at a later tick."""
        try:
            step()
        except (pw.OperationalError, pw.InterfaceError) as exc:
            self.db_refused_at = self.now
            if self.db_lost_at is None:
                self.db_lost_at = self.now
                log.warning("database %s to the overseer (%s); retrying at each check",
                            "unwritable" if outage.is_unwritable(exc) else "unavailable",
                            outage.first_line(exc))
            outage.close_quietly(self.store.db)
        except Exception:
            log.exception("%s failed (will retry)", getattr(step, "__name__", "a step"))
            outage.close_quietly(self.store.db)

    def _stopped(self):
        """During a stop: True once every child is gone; KILL the runners at the deadline
        (the maintainer gets STOP_WAIT: watch_maintainer)."""
        if not self.children:
            return self.maintainer.pid is None
        if self.now >= self.stop_deadline:
            for child in self.children.values():
                child.killed_by_stop = "graceful_timeout" if self.stopping == "graceful" \
                    else "kill_grace of a fast stop"
                self._kill(child, child.killed_by_stop)
            self.stop_deadline = float("inf")
        return False

    def shutdown(self):
        """After the last tick: KILL what is left, mark the rows of the children reaped and
        killed, retire this overseer — bounded statements, tried once: what the database
        refuses now is swept by the next overseer's start (by PID, as crashes)."""
        for child in list(self.children.values()):
            self._kill(child, "overseer stopping")
        self.maintainer.kill("overseer stopping")
        for pid in list(self.children) + [p for p in [self.maintainer.pid] if p]:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            self.marks.append((pid, "killed at overseer stop", True))
        self.children.clear()
        if self.maintainer.pid is not None:
            self.maintainer.exited(self.maintainer.pid, -signal.SIGKILL, self.now, True)
        if self.row_id is not None:
            self._guarded(self.mark_children)
            if not self.marks:
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
