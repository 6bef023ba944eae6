"""Batched acknowledgements (``[runner] batch`` > 1, off by default): a busy runner claims
up to `batch` runs in one transaction, executes them one by one, and records their successes
together — one commit for many jobs instead of one per job. A claim takes no more than the
runner's share of the queue's backlog among the runners running (sql.backlog_share): runs
added a few at a time go to as many runners. The share is read when the runner's last claim
came back short of what it asked (it was idle, or the backlog thin): while claims come back
full, the backlog is long and a full batch is its share.

When outcomes are written (a flush):
- when `batch` successes wait, or `flush_interval` after the first of them finished — by
  the runner between two runs, or by its flusher thread while a handler runs;
- when the runner's claimed runs are used up: the flush and the next claim are one transaction;
- when it goes idle (that claim found nothing) or stops (TERM, max_runs, memory_limit): its
  claimed runs not started yet are then given back, unstarted, in the same way a single
  claim is (lifecycle.release_runs_of).
Failures, retries, snoozes, cancels and runs of periodic tasks are not buffered: the runner
ends them at once (lifecycle.end_run), as without batching.

What the rules become:
- Rule 2: a batch is the first `batch` runs of the claim order (queue by queue), taken by the
  statement that claims one (runs/sql.py: a single claim is a batch of 1), under the same
  locks, and executed in that order.
- Rule 4: each buffered success is ended under the same condition as one (``status =
  'running' AND runner_id = ?``): a run timed out meanwhile keeps its ``timeout``.
- Rule 5: a queue's limit counts runners, and a concurrency key's slot is held from the run's
  creation, so a batch changes neither; a runner executes one run at a time whatever it holds.
- Rule 8: the run executing is watched by the heartbeat as always. The runs claimed but not
  started are re-read at most `flush_interval` before each start: a run timed out or handed
  elsewhere is skipped, one an operator cancelled is ended ``cancelled`` without running.
- A crash (kill -9) re-executes at most the unflushed successes and the claimed runs: all of
  them are ``running`` under the dead runner. The run executing and the unflushed successes
  become ``timeout`` (RunnerDied) like the run of any dead runner, each counted as a failed
  run of its task; the claimed runs it had not started go back to the queue unstarted (as
  a stopping runner gives them back: not a failure, not a new attempt) when the runner's
  death is noticed on its own host, which reads them from its claim file (claimfile.py);
  else they count as crashed too.
Every run the runner holds is ``running``, with started_on the time of its claim (run_timeout
and max_runtime count from there); `status` shows how many a runner holds (reads.py).
"""
import logging
import threading
import time
from collections import deque, namedtuple

import peewee as pw

from ..host import claimfile
from ..store import outage
from . import outcomes
from ..runs import lifecycle
from ..store.models import CANCELLED, RUNNING, SUCCESS, utcnow

log = logging.getLogger("taskrunner.runner")

# A success waiting to be written: what after_run needs once it is.
Done = namedtuple("Done", "claimed outcome finished_on elapsed handler context")


# -- claim many, end many, check the claimed (the statements: runs/statements/) --------------------

def end_successes(store, runner_id, done):
    """Inside the caller's write transaction: end ``success`` each run of `done` (Done
    entries) that is still ``running`` under `runner_id` (rule 4), and its task. Returns the
    ids of the runs ended."""
    return lifecycle.end_successes(store, runner_id, [
        (d.claimed.run_id, d.claimed.task_id, d.outcome.results, d.finished_on,
         d.claimed.periodic_task_id) for d in done])


