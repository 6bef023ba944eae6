"""OpenTelemetry traces across tasks and workflows (the ``otel`` extra).

Tracing is on in a process when the application has imported OpenTelemetry and set a tracer
provider (``trace.set_tracer_provider``: in a runner, from the module ``[tracing] setup``
names, or from any module it imports). Then:

- each task added gets a span ``taskrunner.enqueue HANDLER`` (kind PRODUCER), a child of
  whatever span is current — a web request's, or the run of the task that adds it — and the
  span's context is stored with the task (``task_queue.trace_context``, the propagator's
  carrier as JSON: W3C ``traceparent`` by default);
- each run of it is a span ``taskrunner.run HANDLER`` (kind CONSUMER), a child of that
  enqueue span, current while the handler runs; a retry is one more run span beside it;
- each step a run executes is a span ``taskrunner.step NAME`` under the run's; a step
  replayed from its record is an event on the run's span.

- a chunk handler's call (many runs at once: chunks.py) is a span ``taskrunner.chunk
  HANDLER`` (kind CONSUMER, a root of its own) linked to each of its runs' enqueue spans,
  as OpenTelemetry's messaging conventions trace a batch; each of its runs is still a span
  ``taskrunner.run HANDLER`` under its own enqueue span, over the call, linked to the
  chunk's span, with its own outcome.

So a request, the task it adds, its retries, the children it adds, their fan-in and all
their steps are one trace. Attributes: ``taskrunner.task.id``, ``taskrunner.task.handler``,
``taskrunner.queue``, ``taskrunner.run.id``, ``taskrunner.run.attempt``,
``taskrunner.run.status``; a failed run records its exception and sets the span's status.

Without a configured provider nothing here imports OpenTelemetry, no span is made and no
column is written or read: `active()` is a dictionary lookup.
"""
import contextlib
import json
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

TRACER = "taskrunner"
RUN_FAILED = ("error", "timeout")


def active() -> bool:
    """Whether this process traces: OpenTelemetry imported and a tracer provider set."""
    trace = sys.modules.get("opentelemetry.trace")
    return trace is not None and not isinstance(trace.get_tracer_provider(),
                                                trace.ProxyTracerProvider)


def _tracer() -> Any:
    from opentelemetry import trace
    return trace.get_tracer(TRACER)


def enqueued(handler: str, queue: str) -> Optional[str]:
    """Where a task is added, while tracing: its enqueue span (started and ended now) and
    the carrier of that span's context, as the JSON text to store with the task."""
    from opentelemetry import propagate, trace
    span = _tracer().start_span("taskrunner.enqueue %s" % handler,
                                kind=trace.SpanKind.PRODUCER,
                                attributes={"taskrunner.task.handler": handler,
                                            "taskrunner.queue": queue})
    carrier: Dict[str, str] = {}
    with trace.use_span(span, end_on_exit=True):
        propagate.inject(carrier)
    return json.dumps(carrier, separators=(",", ":")) if carrier else None


