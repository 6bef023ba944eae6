"""The overseer's decisions driven tick by tick with an injected clock: stop states, kill
deadlines and the start-failure backoff. The children are real forked processes that get
real signals; only the overseer's clock is the test's. Signals "received" are put where
the overseer's signal handler puts them (it only records them)."""
import os
import signal
import time

import pytest

from taskrunner.overseer.overseer import Overseer

from conftest import wait_for


class ScriptedOverseer(Overseer):
    """An overseer whose forked children follow a script instead of running a runner:
    ``stubborn`` logs every TERM and USR1 to a file and keeps running; ``fail`` exits 1 at once
    (dies before registering, as a broken deploy would)."""

    def __init__(self, config, behaviour, log):
        super().__init__(config)
        self.behaviour, self.log = behaviour, log

    def run_child(self, jitter):
        if self.behaviour == "fail":
            return 1
        with open(self.log, "a") as fh:
            fh.write("up %d\n" % os.getpid())

        def on_signal(signum, frame):
            with open(self.log, "a") as fh:
                fh.write("%s %d\n" % (signal.Signals(signum).name[3:], os.getpid()))
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGUSR1, on_signal)
        while True:
            time.sleep(0.05)


def lines(log, word):
    try:
        with open(log) as fh:
            return [line for line in fh.read().splitlines() if line.startswith(word)]
    except FileNotFoundError:
        return []


@pytest.fixture
def make_overseer(sqlite_db, tmp_path):
    made = []

    def make(behaviour, **overseer):
        config = sqlite_db.config(runner={"limit": 2}, overseer=dict(
            {"check_interval": 1, "graceful_timeout": 30, "kill_grace": 10}, **overseer))
        ov = ScriptedOverseer(config, behaviour, str(tmp_path / "children.log"))
        ov.prepare()
        made.append(ov)
        return ov
    yield make
    for ov in made:
        ov.hub.stop()
        for pid in list(ov.children) + [p for p in [ov.maintainer.pid] if p]:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        ov.store.close()


def tick_until(overseer, now, predicate, message):
    """Tick at the fixed time `now` (real time passes only so children can act)."""
    return wait_for(lambda: (overseer.tick(now), predicate())[1], timeout=20, message=message)


def test_second_term_stops_fast_and_kill_follows_after_kill_grace(make_overseer):
    ov = make_overseer("stubborn")
    t0 = 1000.0
    ov.tick(t0)
    assert len(ov.children) == 2
    tick_until(ov, t0, lambda: len(lines(ov.log, "up")) == 2, "both children up")

    ov.signals.append(signal.SIGTERM)
    assert ov.tick(t0 + 1) == 1.0             # it sleeps between ticks of a stop too
    assert ov.stopping == "graceful" and ov.stop_deadline == t0 + 1 + 30
    tick_until(ov, t0 + 1, lambda: len(lines(ov.log, "TERM")) == 2, "one TERM to each child")

    ov.signals.append(signal.SIGTERM)          # the operator insists
    ov.tick(t0 + 2)
    assert ov.stopping == "fast" and ov.stop_deadline == t0 + 2 + 10
    assert all(child.interrupted for child in ov.children.values())
    # Interrupting is USR1, a signal of its own: a TERM a runner gets twice only stops it.
    tick_until(ov, t0 + 2, lambda: len(lines(ov.log, "USR1")) == 2, "one USR1 to each child")
    assert len(lines(ov.log, "TERM")) == 2

    assert ov.tick(t0 + 11.9) is not None and len(ov.children) == 2    # before the deadline
    tick_until(ov, t0 + 12, lambda: not ov.children, "KILL at the deadline and the reap")
    assert ov.tick(t0 + 12) is None


def test_quit_stops_at_once(make_overseer):
    ov = make_overseer("stubborn")
    ov.tick(500.0)
    children = list(ov.children)
    ov.signals.append(signal.SIGQUIT)
    assert ov.tick(500.5) is None
    assert lines(ov.log, "TERM") == []       # no graceful phase at all
    ov.shutdown()
    assert not ov.children
    for pid in children:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_start_failures_back_off_exponentially_then_the_overseer_gives_up(make_overseer):
    ov = make_overseer("fail", max_start_failures=4)
    now = 100.0
    ov.tick(now)
    assert len(ov.children) == 2
    tick_until(ov, now, lambda: ov.start_failures == 2, "both failures counted")
    # 0.5 s after the first failure, 1 s after the second: nothing is started before.
    assert ov.next_spawn_at == now + 1.0
    ov.tick(now + 0.9)
    assert not ov.children
    ov.tick(now + 1.0)
    assert len(ov.children) == 2
    tick_until(ov, now + 1.0, lambda: ov.start_failures == 4, "four failures")
    assert ov.exit_code == Overseer.EXIT_START_FAILED
    assert "keep failing at start" in ov.exit_reason
    # Giving up is a graceful stop, as on TERM: whoever did start gets graceful_timeout.
    assert ov.stopping == "graceful" and ov.stop_deadline == now + 1.0 + 30
    tick_until(ov, now + 1.0, lambda: ov.maintainer.pid is None, "the maintainer to stop")
    assert ov.tick(now + 1.0) is None


def test_a_child_that_lived_past_the_start_window_resets_the_count(make_overseer):
    ov = make_overseer("stubborn")
    ov.tick(0.0)
    ov.start_failures = 3
    pid = next(iter(ov.children))
    os.kill(pid, signal.SIGKILL)
    tick_until(ov, Overseer.START_WINDOW + 1, lambda: pid not in ov.children, "the reap")
    assert ov.start_failures == 0


def test_an_idle_host_asks_the_database_for_its_slots_once_per_check_not_per_tick(
        make_overseer):
    """Between checks an overseer whose runners are all up asks the database nothing (it
    used to count the host's other runners at every tick, about twice a second per host);
    a change — a child gone, TTOU — is acted on at the next tick, not at the next check."""
    ov = make_overseer("stubborn", check_interval=30)
    t0 = 100.0
    ov.tick(t0)
    tick_until(ov, t0, lambda: len(lines(ov.log, "up")) == 2, "both children up")
    statements = []
    ov.store.db.connection().set_trace_callback(statements.append)
    for step in range(1, 20):
        ov.tick(t0 + step * 0.5)
    assert statements == []
    victim = next(iter(ov.children))
    os.kill(victim, signal.SIGKILL)            # a runner dies: replaced at the next tick
    tick_until(ov, t0 + 10, lambda: victim not in ov.children and len(ov.children) == 2,
               "the replacement")
    ov.signals.append(signal.SIGTTOU)          # one runner fewer: one retired at once
    ov.tick(t0 + 10.5)
    tick_until(ov, t0 + 10.5, lambda: len(lines(ov.log, "TERM")) == 1, "one runner retired")
