"""An in-process OTLP/gRPC trace receiver (opentelemetry-proto's generated service): what the services export.

Binds 127.0.0.1 on a free port; every exported span becomes a `ReceivedSpan`
with its service name, ids in hex, attributes, events and links. Waits are bounded.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, ids as hex strings ("" for no parent)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    # (name, attributes) in order.
    events: tuple[tuple[str, dict[str, Any]], ...]
    # (trace_id, span_id) of each linked span.
    links: tuple[tuple[str, str], ...]
    # 0 unset, 1 ok, 2 error.
    status_code: int

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects spans; `endpoint` is what `--otlp-endpoint` takes."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=1).wait(5)

    def Export(self, request: Any, context: Any) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                received += [self._span(service, s) for s in scope_spans.spans]
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    @staticmethod
    def _span(service: str, s: Any) -> ReceivedSpan:
        return ReceivedSpan(
            service=service,
            name=s.name,
            trace_id=s.trace_id.hex(),
            span_id=s.span_id.hex(),
            parent_span_id=s.parent_span_id.hex(),
            start_ns=s.start_time_unix_nano,
            end_ns=s.end_time_unix_nano,
            attributes=_attributes(s.attributes),
            events=tuple((e.name, _attributes(e.attributes)) for e in s.events),
            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
            status_code=s.status.code,
        )

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float, what: str
    ) -> list[ReceivedSpan]:
        """Poll until `predicate(spans)` holds (every 50 ms, up to `timeout_s`); the spans then."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            names = sorted({(s.service, s.name) for s in spans})
            assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}; got {names}"
            time.sleep(0.05)
