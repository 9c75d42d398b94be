"""OpenTelemetry tracing shared by the services and the CLI: off unless configured, and then free.

Tracing is on when an OTLP endpoint is given (`--otlp-endpoint`, or the
standard `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp`)
and not switched off (`OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none`).
Only then is the SDK imported: `setup_tracing` returns None otherwise, and the
callers test that once. See docs/tracing.md.

W3C trace context travels as a `traceparent` string (gRPC metadata, an HTTP
header, `NewSequence.traceparent`); this module parses and formats it without
OpenTelemetry, so the edges can validate it for free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanContext, Tracer

TRACEPARENT_KEY = "traceparent"
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE_ID, _ZERO_SPAN_ID = "0" * 32, "0" * 16

# request_id -> trace id (32 hex digits) of the traced requests this process holds, for log lines.
trace_ids: dict[str, str] = {}
_provider: TracerProvider | None = None


def parse_traceparent(text: str) -> str | None:
    """The `version-trace_id-span_id-flags` header normalised to lowercase, or None when it is not one.

    Invalid per W3C: another shape, version ff, an all-zero trace or span id. A
    future version may carry more fields: its first four are kept (as the spec says).
    """
    match = _TRACEPARENT_RE.match(text.strip().lower()) if len(text) <= 512 else None
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE_ID or span_id == _ZERO_SPAN_ID or (version == "00" and rest):
        return None
    return f"{version}-{trace_id}-{span_id}-{flags}"


def check_traceparent(text: str) -> str:
    """`parse_traceparent` for a value a caller gave: a ValueError naming it when it is not valid."""
    parsed = parse_traceparent(text) if isinstance(text, str) else None
    if parsed is None:
        raise ValueError(f"traceparent: not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>): {str(text)[:80]!r}")
    return parsed


def traceparent_in(metadata: Iterable[tuple[str, Any]]) -> str:
    """The valid `traceparent` among gRPC metadata pairs, normalised; empty when none is (a new trace starts)."""
    for key, value in metadata:
        if key == TRACEPARENT_KEY and isinstance(value, str):
            return parse_traceparent(value) or ""
    return ""


def trace_id_of(traceparent: str) -> str:
    """The trace id (32 hex digits) of a valid traceparent."""
    return traceparent[3:35]


def tracing_requested(otlp_endpoint: str = "", environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process should export traces.

    Raises:
        ValueError: OTEL_TRACES_EXPORTER names an exporter other than otlp or none.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter not in ("", "otlp", "none"):
        raise ValueError(f"OTEL_TRACES_EXPORTER: only otlp (over gRPC) or none are supported, got {exporter!r}")
    if exporter == "none":
        return False
    endpoints = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return bool(otlp_endpoint or any(endpoints) or exporter == "otlp")


def setup_tracing(
    service_name: str, otlp_endpoint: str = "", environ: Mapping[str, str] | None = None
) -> Tracer | None:
    """The tracer of this process, exporting over OTLP/gRPC in batches; None when tracing is off.

    Args:
        service_name: `service.name` unless OTEL_SERVICE_NAME names one.
        otlp_endpoint: the collector (`http://host:4317` for plaintext); empty: the OTEL_* variables'.
    """
    global _provider
    if not tracing_requested(otlp_endpoint, environ):
        return None
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env = os.environ if environ is None else environ
    resource = Resource.create({} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint or None)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider.get_tracer("pagoda")


def shutdown_tracing() -> None:
    """Export what is queued and stop (bounded by the SDK's export timeout); nothing when tracing is off."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def context_of(traceparent: str) -> Context | None:
    """The OpenTelemetry context whose remote parent is `traceparent` (None for an empty one)."""
    if not traceparent:
        return None
    from opentelemetry.trace import NonRecordingSpan, set_span_in_context

    return set_span_in_context(NonRecordingSpan(span_context_of(traceparent)))


def span_context_of(traceparent: str) -> SpanContext:
    """The remote span context of a valid traceparent."""
    from opentelemetry.trace import SpanContext, TraceFlags

    _, trace_id, span_id, flags = traceparent.split("-")[:4]
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))


def traceparent_of(span: Span) -> str:
    """The traceparent that names `span` as the parent."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def add_trace_id(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: a line naming a traced request's `request_id` gets its `trace_id`.

    With tracing off the dict is empty: one test per log line.
    """
    if trace_ids and "trace_id" not in event_dict:
        trace_id = trace_ids.get(str(event_dict.get("request_id", "")))
        if trace_id is not None:
            event_dict["trace_id"] = trace_id
    return event_dict
