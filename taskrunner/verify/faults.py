"""The faults a verify session injects into its own runner processes, as the user allows:
``kill`` (kill -9 a runner mid-run), ``stop`` (SIGSTOP a runner for STOP_SECONDS, longer than
its run's run_timeout, then SIGCONT: it comes back late, after its run was timed out and run
again elsewhere), ``restart-db`` (the command the user gave, run as is: no shell)."""
import os
import random
import signal
import subprocess
import threading
import time

FAULTS = ("kill", "stop", "restart-db")
STOP_SECONDS = 4.0
# Between two faults: enough for the fleet's pass to notice the last one.
GAP = (1.0, 2.0)


class Faults:
    """Injects one fault every GAP seconds into a random runner of `pids()` (live PIDs)."""

    def __init__(self, kinds, restart_db_command=None, seed=None):
        self.kinds = tuple(kinds)
        self.restart_db_command = restart_db_command
        self.rng = random.Random(seed)
        # pid -> the timer that continues it. A timer, not the session's loop: a runner
        # stopped inside a transaction holds its locks, and the session's own pass may wait
        # for one of them — the loop would never come round to continue it.
        self.stopped = {}
        self.lock = threading.Lock()
        self.counts = {kind: 0 for kind in self.kinds}
        self.next_at = time.monotonic() + self.rng.uniform(*GAP)

    def tick(self, pids):
        """Inject the next fault when due."""
        now = time.monotonic()
        if not self.kinds or now < self.next_at:
            return
        self.next_at = now + self.rng.uniform(*GAP)
        kind = self.rng.choice(self.kinds)
        if kind == "restart-db":
            subprocess.run(self.restart_db_command, check=False, timeout=120)
            self.counts[kind] += 1
            return
        candidates = sorted(pid for pid in pids if pid not in self.stopped)
        if not candidates:
            return
        pid = self.rng.choice(candidates)
        try:
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                with self.lock:
                    os.kill(pid, signal.SIGSTOP)
                    timer = self.stopped[pid] = threading.Timer(STOP_SECONDS, self._continue,
                                                                (pid,))
                    timer.daemon = True
                    timer.start()
        except ProcessLookupError:
            return
        self.counts[kind] += 1

    def _continue(self, pid):
        with self.lock:
            if self.stopped.pop(pid, None) is None:
                return
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def end(self):
        """No runner is left stopped."""
        for pid in list(self.stopped):
            self._continue(pid)
