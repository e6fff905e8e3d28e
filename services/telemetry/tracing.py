"""Trace context helpers live in `shared.tracing` (the runtime uses them on every hop); re-exported here."""

from shared.tracing import (
    command_span,
    context_from_traceparent,
    current_traceparent,
    outgoing_traceparent,
    setup_tracing,
    start_span,
    start_span_from_event,
    traced_event,
    with_trace_context,
)

__all__ = ["command_span", "context_from_traceparent", "current_traceparent", "outgoing_traceparent",
           "setup_tracing", "start_span", "start_span_from_event", "traced_event", "with_trace_context"]