def still_claimed(store, runner_id, claimed, now):
    """Inside the caller's write transaction: those of `claimed` (ClaimedRun, not started)
    still ``running`` under `runner_id`; one an operator cancelled meanwhile is ended
    ``cancelled`` here, never started (rule 8 for runs not started yet)."""
    Run = store.Run
    rows = {r.id: r for r in Run.select(Run.id, Run.status, Run.runner_id,
                                        Run.cancel_requested_on)
            .where(Run.id.in_([c.run_id for c in claimed]))}
    kept = []
    for run in claimed:
        row = rows.get(run.run_id)
        if row is None or row.status != RUNNING or row.runner_id != runner_id:
            log.warning("run %d of task %d was taken away (%s) before it started: skipped",
                        run.run_id, run.task_id, row.status if row else "deleted")
        elif row.cancel_requested_on is not None:
            lifecycle.end_in_transaction(store, run.run_id, run.task_id, CANCELLED, runner_id,
                                         None, "Cancelled",
                                         "cancelled by an operator before it started", now,
                                         run.periodic_task_id)
            log.info("run %d of task %d cancelled before it started", run.run_id, run.task_id)
        else:
            kept.append(run)
    return kept


def give_back(store, runner_id, keep=()):
    """Give back, unstarted, every run `runner_id` has ``running`` but those in `keep`
    (lifecycle.release_runs_of, run by run). Returns how many went back."""
    keep = set(keep)

    def step():
        ids = [r.id for r in lifecycle.runs_of_runner_query(store, runner_id)
               if r.id not in keep]
        return sum(lifecycle.release_runs_of(store, runner_id, only=i) for i in ids)
    return store.write(step)


# -- a runner's batch --------------------------------------------------------------------------

