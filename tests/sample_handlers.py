"""Handlers used by the tests. Executions are recorded in a file outside the database
(one line per execution, appended with O_APPEND), so a test can count them independently."""
import os
import select
import signal
import threading
import time

from taskrunner import TaskError, TaskHandler


def record(path, line):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_records(path):
    """[(task_id, run_id, pid)] of every recorded execution."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [tuple(int(x) for x in line.split()) for line in fh if line.strip()]


class Record(TaskHandler):
    """Records its execution; sleeps data["sleep"] seconds first if given."""

    def handle(self, run):
        if run.data.get("sleep"):
            time.sleep(run.data["sleep"])
        record(run.data["log"], "%d %d %d" % (run.task_id, run.id, os.getpid()))
        run.results = {"task": run.task_id}


class PausedRecord(TaskHandler):
    """Records its execution after waiting data["sleep"] seconds in select(): a relative
    timeout, which a host clock shifted by libfaketime leaves alone (its clock_nanosleep,
    behind time.sleep, does not)."""

    def handle(self, run):
        select.select([], [], [], run.data["sleep"])
        record(run.data["log"], "%d %d %d" % (run.task_id, run.id, os.getpid()))


class Started(TaskHandler):
    """Writes a start marker, then sleeps data["sleep"] and records its execution."""

    def handle(self, run):
        record(run.data["log"] + ".started", "%d %d %d" % (run.task_id, run.id, os.getpid()))
        deadline = time.monotonic() + run.data.get("sleep", 1)
        while time.monotonic() < deadline:
            time.sleep(0.02)
        record(run.data["log"], "%d %d %d" % (run.task_id, run.id, os.getpid()))


class IgnoreTerm(TaskHandler):
    """Ignores SIGTERM while it sleeps (a badly behaved handler)."""

    def handle(self, run):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record(run.data["log"] + ".started", "%d %d %d" % (run.task_id, run.id, os.getpid()))
        time.sleep(run.data.get("sleep", 60))


class FailTimes(TaskHandler):
    """Fails its first data["fail"] attempts, then succeeds."""

    def handle(self, run):
        if run.attempt <= run.data.get("fail", 1):
            raise TaskError("attempt %d fails" % run.attempt, code="Planned")
        run.results = {"attempt": run.attempt}


class Boom(TaskHandler):
    def handle(self, run):
        raise ValueError("boom")


class Progress(TaskHandler):
    def handle(self, run):
        for pct in (10, 50, 90):
            run.progress(pct)
        run.results = {"done": True}


class NotAHandler:
    def handle(self, run):
        pass


class SlowFirstAttempt(TaskHandler):
    """Like Started, but only attempt 1 sleeps data["sleep"]; later attempts finish at once
    (for tests that kill the first attempt and let a retry succeed)."""

    def handle(self, run):
        record(run.data["log"] + ".started", "%d %d %d" % (run.task_id, run.id, os.getpid()))
        if run.attempt == 1:
            deadline = time.monotonic() + run.data.get("sleep", 1)
            while time.monotonic() < deadline:
                time.sleep(0.02)
        record(run.data["log"], "%d %d %d" % (run.task_id, run.id, os.getpid()))


class BackendPid(TaskHandler):
    """PostgreSQL: records "task run pid backend_pid" — the server backend of the connection
    this runner's store uses — then sleeps data["sleep"] if given."""

    def handle(self, run):
        backend = run.queue.store.db.execute_sql("SELECT pg_backend_pid()").fetchone()[0]
        record(run.data["log"], "%d %d %d %d" % (run.task_id, run.id, os.getpid(), backend))
        if run.data.get("sleep"):
            time.sleep(run.data["sleep"])


class Span(TaskHandler):
    """Appends "start TASK PID", sleeps data["sleep"] seconds, then appends "end TASK PID" to
    data["log"]: one O_APPEND file, so its lines are the true order of starts and ends."""

    def handle(self, run):
        record(run.data["log"], "start %d %d" % (run.task_id, os.getpid()))
        time.sleep(run.data.get("sleep", 1))
        record(run.data["log"], "end %d %d" % (run.task_id, os.getpid()))


