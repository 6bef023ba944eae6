"""The run a runner executes now, as its two threads share it. The main thread creates a
CurrentRun for each run and closes it once the handler has returned; the heartbeat thread
(heartbeat.py) keeps the object it examined and writes what it decides — cancelled by an
operator, interrupted — to that object only, under its lock, and a closed run takes nothing.
So a decision about one run never lands on the next, however the two threads interleave
(seen: a cancel that reached run A as it finished ended the runner's next run, B, cancelled).
"""
import threading
import time


class CurrentRun:
    """One run in a runner's hands. Set when it is created: `claimed` (a ClaimedRun) and
    `hard_deadline` (naive UTC, from its max_runtime, or None). The main thread sets
    `context` (the handler's RunContext) and `in_handler` while the handler runs, and closes
    the run when the handler returned; the heartbeat sets `cancel_reason` (an operator
    cancelled it), `abort_reason` (it is interrupted: taken away, or past max_runtime) and
    `abort_deadline` (monotonic), when kill_grace after either runs out. Every write is made
    under `lock`; a single attribute may be read without it. `chunk_ids`: the ids of every
    run of a chunk (runner/chunks.py: `claimed` is its first), None for a run alone."""

    chunk_ids = None

    def __init__(self, claimed, hard_deadline=None):
        self.claimed = claimed
        self.hard_deadline = hard_deadline
        self.lock = threading.Lock()
        self.closed = False
        self.context = None
        self.in_handler = False
        self.cancel_reason = None
        self.abort_reason = None
        self.abort_deadline = None

    def stopping(self):
        """Why the handler is asked to stop (interrupted, or cancelled), or None."""
        return self.abort_reason or self.cancel_reason

    # -- the main thread

    def enter_handler(self, context):
        with self.lock:
            self.context, self.in_handler = context, True

    def close(self):
        """The handler has returned, or never ran: the heartbeat's decisions end here. The
        context is let go (its callbacks refer to this run: a cycle the garbage collector
        would otherwise have to find, after every run)."""
        with self.lock:
            self.in_handler, self.closed, self.context = False, True, None

    # -- the heartbeat thread

    def cancel(self, reason, grace):
        """An operator cancelled the run: should_stop() turns true, and the handler is
        interrupted if it still runs `grace` (kill_grace) from now. False when the run was
        closed (or cancelled) meanwhile."""
        with self.lock:
            if self.closed or self.cancel_reason is not None:
                return False
            self.cancel_reason = reason
            self.abort_deadline = time.monotonic() + grace
            return True

    def abort(self, reason, deadline):
        """Interrupt the run: the caller sends the abort signal when this returns True, and
        exits hard at `deadline` (monotonic) if the run is still not closed. False when the
        handler returned meanwhile: its own outcome stands."""
        with self.lock:
            if self.closed:
                return False
            self.abort_reason, self.abort_deadline = reason, deadline
            return True
