"""pagoda.tracing and the client's trace metadata: parsing, configuration, log correlation, and no cost when off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagoda import tracing
from pagoda_client.core.tracing import call_trace

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    "text,expected",
    [
        (VALID, VALID),
        (VALID.upper(), VALID),
        (f" {VALID} ", VALID),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", VALID.replace("00-", "01-", 1)),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # version ff is invalid
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # zero trace id
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),  # zero span id
        (VALID + "-extra", None),  # version 00 has exactly four fields
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
        ("garbage", None),
        ("", None),
    ],
)
def test_parse_traceparent(text, expected):
    assert tracing.parse_traceparent(text) == expected


def test_traceparent_in_metadata_takes_the_valid_key_only():
    assert tracing.traceparent_in([("x-request-id", "r"), ("traceparent", VALID)]) == VALID
    assert tracing.traceparent_in([("traceparent", "nope")]) == ""
    assert tracing.traceparent_in([]) == ""


@pytest.mark.parametrize(
    "flag,environ,expected",
    [
        ("", {}, False),
        ("http://c:4317", {}, True),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, True),
        ("", {"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ("http://c:4317", {"OTEL_TRACES_EXPORTER": "none"}, False),
        ("http://c:4317", {"OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_requested_by_the_flag_or_the_standard_variables(flag, environ, expected):
    assert tracing.tracing_requested(flag, environ) is expected


def test_an_unsupported_exporter_is_refused_by_name():
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        tracing.tracing_requested("", {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_log_lines_of_traced_requests_get_their_trace_id():
    tracing.trace_ids["req-1"] = "ab" * 16
    try:
        assert tracing.add_trace_id(None, "info", {"request_id": "req-1"})["trace_id"] == "ab" * 16
        assert "trace_id" not in tracing.add_trace_id(None, "info", {"request_id": "req-2"})
        assert "trace_id" not in tracing.add_trace_id(None, "info", {"event": "no request"})
    finally:
        tracing.trace_ids.pop("req-1")


def test_the_client_sends_a_given_traceparent_and_refuses_a_malformed_one():
    assert call_trace(VALID) == ((("traceparent", VALID),), None)
    assert call_trace(None)[1] is None
    with pytest.raises(ValueError, match="traceparent"):
        call_trace("00-nope")


def test_the_client_forwards_the_applications_current_span():
    """With no SDK configured, the API's no-op tracer forwards the current context (no span to end)."""
    from opentelemetry import trace

    parent = tracing.span_context_of(VALID)
    with trace.use_span(trace.NonRecordingSpan(parent)):
        metadata, span = call_trace(None)
    assert span is None
    assert dict(metadata)["traceparent"] == VALID


OFF = """
import json, os, sys
for key in [k for k in os.environ if k.startswith("OTEL_")]:
    del os.environ[key]
from pagoda import tracing
from pagoda_client.core.session import ClientCore
import scheduler_svc.main, executor_svc.serving.servicer
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.engine import Engine
tracer = tracing.setup_tracing("pagoda-scheduler", "")
engine = Engine(SchedulerServiceConfig())
state = ClientCore().generate("hi", {})
print(json.dumps({
    "tracer": tracer is None and engine.tracer is None,
    "metadata": [k for k, _ in state.metadata],
    "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
}))
"""


def test_with_nothing_configured_no_opentelemetry_module_is_imported():
    out = subprocess.run([sys.executable, "-c", OFF], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"tracer": True, "metadata": [], "otel": []}


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        ("http://collector:4317", {}, ("collector:4317", False, "--otlp-endpoint")),
        (
            "https://collector:4317",
            {"OTEL_EXPORTER_OTLP_INSECURE": "true"},
            ("collector:4317", True, "--otlp-endpoint"),
        ),
        (
            "",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"},
            ("collector:4317", True, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ),
        (
            "",
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "c:1", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"},
            ("c:1", False, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        ),
        ("", {"OTEL_TRACES_EXPORTER": "otlp"}, ("localhost:4317", False, "default")),
    ],
)
def test_the_collector_and_its_transport_follow_the_opentelemetry_rules(flag, environ, expected):
    target = tracing.otlp_target(flag, environ)
    assert (target.address, target.tls, target.source) == expected


@pytest.mark.parametrize("text", ["collector:4317", "127.0.0.1:4317", "grpc://collector:4317", "http://"])
def test_the_flag_refuses_an_endpoint_that_does_not_say_plaintext_or_tls(text):
    with pytest.raises(ValueError, match=r"http://HOST:PORT \(plaintext\) or https://HOST:PORT \(TLS\)"):
        tracing.check_otlp_endpoint(text)
    assert tracing.check_otlp_endpoint("http://c:4317") == "http://c:4317"


class _Events:
    """The lines an `EventLog` received, in order."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields) -> None:
        self.lines.append(("warning", event, fields))


def test_an_unreachable_collector_is_one_warning_per_outage():
    from pagoda.launch.commands import free_port

    events = _Events()
    reporter = tracing._CollectorReporter(
        tracing.OtlpTarget(f"127.0.0.1:{free_port()}", True, "--otlp-endpoint"), events
    )
    reporter.check_at_start(wait_s=0.5)  # nothing listens there
    reporter.outcome(False, "an export of spans failed")
    reporter.outcome(False, "an export of spans failed")
    assert [(level, event) for level, event, _ in events.lines] == [("warning", "otlp_collector_unreachable")]
    assert "a plaintext collector needs http://" in events.lines[0][2]["reason"]
    reporter.outcome(True)
    reporter.outcome(True)
    reporter.outcome(False, "an export of spans failed")
    assert [event for _, event, _ in events.lines[1:]] == ["otlp_collector_reachable", "otlp_collector_unreachable"]


def test_a_reachable_collector_is_no_warning():
    from support.otlp_receiver import OtlpReceiver

    events = _Events()
    with OtlpReceiver() as receiver:
        target = tracing.otlp_target(receiver.endpoint, {})
        assert not target.tls
        tracing._CollectorReporter(target, events).check_at_start(wait_s=10)
    assert events.lines == []