class Crash(TaskHandler):
    """Kills its own runner process (a segfault, an os._exit in a library)."""

    def handle(self, run):
        os._exit(1)


class Timed(TaskHandler):
    """Appends "start TASK RUN PID T" when it starts and "stop TASK RUN PID T" when it
    leaves, however it leaves (monotonic clock, the same on the whole machine); sleeps
    data["sleep"]. With data["stubborn"], swallows every interruption and keeps sleeping."""

    def handle(self, run):
        log = run.data["log"]
        record(log, "start %d %d %d %.3f" % (run.task_id, run.id, os.getpid(), time.monotonic()))
        try:
            deadline = time.monotonic() + run.data.get("sleep", 1)
            while time.monotonic() < deadline:
                try:
                    time.sleep(0.02)
                except BaseException:
                    if not run.data.get("stubborn"):
                        raise
        finally:
            record(log, "stop %d %d %d %.3f" % (run.task_id, run.id, os.getpid(), time.monotonic()))


class Snooze(TaskHandler):
    """Snoozes its first data["times"] attempts for a minute, then succeeds."""

    def handle(self, run):
        from taskrunner import Retry
        if run.attempt <= run.data.get("times", 1):
            raise Retry(in_seconds=60, reason="rate limited, attempt %d" % run.attempt)
        run.results = {"attempt": run.attempt}


class Subprocess(TaskHandler):
    """Starts a `sleep` subprocess, records "TASK RUN RUNNER_PID CHILD_PID" in
    data["log"].started, and waits for it."""

    def handle(self, run):
        import subprocess
        child = subprocess.Popen(["sleep", "120"])
        record(run.data["log"] + ".started", "%d %d %d %d" % (run.task_id, run.id, os.getpid(),
                                                            child.pid))
        child.wait()


class Steady(TaskHandler):
    """Works data["seconds"], calling run.progress() every data["step"] seconds and 100 at
    the end; appends "start TASK RUN PID T" and "end TASK RUN PID T" (monotonic clock) to
    data["log"], or "raised TASK RUN PID T NAME" when an exception reached it."""

    def handle(self, run):
        log = run.data["log"]
        line = "%d %d %d" % (run.task_id, run.id, os.getpid())
        record(log, "start %s %.3f" % (line, time.monotonic()))
        try:
            deadline = time.monotonic() + run.data.get("seconds", 0.5)
            while time.monotonic() < deadline:
                run.progress(99 - 99 * (deadline - time.monotonic()) / run.data.get("seconds", 0.5))
                time.sleep(run.data.get("step", 0.05))
            run.progress(100)
        except BaseException as exc:
            record(log, "raised %s %.3f %s" % (line, time.monotonic(), type(exc).__name__))
            raise
        record(log, "end %s %.3f" % (line, time.monotonic()))


# In-process tests only: the events of Gated handlers, by name (see gate()).
GATES = {}


def gate(name):
    """(started, go): a Gated handler named `name` sets `started`, then waits for `go`."""
    return GATES.setdefault(name, (threading.Event(), threading.Event()))


class Gated(TaskHandler):
    """In-process only: signals that it started, then returns once the test lets it go (at
    most after 30 s, so that a failing test never hangs)."""

    def handle(self, run):
        started, go = gate(run.data["name"])
        started.set()
        go.wait(30)


class Report(Record):
    """Record, in the queue ``reports`` unless add_task names another."""
    queue = "reports"


_HELD = []


class Hold(TaskHandler):
    """Keeps data["mb"] MB of written memory for the rest of the process's life: its RSS
    grows by that much."""

    def handle(self, run):
        _HELD.append(b"\x01" * (run.data["mb"] * 1024 * 1024))
