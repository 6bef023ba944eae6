"""A chunk handler's runs (chunks.py: ``handle_chunk`` takes many tasks in one call): when the
runner has claimed a run of one, it fills a chunk with more runs of that handler's queue —
up to ``chunk_size``, waiting up to ``chunk_within`` for them — calls the handler once, and
ends each run with its own outcome: the successes together in one transaction, the others
one by one, as a run of its own would end. A mixin of `loop.Runner`.

How the chunk is filled: by the claim of several runs of one queue (lifecycle.claim_many,
the statement a batch claims with: rule 2, the claim order, pauses and flow control as for
any claim). A chunk handler's tasks go to a queue of their own (its ``queue``, by default
its path), so the runs claimed are its own; a run of another handler found there is
executed on its own after the chunk. While it waits for more, it reads cheaply whether a
run waits (the claim index) every CHUNK_POLL, and a signal ends the wait at once. With
``--burst`` (and ``run_pending``) it does not wait: it takes what is there.
A plain run pays one look-up of its handler's class, which it loads anyway.

What the rules become:
- Rule 4: every end is conditional on the run still ``running`` under this runner — the
  successes by lifecycle.end_successes (one statement on PostgreSQL), the others by
  lifecycle.end_run — so a run timed out meanwhile keeps its ``timeout``.
- Rule 8: the heartbeat watches every run of the chunk (CurrentRun.chunk_ids): when one is
  no longer this runner's (timed out by anyone), or the earliest max_runtime of the chunk
  has passed, the handler is interrupted and every run still this runner's ends
  ``timeout``. An operator's cancel of one task does not interrupt the others: that task
  ends ``cancelled`` when the chunk returns, whatever the handler made of it.
- Rule 6: a runner killed mid-chunk (kill -9) leaves every run of the chunk ``running``
  under a dead runner: each ends ``timeout`` (RunnerDied) when its death is noticed and runs
  again, as any run of a dead runner; none is lost, none succeeds twice.
- A stop signal while the chunk fills gives its runs back unstarted; during the call, a
  stop hands them back as it hands back any run.
"""
import asyncio
import inspect
import json
import logging
import time
from datetime import timedelta

import peewee as pw

from . import batches, outcomes
from .. import tracing
from ..chunks import Chunk, ChunkHandler, ChunkItem, results_of_chunk
from ..errors import HandlerError
from ..runs import lifecycle
from ..store import outage
from ..store.models import CANCELLED, SUCCESS
from .current import CurrentRun
from .outcomes import Interrupted

log = logging.getLogger("taskrunner.runner")


