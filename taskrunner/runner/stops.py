"""A runner's stop signals from its first moment. The commands that become a runner
(``taskrunner runner``, ``run-event task-runner:OnProcess``) hold TERM, HUP and INT before
they read their config or open the database, and the runner (loop.Runner) replays the
signals held once its own handlers are in place, before it registers. A supervisor's HUP or
TERM that reaches a runner while it starts is then a graceful stop — it exits 0 without
registering or claiming — never the signal's default action (death, exit 129 or 143)."""
import signal

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def hold():
    """From now on, keep every stop signal without acting on it (the process cannot act
    yet); returns the list of their numbers, in order of arrival, for Runner(held_stops=)."""
    held = []
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), lambda signum, frame: held.append(signum))
    return held
