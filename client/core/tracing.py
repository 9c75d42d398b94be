"""The trace context a ``Generate`` call sends (docs/tracing.md).

The caller's ``traceparent`` option first; else, when the application uses
OpenTelemetry (it is imported already), a client span under its current
context: a new trace when it has none, and with no SDK configured the API's
no-op tracer just forwards the current context. Otherwise nothing: the client
imports no OpenTelemetry of its own.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from pagoda.tracing import TRACEPARENT_KEY, check_traceparent
from pagoda_client.core.requests import Metadata

if TYPE_CHECKING:
    from opentelemetry.trace import Span

CLIENT_SPAN_NAME = "pagoda.client.generate"


def call_trace(traceparent: object) -> tuple[Metadata, Span | None]:
    """The trace metadata of one call, and the client span to end with it (None: nothing to end).

    Raises:
        ValueError: ``traceparent`` is given and is not a W3C traceparent (named).
    """
    if traceparent is not None:
        return ((TRACEPARENT_KEY, check_traceparent(traceparent)),), None  # type: ignore[arg-type]
    if "opentelemetry.trace" not in sys.modules:
        return (), None
    return _current_trace()


def _current_trace() -> tuple[Metadata, Span | None]:
    from opentelemetry import propagate, trace

    span = trace.get_tracer("pagoda_client").start_span(CLIENT_SPAN_NAME, kind=trace.SpanKind.CLIENT)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items()), (span if span.is_recording() else None)
