"""The faults a verify session injects into its own runner processes, as the user allows:
``kill`` (kill -9 a runner mid-run), ``stop`` (SIGSTOP a runner for STOP_SECONDS, longer than
its run's run_timeout, then SIGCONT: it comes back late, after its run was timed out and run
again elsewhere), ``restart-db`` (the command the user gave, run as is: no shell)."""
import os
import random
import signal
import subprocess
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
        self.stopped = {}          # pid -> monotonic time to continue it
        self.counts = {kind: 0 for kind in self.kinds}
        self.next_at = time.monotonic() + self.rng.uniform(*GAP)

    def tick(self, pids):
        """Continue the runners whose stop is over; inject the next fault when due."""
        now = time.monotonic()
        for pid, until in list(self.stopped.items()):
            if now >= until:
                self._continue(pid)
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
                os.kill(pid, signal.SIGSTOP)
                self.stopped[pid] = now + STOP_SECONDS
        except ProcessLookupError:
            return
        self.counts[kind] += 1

    def _continue(self, pid):
        self.stopped.pop(pid, None)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def end(self):
        """No runner is left stopped."""
        for pid in list(self.stopped):
            self._continue(pid)
