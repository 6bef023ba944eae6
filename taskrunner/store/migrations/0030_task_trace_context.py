"""``task_queue.trace_context``: the OpenTelemetry context of the span that added the task
(the propagator's carrier as JSON, W3C ``traceparent`` by default), from which its runs'
spans descend (tracing.py). NULL for a task added by a process that does not trace.
"""


def up(migrator, db):
    db.execute_sql("ALTER TABLE task_queue ADD COLUMN trace_context TEXT NULL")