class Chunks:
    """The execution of a chunk handler's runs, for `loop.Runner`."""
    CHUNK_POLL = 0.05           # seconds between two looks for more runs while filling

    def _chunk_handler(self, path):
        """The handler class of `path` when it takes chunks, else None (loaded once: a
        handler that cannot be loaded is left to the run's own execution to report)."""
        cls = self._handlers.get(path)
        if cls is None:
            try:
                cls = self._handler_class(path)
            except HandlerError:
                return None
        return cls if issubclass(cls, ChunkHandler) else None

    def execute_chunk(self, first, cls):
        """Fill a chunk from `first` (a ClaimedRun of `cls`), call the handler once and end
        each run. Returns None (the next claim is the loop's)."""
        claimed = self._fill_chunk(first, cls)
        mine = [c for c in claimed if c.handler == first.handler]
        others = [c for c in claimed if c.handler != first.handler]
        if self.stop_reason is not None:
            self._give_back_chunk(claimed)
            return None
        if len(claimed) > 1:
            # Taken away or cancelled while it filled: skipped, or ended cancelled.
            mine = self._with_database(lambda: self.store.write(lambda: batches.still_claimed(
                self.store, self.runner_id, mine, self.now())))
        if mine:
            self._run_chunk(cls, mine)
        for run in others:
            log.warning("run %d of task %d (%s) was claimed from the chunk queue %s: run on "
                        "its own", run.run_id, run.task_id, run.handler, cls.queue)
            self.execute(run)
        return None

    def _fill_chunk(self, first, cls):
        """`first` and up to chunk_size - 1 more runs of the handler's queue, waiting up to
        chunk_within for them (not in a burst, not once told to stop)."""
        claimed, size = [first], cls.chunk_size
        queue = cls.queue
        if size <= 1 or queue not in self._claim_order():
            return claimed
        store, runner_id = self.store, self.runner_id
        deadline = time.monotonic() + (0.0 if self.burst else cls.chunk_within)
        waiting = lifecycle.scheduled_runs_query(store, [queue])
        while True:
            want = size - len(claimed)
            claimed += self._with_database(
                lambda: store.write(lambda: lifecycle.claim_many(
                    store, runner_id, [queue], self.now(), want, share=False,
                    held_queues=self.held_queues)),
                reconnected=lambda: batches.give_back(store, runner_id,
                                                      [c.run_id for c in claimed]),
                while_stopping=False)
            while len(claimed) < size and self.stop_reason is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return claimed
                self._wait(min(left, self.CHUNK_POLL))
                if self._with_database(waiting.exists):
                    break
            else:
                return claimed

    def _give_back_chunk(self, claimed):
        count = self._with_database(lambda: sum(lifecycle.release_runs_of(
            self.store, self.runner_id, only=c.run_id) for c in claimed))
        if count:
            log.info("%d run(s) of a chunk given back unstarted: %s", count, self.stop_reason)

    def _run_chunk(self, cls, claimed):
        """Call the handler with the chunk of `claimed`, then end each run."""
        started = time.monotonic()
        items, ends = [], {}
        for c in claimed:
            try:
                items.append(ChunkItem(c.run_id, c.task_id, c.attempt, json.loads(c.data)))
            except ValueError as exc:
                ends[c.run_id] = outcomes.failed("DataDecodeError",
                                                 "task data is not JSON: %s" % exc)
        kept = [c for c in claimed if c.run_id not in ends]
        log.debug("a chunk of %d run(s) of %s started", len(items), cls.queue)
        failure, handler, span = None, None, None
        if items and tracing.active():
            with self._chunk_span(cls, kept) as span:
                failure, handler = self._call_chunk(cls, kept, items)
                span.called(failure and failure.exc)
        elif items:
            failure, handler = self._call_chunk(cls, kept, items)
        now = self.now()
        for c, item in zip(kept, items):
            ends[c.run_id] = failure or self._item_outcome(item, now)
        if span is not None:
            span.ended({c.run_id: (ends[c.run_id].status, ends[c.run_id].code,
                                   ends[c.run_id].message, ends[c.run_id].exc) for c in kept})
        self.runs_done += len(claimed)
        self._end_chunk(claimed, ends, items, handler, time.monotonic() - started)

    def _chunk_span(self, cls, claimed):
        """The span of the chunk's call (tracing.py), linked to the span that added each of
        its tasks: read from the tasks only while this process traces."""
        Task = self.store.Task
        carriers = dict(self._with_database(lambda: list(Task.select(
            Task.id, Task.trace_context).where(Task.id.in_([c.task_id for c in claimed]))
            .tuples())))
        return tracing.chunk_span(claimed[0].handler, cls.queue, [
            (carriers.get(c.task_id), c.task_id, c.run_id, c.attempt) for c in claimed])

    def _call_chunk(self, cls, claimed, items):
        """handle_chunk(chunk), watched by the heartbeat as one run (rule 8 for each): the
        Outcome of every task when it raised (else None), and the handler."""
        deadlines = [c.started_on + timedelta(seconds=c.max_runtime)
                     for c in claimed if c.max_runtime]
        run = self.current = CurrentRun(claimed[0], min(deadlines) if deadlines else None)
        run.chunk_ids = [c.run_id for c in claimed]
        ids = run.chunk_ids
        chunk = Chunk(items, report=lambda percent: self._chunk_progress(ids, percent),
                      stop_reason=lambda: self._stop_info(run)[0])
        handler = cls()
        failure = None
        try:
            try:
                run.enter_handler(None)
                value = handler.handle_chunk(chunk)
                if inspect.iscoroutine(value):
                    value = asyncio.run(value)
            finally:
                run.close()
            results_of_chunk(chunk, value)
        except (Interrupted, Exception, SystemExit) as exc:
            failure = outcomes.of_exception(
                exc, self.now(), aborted=run.abort_reason is not None,
                stopping=self.stop_reason if self.told_to_stop is not None else None)
        finally:
            self.current = None
        return failure, handler

    def _chunk_progress(self, ids, percent):
        """Chunk.progress: never a database error in the handler (progress is bookkeeping:
        a percent lost to an outage is written by the next call)."""
        try:
            lifecycle.report_chunk_progress(self.store, ids, self.runner_id, percent)
        except (pw.DatabaseError, pw.InterfaceError) as exc:
            log.warning("progress of a chunk of %d run(s) not stored: %s", len(ids),
                        outage.first_line(exc))
            outage.close_quietly(self.store.db)

    def _item_outcome(self, item, now):
        if item.failure is not None:
            return outcomes.of_exception(
                item.failure, now,
                stopping=self.stop_reason if self.told_to_stop is not None else None)
        if item.results is None:
            return outcomes.Outcome(SUCCESS)
        try:
            return outcomes.Outcome(SUCCESS, results=json.dumps(item.results, allow_nan=False))
        except (TypeError, ValueError) as exc:
            return outcomes.failed("ResultsNotJSON", "item.results is not JSON-serialisable: "
                                   "%s" % exc, outcomes.format_traceback(exc), exc)

    def _end_chunk(self, claimed, ends, items, handler, elapsed):
        """End each run of the chunk with its outcome (`ends`, by run id): the successes in
        one transaction — a run an operator asked to cancel ends ``cancelled`` there — the
        others one by one; then each is logged, with the handler's hooks for a failure."""
        store, runner_id, now = self.store, self.runner_id, self.now()
        successes = [c for c in claimed if ends[c.run_id].status == SUCCESS]
        ended, cancelled = set(), set()
        if successes:
            ended, cancelled = self._with_database(lambda: store.write(
                lambda: self._end_successes(successes, ends, now)))
            if len(ended) < len(successes):     # the connection lost after the commit?
                ended |= self._with_database(lambda: lifecycle.ended_by(
                    store, runner_id, [c.run_id for c in successes if c.run_id not in ended]))
            if ended:
                store.wake_waiters()
        by_run = {item.run_id: item for item in items}
        for c in claimed:
            outcome = ends[c.run_id]
            if outcome.status != SUCCESS:
                if self._with_database(lambda: lifecycle.end_run(
                        store, c.run_id, c.task_id, outcome.status, runner_id, outcome.results,
                        outcome.code, outcome.message, now=now,
                        periodic_task_id=c.periodic_task_id, retry_at=outcome.retry_at,
                        traceback=outcome.traceback, give_up=outcome.give_up)):
                    ended.add(c.run_id)
            if c.run_id in ended:
                outcomes.after_run(store, c, outcome, elapsed, handler, by_run.get(c.run_id))
            elif c.run_id not in cancelled:
                log.warning("run %d of task %d finished %s, but it had been ended meanwhile "
                            "(timeout); its outcome is discarded", c.run_id, c.task_id,
                            outcome.status)

    def _end_successes(self, successes, ends, now):
        """Inside the write transaction: the successes ended together (rule 4 for each),
        those an operator asked to cancel ended ``cancelled``: (the ids of the successes,
        those of the cancelled)."""
        store, runner_id = self.store, self.runner_id
        Run = store.Run
        asked = {r.id for r in Run.select(Run.id).where(
            Run.id.in_([c.run_id for c in successes]) & Run.cancel_requested_on.is_null(False))}
        for c in successes:
            if c.run_id in asked:
                lifecycle.end_in_transaction(store, c.run_id, c.task_id, CANCELLED, runner_id,
                                             None, "Cancelled", "cancelled by an operator "
                                             "while its chunk ran", now, c.periodic_task_id)
        done = [(c.run_id, c.task_id, ends[c.run_id].results, now, c.periodic_task_id)
                for c in successes if c.run_id not in asked]
        return (lifecycle.end_successes(store, runner_id, done) if done else set()), asked
