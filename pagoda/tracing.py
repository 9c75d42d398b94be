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

import dataclasses
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Span, SpanContext, Tracer

TRACEPARENT_KEY = "traceparent"
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE_ID, _ZERO_SPAN_ID = "0" * 32, "0" * 16

# The OTLP default when nothing names a collector (OTEL_TRACES_EXPORTER=otlp alone).
_DEFAULT_ENDPOINT = "http://localhost:4317"
# How long the start-up check waits for the collector before its one warning.
COLLECTOR_CHECK_S = 5.0

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


def check_otlp_endpoint(text: str) -> str:
    """An ``--otlp-endpoint`` value: empty, or a URL whose scheme says plaintext (http) or TLS (https).

    A bare ``host:port`` means TLS under the OpenTelemetry rules, so a plaintext
    collector would receive nothing, silently; the flag refuses it instead.

    Raises:
        ValueError: naming the value and the two forms accepted.
    """
    if text and (urlparse(text).scheme not in ("http", "https") or not urlparse(text).netloc):
        raise ValueError(
            f"--otlp-endpoint {text!r}: give http://HOST:PORT (plaintext) or https://HOST:PORT (TLS); a bare "
            "HOST:PORT would mean TLS under the OpenTelemetry rules"
        )
    return text


@dataclasses.dataclass(frozen=True)
class OtlpTarget:
    """Where this process's spans go, resolved by the OpenTelemetry exporter's rules.

    Attributes:
        address: ``host:port`` the exporter dials.
        tls: whether it speaks TLS to it.
        source: what named it: the flag, an ``OTEL_*`` variable, or the OTLP default.
    """

    address: str
    tls: bool
    source: str


def otlp_target(otlp_endpoint: str = "", environ: Mapping[str, str] | None = None) -> OtlpTarget:
    """The collector and its transport as the OTLP/gRPC exporter resolves them (flag, then variables, then default).

    https means TLS; http plaintext; otherwise ``OTEL_EXPORTER_OTLP_[TRACES_]INSECURE``, else TLS.
    """
    env = os.environ if environ is None else environ
    sources = [
        ("--otlp-endpoint", otlp_endpoint),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")),
        ("default", _DEFAULT_ENDPOINT),
    ]
    source, endpoint = next((name, value) for name, value in sources if value)
    url = urlparse(endpoint)
    insecure_env = env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE", env.get("OTEL_EXPORTER_OTLP_INSECURE"))
    if url.scheme == "https":
        tls = True
    elif insecure_env is not None:
        tls = insecure_env.strip().lower() != "true"
    else:
        tls = url.scheme != "http"
    return OtlpTarget(url.netloc or endpoint, tls, source)


class EventLog(Protocol):
    """The services' structlog loggers: an event name and fields."""

    def info(self, event: str, **fields: Any) -> Any: ...

    def warning(self, event: str, **fields: Any) -> Any: ...


class _StdlibEventLog:
    """`EventLog` over the stdlib logger of this module (the CLI, which has no structlog)."""

    def info(self, event: str, **fields: Any) -> None:
        logging.getLogger(__name__).info("%s %s", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        logging.getLogger(__name__).warning("%s %s", event, fields)


def setup_tracing(
    service_name: str,
    otlp_endpoint: str = "",
    environ: Mapping[str, str] | None = None,
    log: EventLog | None = None,
) -> Tracer | None:
    """The tracer of this process, exporting over OTLP/gRPC in batches; None when tracing is off.

    When on, one ``tracing_export`` line names the collector and whether it is
    dialed with TLS; a collector that cannot be reached, at start or later, is one
    ``otlp_collector_unreachable`` warning per outage (spans are dropped meanwhile).

    Args:
        service_name: `service.name` unless OTEL_SERVICE_NAME names one.
        otlp_endpoint: the collector (`http://host:4317` for plaintext); empty: the OTEL_* variables'.
        log: where those lines go (default: this module's stdlib logger).
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
    target = otlp_target(otlp_endpoint, env)
    ca_file = env.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE") or env.get("OTEL_EXPORTER_OTLP_CERTIFICATE")
    reporter = _CollectorReporter(target, log or _StdlibEventLog(), ca_file)
    reporter.log.info(
        "tracing_export", service=service_name, endpoint=target.address, tls=target.tls, source=target.source
    )
    # The exporter's own per-batch retry and failure lines would repeat every few seconds; the reporter says it once.
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").setLevel(logging.CRITICAL)
    exporter = OTLPSpanExporter(endpoint=target.address, insecure=not target.tls)
    resource = Resource.create({} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(_reporting_exporter(exporter, reporter)))
    trace.set_tracer_provider(provider)
    _provider = provider
    threading.Thread(target=reporter.check_at_start, name="otlp-collector-check", daemon=True).start()
    return provider.get_tracer("pagoda")


class _CollectorReporter:
    """One warning per outage of the collector, one line when it answers again."""

    def __init__(self, target: OtlpTarget, log: EventLog, ca_file: str | None = None) -> None:
        self.target = target
        self.log = log
        self.ca_file = ca_file
        self._lock = threading.Lock()
        self._down = False

    def check_at_start(self, wait_s: float = COLLECTOR_CHECK_S) -> None:
        """Dials the collector once, as the exporter will; not ready within `wait_s` is an outage."""
        import grpc

        address = self.target.address
        if self.target.tls:
            roots = Path(self.ca_file).read_bytes() if self.ca_file else None
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(roots))
        else:
            channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            self.outcome(False, f"no connection within {wait_s:g} s")
        finally:
            channel.close()

    def outcome(self, ok: bool, why: str = "") -> None:
        """Records an export (or the start-up check): logs only a change from up to down and back."""
        with self._lock:
            changed, self._down = self._down == ok, not ok
        if changed and not ok:
            hint = " (a plaintext collector needs http://)" if self.target.tls else ""
            self.log.warning(
                "otlp_collector_unreachable",
                endpoint=self.target.address,
                tls=self.target.tls,
                reason=why + hint,
                spans="dropped until it answers",
            )
        elif changed:
            self.log.info("otlp_collector_reachable", endpoint=self.target.address, tls=self.target.tls)


def _reporting_exporter(inner: SpanExporter, reporter: _CollectorReporter) -> SpanExporter:
    """`inner` with each export's outcome told to `reporter`."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class ReportingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            result = inner.export(spans)
            reporter.outcome(result == SpanExportResult.SUCCESS, "an export of spans failed")
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    return ReportingExporter()


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
