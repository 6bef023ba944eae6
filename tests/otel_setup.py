"""An application's OpenTelemetry set-up for tests/test_tracing.py: a tracer provider whose
spans are appended, one JSON object a line, to the file $TEST_SPANS (each process writes its
own spans as they end)."""
import json
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class FileExporter(SpanExporter):
    def __init__(self, path):
        self.path = path

    def export(self, spans):
        with open(self.path, "a") as out:
            for span in spans:
                out.write(json.dumps({
                    "name": span.name, "pid": os.getpid(),
                    "trace_id": "%032x" % span.context.trace_id,
                    "span_id": "%016x" % span.context.span_id,
                    "parent_id": "%016x" % span.parent.span_id if span.parent else None,
                    "kind": span.kind.name, "status": span.status.status_code.name,
                    "attributes": dict(span.attributes),
                    "events": [event.name for event in span.events],
                    "exceptions": [event.attributes.get("exception.type")
                                   for event in span.events if event.name == "exception"],
                    "description": span.status.description,
                    "links": ["%016x" % link.context.span_id for link in span.links]}) + "\n")
        return SpanExportResult.SUCCESS


def configure():
    provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["TEST_SPANS"])))
    trace.set_tracer_provider(provider)
