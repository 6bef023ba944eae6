"""The execution of one run: decode its data, load its handler, call it with the run's
`RunContext` (shared with the heartbeat thread through a `CurrentRun` of its own), and record
the outcome — with the claim of the runner's next run in the same transaction when it may
(one commit per job). A mixin of `loop.Runner`, whose store, runner row and stop state it
reads."""
import asyncio
import inspect
import json
import logging
import time
from datetime import timedelta, timezone

from . import outcomes, versions
from .. import tracing
from ..fleet import liveness
from ..runs import durable, lifecycle
from ..periodic import scheduler as periodic
from ..errors import HandlerError, Waiting
from ..handler import CURRENT_RUN, RunContext, load_handler
from .current import CurrentRun
from ..store.models import CANCELLED, SUCCESS
from .outcomes import Interrupted

log = logging.getLogger("taskrunner.runner")


class Execution:
    """The execution of one claimed run, for `loop.Runner`."""

    def _queue_facade(self):
        """The `TaskQueue` a handler sees as ``run.queue``, on this runner's store (None
        when the runner was started without one)."""
        if self._facade is None and self.facade is not None:
            self._facade = self.facade(self.store)
        return self._facade

    def _handler_class(self, path):
        cls = self._handlers.get(path)
        if cls is None:
            cls = self._handlers[path] = load_handler(path, self.config.handlers.allow)
        return cls

    def execute(self, claimed, claim_next=False):
        """Run one claimed run's handler and record its outcome. With `claim_next`, unless
        the runner is now due to exit or the run failed (its hooks run first), the outcome
        and the claim of its next run are one transaction (one commit per job); returns that
        run, or None."""
        chunked = self._chunk_handler(claimed.handler)
        if chunked is not None:
            return self.execute_chunk(claimed, chunked)
        started = time.monotonic()
        log.debug("run %d of task %d started: %s (attempt %d)", claimed.run_id, claimed.task_id,
                  claimed.handler, claimed.attempt)
        hard_deadline = claimed.started_on + timedelta(seconds=claimed.max_runtime) \
            if claimed.max_runtime else None
        run = self.current = CurrentRun(claimed, hard_deadline)
        try:
            if tracing.active():
                outcome, handler, context = self._traced(run)
            else:
                outcome, handler, context = self._run_handler(run)
        finally:
            run.close()
            self.current = None
        self.runs_done += 1
        status, now = outcome.status, self.now()
        if self.batch is not None and self.batch.keep(claimed, outcome, now,
                                                      time.monotonic() - started, handler, context):
            return None               # written with the batch's next flush
        args = (claimed.run_id, claimed.task_id, status, self.runner_id, outcome.results,
                outcome.code, outcome.message)
        options = dict(periodic_task_id=claimed.periodic_task_id, retry_at=outcome.retry_at,
                       traceback=outcome.traceback, now=now, waiting_for=outcome.waiting_for,
                       give_up=outcome.give_up)
        if claim_next and outcome.exc is None and not self._should_exit():
            ended, following = self._with_database(lambda: lifecycle.end_run_and_claim(
                self.store, *args, queues=self._claim_order(), held_queues=self.held_queues,
                claim_now=self.clock, **options),
                reconnected=lambda: self._give_back_lost_claims(keep=claimed.run_id))
        else:
            ended, following = self._with_database(lambda: lifecycle.end_run(
                self.store, *args, **options)), None
        if not ended:
            # Refused, or the connection was lost after the end committed: which one?
            ended = self._with_database(lambda: lifecycle.was_ended_by(
                self.store, claimed.run_id, self.runner_id, status))
        elapsed = time.monotonic() - started
        if ended:
            outcomes.after_run(self.store, claimed, outcome, elapsed, handler, context)
        else:
            log.warning("run %d of task %d finished %s in %.3fs, but it had been ended meanwhile "
                        "(timeout); its outcome is discarded", claimed.run_id, claimed.task_id,
                        status, elapsed)
            if self.stop_reason is None:     # whoever ended it showed this runner stopping
                self._with_database(lambda: liveness.heartbeat(self.store, self.runner_id,
                                                               stopping=""))
        return following

    def _traced(self, run):
        """`_run_handler` inside the run's span (tracing.py), a child of the span that added
        its task: read from the task only while this process traces."""
        claimed, Task = run.claimed, self.store.Task
        carrier, queue = self._with_database(lambda: Task.select(
            Task.trace_context, Task.queue).where(Task.id == claimed.task_id).tuples().first())
        with tracing.run_span(carrier, claimed.handler, queue, claimed.task_id,
                              claimed.run_id, claimed.attempt) as span:
            outcome, handler, context = self._run_handler(run)
            span.ended(outcome.status, outcome.code, outcome.message, outcome.exc)
        return outcome, handler, context

    def _durable_run(self, claimed):
        """The durable side of the run `claimed` (made at its first step, checkpoint, sleep,
        event or patch): the first of this process says when its code version names no
        source (versions.warn_if_unnamed)."""
        versions.warn_if_unnamed()
        return durable.DurableRun(self.store, claimed.run_id, claimed.task_id, claimed.attempt,
                                  self.runner_id, clock=self.now, code_version=self.code_version)

    def _run_handler(self, run):
        """Decode the data, load the handler and run it (`run`, a CurrentRun); returns
        (Outcome, the handler instance or None, the RunContext or None)."""
        claimed = run.claimed
        try:
            # No data (null): every task added without any; json.loads is three Python calls.
            data = None if claimed.data == "null" else json.loads(claimed.data)
        except ValueError as exc:
            return outcomes.failed("DataDecodeError", "task data is not JSON: %s" % exc), None, None
        try:
            cls = self._handler_class(claimed.handler)
        except HandlerError as exc:
            return outcomes.failed("HandlerError", str(exc), getattr(exc, "import_traceback", None)
                                ), None, None
        if claimed.periodic_task_id is not None and claimed.attempt == 1 \
                and not self._with_database(lambda: periodic.allow_start(
                    self.store, claimed.periodic_task_id)):
            # Nuntium's tolerance: the previous task of this periodic task started too recently
            # (a retry of the same task is not a new occurrence).
            return outcomes.Outcome(CANCELLED, "MinSpacing", "dropped: the previous task of this "
                                 "periodic task started less than min_spacing ago"), None, None
        deadline = None
        if claimed.max_runtime:
            # The handler's deadline comes a grace before the hard limit, so a handler that
            # watches it and returns is not timed out.
            grace = min(self.config.overseer.kill_grace, claimed.max_runtime / 10)
            deadline = (claimed.started_on + timedelta(seconds=claimed.max_runtime - grace)
                        ).replace(tzinfo=timezone.utc)
        context = RunContext(
            claimed.run_id, claimed.task_id, claimed.attempt, data, deadline=deadline,
            report=lambda pct, results: lifecycle.report_progress(
                self.store, claimed.run_id, self.runner_id, pct, results),
            stopping=lambda: self.told_to_stop is not None or run.stopping() is not None,
            queue=self._queue_facade(), stop_info=lambda: self._stop_info(run),
            durable=lambda: self._durable_run(claimed))
        handler = cls()
        outcome = outcomes.Outcome(SUCCESS)
        try:
            run.enter_handler(context)
            current = CURRENT_RUN.set(context)
            try:
                coroutine = handler.handle(context)
                if coroutine is not None and inspect.iscoroutine(coroutine):
                    # async def handle: run to completion here; an Interrupted raised by a
                    # signal leaves asyncio.run, which cancels the coroutine on its way out.
                    asyncio.run(coroutine)
            finally:
                CURRENT_RUN.reset(current)
                run.close()      # from here on, what the heartbeat decided is final
        except (Interrupted, Waiting, Exception, SystemExit) as exc:
            # Interrupted: its run was taken away (rule 8) when an abort reason is set, else
            # a stop; any failure of a runner told to stop hands the run back.
            outcome = outcomes.of_exception(
                exc, self.now(), aborted=run.abort_reason is not None,
                stopping=self.stop_reason if self.told_to_stop is not None else None)
        if run.cancel_reason is not None:
            # However the handler ended, the operator's cancel is the outcome.
            outcome = outcomes.Outcome(CANCELLED, "Cancelled", "%s; the handler ended: %s" % (
                run.cancel_reason, outcome.message or outcome.status),
                traceback=outcome.traceback)
        # Progress the database could not take during the run (a restart) is written now,
        # before the outcome; it never reached the handler as an error.
        context.flush_progress()
        if context.results is not None:
            try:
                outcome = outcome._replace(results=json.dumps(context.results, allow_nan=False))
            except (TypeError, ValueError) as exc:
                outcome = outcomes.failed("ResultsNotJSON", "run.results is not JSON-serialisable: "
                                       "%s" % exc, outcomes.format_traceback(exc), exc)
        return outcome, handler, context