class RunSpan:
    """The span of one run while its handler runs (`run_span`); `ended(outcome)` records how
    it ended."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def ended(self, status: str, code: Optional[str] = None, message: Optional[str] = None,
              exc: Optional[BaseException] = None) -> None:
        if self.span is None:
            return
        from opentelemetry.trace import Status, StatusCode
        self.span.set_attribute("taskrunner.run.status", status)
        if status in RUN_FAILED:
            if exc is not None:
                self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, "%s: %s" % (code, message)
                                        if code else message))


@contextlib.contextmanager
def run_span(carrier: Optional[str], handler: str, queue: str, task_id: int, run_id: int,
             attempt: int) -> Iterator[RunSpan]:
    """The run's span, current inside the block, a child of the stored enqueue span
    (`carrier`; a root span for a task added without tracing)."""
    from opentelemetry import propagate, trace
    parent = propagate.extract(json.loads(carrier)) if carrier else None
    with _tracer().start_as_current_span(
            "taskrunner.run %s" % handler, context=parent, kind=trace.SpanKind.CONSUMER,
            record_exception=False, set_status_on_exception=False,
            attributes=_run_attributes(handler, queue, task_id, run_id, attempt)) as span:
        yield RunSpan(span)


class ChunkSpan:
    """The span of one call of a chunk handler (`chunk_span`); `ended(outcomes)` gives each
    of its runs its span, with its outcome."""

    def __init__(self, span: Any, started: int, handler: str, queue: str,
                 runs: List[Tuple[Optional[str], int, int, int]]) -> None:
        self.span, self.started, self.handler, self.queue, self.runs = (
            span, started, handler, queue, runs)

    def called(self, exc: Optional[BaseException]) -> None:
        """The call raised `exc` (every run of the chunk failed with it), or returned."""
        if exc is not None:
            from opentelemetry.trace import Status, StatusCode
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, "%s: %s" % (type(exc).__name__, exc)))

    def ended(self, outcomes: Dict[int, Tuple[str, Optional[str], Optional[str],
                                               Optional[BaseException]]]) -> None:
        """A span per run of the chunk, from the call's start to now, a child of the run's
        enqueue span and linked to the chunk's: `outcomes` maps a run id to its (status,
        error code, message, exception)."""
        from opentelemetry import propagate, trace
        link = trace.Link(self.span.get_span_context())
        end = time.time_ns()
        for carrier, task_id, run_id, attempt in self.runs:
            span = _tracer().start_span(
                "taskrunner.run %s" % self.handler,
                context=propagate.extract(json.loads(carrier)) if carrier else None,
                kind=trace.SpanKind.CONSUMER, links=[link], start_time=self.started,
                attributes=_run_attributes(self.handler, self.queue, task_id, run_id, attempt,
                                           {"taskrunner.chunk.size": len(self.runs)}))
            RunSpan(span).ended(*outcomes[run_id])
            span.end(end_time=end)


def _run_attributes(handler: str, queue: str, task_id: int, run_id: int, attempt: int,
                    more: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return dict({"taskrunner.task.id": task_id, "taskrunner.task.handler": handler,
                 "taskrunner.queue": queue, "taskrunner.run.id": run_id,
                 "taskrunner.run.attempt": attempt}, **(more or {}))


@contextlib.contextmanager
def chunk_span(handler: str, queue: str,
               runs: List[Tuple[Optional[str], int, int, int]]) -> Iterator[ChunkSpan]:
    """The span of a chunk handler's call, current inside the block, linked to the enqueue
    span of each of `runs` ((carrier, task id, run id, attempt) each)."""
    from opentelemetry import propagate, trace
    links = []
    for carrier, _task_id, _run_id, _attempt in runs:
        if carrier:
            context = trace.get_current_span(
                propagate.extract(json.loads(carrier))).get_span_context()
            if context.is_valid:
                links.append(trace.Link(context))
    started = time.time_ns()
    with _tracer().start_as_current_span(
            "taskrunner.chunk %s" % handler, kind=trace.SpanKind.CONSUMER, links=links,
            start_time=started, record_exception=False, set_status_on_exception=False,
            attributes={"taskrunner.task.handler": handler, "taskrunner.queue": queue,
                        "taskrunner.chunk.size": len(runs),
                        "taskrunner.chunk.task_ids": [task_id for _, task_id, _, _ in runs]}
    ) as span:
        yield ChunkSpan(span, started, handler, queue, runs)


@contextlib.contextmanager
def step_span(name: str, task_id: int) -> Iterator[None]:
    """A step's span under the run's, while its function runs (an exception is recorded on
    it and passes on)."""
    with _tracer().start_as_current_span("taskrunner.step %s" % name, attributes={
            "taskrunner.step.name": name, "taskrunner.task.id": task_id}):
        yield


def step_replayed(name: str) -> None:
    """A step returned from its record: an event on the current (run's) span."""
    from opentelemetry import trace
    trace.get_current_span().add_event("taskrunner.step replayed",
                                       {"taskrunner.step.name": name})


def set_up(path: str) -> None:
    """Call ``[tracing] setup`` ("module:function"), once, in a runner that starts. A setup
    that fails is logged and the runner works on untraced: tracing is not worth a stopped
    queue."""
    if not path:
        return
    import importlib
    import logging
    module_name, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        getattr(importlib.import_module(module_name), name)()
    except Exception:  # an import or a setup can fail in any way; the log says which
        logging.getLogger("taskrunner.runner").exception(
            "[tracing] setup %r failed: this runner does not trace", path)