class Batch:
    """The runs one runner has claimed and not started (`claimed`), and the successes it
    has not written yet (`done`). The runner's main thread calls `next` before each run,
    `keep` after it and `close` when it stops; a flusher thread writes the successes that
    have waited `interval` while a handler runs. `lock` is held by whoever writes."""

    def __init__(self, store, runner_id, size, interval, held_queues=None):
        self.store, self.runner_id = store, runner_id
        self.held_queues = held_queues   # lifecycle.held
        self.size, self.interval = size, interval
        self.claimed = deque()
        self.short = True               # the last claim found fewer runs than it asked for
        self.done = []
        self.first_done_at = None       # monotonic time the oldest of `done` finished
        self.checked_at = None          # when `claimed` was last read from the database
        self.lock = threading.Condition()
        self.closed = False
        self.thread = None
        self.file = None              # claimfile.ClaimFile: what it holds, for its death

    def start(self):
        self.file = claimfile.ClaimFile(self.store.wakeup_directory, self.runner_id, self.size)
        self.thread = threading.Thread(target=self._flusher, name="flusher", daemon=True)
        self.thread.start()

    # -- the main thread

    def next(self, queues, now, limit):
        """The next run to start, or None when no run waits (the successes are written
        either way). Successes due are written first, together with a re-read of the claimed
        runs when it is older than `interval`, or with the next claim when none is left.
        `now`: a pinned clock, else None: the time the write holds its lock (`_write`)."""
        with self.lock:
            while True:
                if self.claimed:
                    if self._due() or time.monotonic() - self.checked_at >= self.interval:
                        self._write(now, check=True)
                    if self.claimed:
                        return self._starting()
                    continue
                self._write(now, claim=(queues, min(limit, self.size)))
                return self._starting() if self.claimed else None

    def _starting(self):
        """The next claimed run, counted started in the claim file before it starts."""
        if self.file is not None:
            self.file.starting()
        return self.claimed.popleft()

    def keep(self, claimed, outcome, now, elapsed, handler, context):
        """Buffer a success of a plain task (True), written by `next` or the flusher;
        anything else (False) the caller ends at once."""
        if outcome.status != SUCCESS or outcome.exc is not None \
                or claimed.periodic_task_id is not None:
            return False
        with self.lock:
            if not self.done:
                self.first_done_at = time.monotonic()
                self.lock.notify()
            self.done.append(Done(claimed, outcome, now, elapsed, handler, context))
        return True

    def give_back_lost_claims(self):
        """After the connection dropped during a flush or a claim: whether it committed is
        unknown, so every run ``running`` under this runner that it neither holds claimed nor
        has a success waiting for goes back to the queue."""
        with self.lock:
            keep = [r.run_id for r in self.claimed] + [d.claimed.run_id for d in self.done]
            count = give_back(self.store, self.runner_id, keep)
        if count:
            log.warning("gave back %d run(s) claimed as the connection was lost", count)

    def close(self, now):
        """The runner stops: write the successes, give back the runs not started. Returns
        how many were given back."""
        with self.lock:
            self.closed = True
            self.lock.notify()
            if self.done:
                self._write(now)
            count = 0
            if self.claimed:
                count = give_back(self.store, self.runner_id)
                self.claimed.clear()
            if self.file is not None:       # kept while runs it holds are not given back
                self.file.remove()
        if self.thread is not None:
            self.thread.join(timeout=5)
        return count

    def close_through(self, with_database, now, reason):
        """close(), through an outage as the end of a single run is (`with_database`: the
        runner's); an error is logged, never raised: the runner is exiting anyway."""
        try:
            count = with_database(lambda: self.close(now), reconnected=self.give_back_lost_claims)
        except Exception:
            log.exception("runner %d could not write its batch", self.runner_id)
            return
        if count:
            log.info("%d claimed run(s) given back unstarted: %s", count, reason)

    # -- writing

    def _due(self):
        return bool(self.done) and (len(self.done) >= self.size or
                                    time.monotonic() - self.first_done_at >= self.interval)

    def _write(self, now, check=False, claim=None):
        """With the lock held: in one write transaction, the successes waiting, the claimed
        runs re-read (`check`) or the next claim (`claim`: queues, how many); then each
        success is logged as stored, or as discarded when it had been timed out."""
        done, store = self.done, self.store

        def step():
            # The claim's time is read with the lock held, as a single claim's
            # (lifecycle._claim_now): the runs' started_on is when they were claimed.
            at = now or utcnow()
            ended = end_successes(store, self.runner_id, done) if done else set()
            if check:
                kept = still_claimed(store, self.runner_id, list(self.claimed), at)
            elif claim is not None:
                kept = lifecycle.claim_many(store, self.runner_id, claim[0], at, claim[1],
                                            share=self.short, held_queues=self.held_queues)
            else:
                kept = None
            return ended, kept
        ended, kept = store.write(step)
        if claim is not None:
            self.short = len(kept) < claim[1]
        if kept is not None:
            self.claimed = deque(kept)
            self.checked_at = time.monotonic()
            if self.file is not None:
                self.file.publish(r.run_id for r in self.claimed)
        self.done, self.first_done_at = [], None
        if len(ended) < len(done):
            ended |= lifecycle.ended_by(store, self.runner_id, [
                d.claimed.run_id for d in done if d.claimed.run_id not in ended])
        if ended:
            store.wake_waiters()
        for d in done:
            if d.claimed.run_id in ended:
                outcomes.after_run(store, d.claimed, d.outcome, d.elapsed, d.handler, d.context)
            else:
                log.warning("run %d of task %d finished success in %.3fs, but it had been ended "
                            "meanwhile (timeout); its outcome is discarded", d.claimed.run_id,
                            d.claimed.task_id, d.elapsed)

    def _flusher(self):
        """Write the successes that waited `interval` while the main thread is in a handler.
        A failure (an outage) is logged once and left to the next try or the main thread."""
        failing = False
        with self.lock:
            while not self.closed:
                if not self.done:
                    self.lock.wait()
                    continue
                delay = self.first_done_at + self.interval - time.monotonic()
                if delay > 0:
                    self.lock.wait(delay)
                    continue
                try:
                    self._write(self.done[-1].finished_on)
                    failing = False
                    outage.note_back(self.store.db)
                except (pw.DatabaseError, pw.InterfaceError) as exc:
                    if not outage.note_lost(self.store.db, exc) and not failing:
                        log.warning("writing %d finished run(s) failed: %s; the runner tries "
                                    "again", len(self.done), outage.first_line(exc))
                        failing = True
                    outage.close_quietly(self.store.db)
                    self.lock.wait(outage.RECONNECT_DELAY)
                except Exception:     # never let it die: the main thread would still flush
                    log.exception("writing finished runs failed")
                    self.lock.wait(outage.RECONNECT_DELAY)
        outage.close_quietly(self.store.db)
