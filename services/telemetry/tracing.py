"""Trace context helpers live in `shared.tracing` (the runtime uses them on every hop); re-exported here."""

from shared.tracing import (
    context_from_traceparent,
    current_traceparent,
    setup_tracing,
    start_span,
    start_span_from_event,
)

__all__ = ["context_from_traceparent", "current_traceparent", "setup_tracing", "start_span",
           "start_span_from_event"]
