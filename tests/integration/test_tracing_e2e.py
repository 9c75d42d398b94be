"""Tracing through the real processes, received by an in-process OTLP/gRPC receiver (docs/tracing.md).

One request through `pagoda generate` (the client library in its own process)
-> scheduler -> executor: one trace id across the three processes, the
parent/child structure, the queue, prefill and chunk spans, an executor step
span linked to the request, and trace ids in both services' log lines. Then a
request preempted by a tiny KV pool, and one whose executor is SIGKILLed from
outside (two executors), carry those events.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from support.otlp_receiver import OtlpReceiver, ReceivedSpan
from support.services import read_until
from support.system import fp32_launcher

from pagoda.launch.launcher import Launcher, free_port
from pagoda_client import Client

pytestmark = pytest.mark.integration

# Export every 100 ms (the SDK's default is 5 s).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
SPAN_WAIT_S = 30.0


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


def _traceparent(rng: random.Random) -> str:
    return f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"


def _of_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} {name} spans: {[(s.service, s.name) for s in spans]}"
    return found[0]


def _request_done(trace_id: str):
    """A predicate: the trace's request span arrived (it ends last in the scheduler)."""
    return lambda spans: any(s.name == "pagoda.request" for s in _of_trace(spans, trace_id))


def _log_lines(log_dir: Path, event: str) -> list[dict]:
    lines = []
    for path in log_dir.glob("*.log"):
        lines += [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{") and f'"{event}"' in x]
    return [x for x in lines if x.get("event") == event]


def test_one_request_is_one_trace_across_client_scheduler_and_executor(tiny_model_dir, receiver, tmp_path):
    rng = random.Random(21)
    prompt = [rng.randrange(3, 384) for _ in range(100)]
    endpoint = ["--otlp-endpoint", receiver.endpoint]
    http_port = free_port()
    with fp32_launcher(
        tiny_model_dir,
        tmp_path,
        block_size=16,
        env=FAST_EXPORT,
        extra_scheduler_args=[*endpoint, "--max-num-batched-tokens", "32", "--log-format", "json"],
        extra_executor_args=[*endpoint, "--log-format", "json"],
        http_port=http_port,
    ) as system:
        argv = [sys.executable, "-m", "pagoda_client.cli", "generate", "--target", system.target, *endpoint]
        argv += ["--token-ids", ",".join(map(str, prompt)), "--max-tokens", "8", "--temperature", "0"]
        argv += ["--ignore-eos", "--json", "--request-id", "traced-1"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **FAST_EXPORT})
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(json.loads(done.stdout)["token_ids"]) == 8
        spans = receiver.wait_for(
            lambda got: (
                any(s.name == "pagoda.client.generate" for s in got)
                and any(s.name == "pagoda.request" and s.attributes.get("pagoda.request_id") == "traced-1" for s in got)
                and any(
                    s.name == "executor.sequence" and s.attributes.get("pagoda.request_id") == "traced-1" for s in got
                )
            ),
            SPAN_WAIT_S,
            "the client's, the scheduler's and the executor's spans",
        )
        client = next(s for s in spans if s.name == "pagoda.client.generate")
        trace = _of_trace(spans, client.trace_id)
        assert {s.service for s in trace} == {"pagoda-client", "pagoda-scheduler", "pagoda-executor"}
        request = _one(trace, "pagoda.request")
        assert request.parent_span_id == client.span_id and request.service == "pagoda-scheduler"
        assert request.attributes["pagoda.request_id"] == "traced-1"
        assert request.attributes["pagoda.finish_reason"] == "length"
        for name in ("queue", "prefill", "decode", "finish"):
            assert _one(trace, name).parent_span_id == request.span_id, name
        queue, prefill = _one(trace, "queue"), _one(trace, "prefill")
        assert queue.attributes["pagoda.queue_reason"] == "new" and queue.end_ns <= prefill.start_ns + 1
        chunks = sorted((s for s in trace if s.name == "prefill.chunk"), key=lambda s: s.start_ns)
        assert [c.attributes["pagoda.num_tokens"] for c in chunks] == [32, 32, 32, 4]
        assert all(c.parent_span_id == prefill.span_id for c in chunks)
        assert _one(trace, "finish").attributes["pagoda.finish_reason"] == "length"
        sequence = _one(trace, "executor.sequence")
        assert sequence.service == "pagoda-executor" and sequence.parent_span_id == request.span_id
        steps = [s for s in spans if s.name == "executor.step" and (request.trace_id, request.span_id) in s.links]
        # 4 prefill chunks and 7 more decode steps: every step this request took part in, linked.
        assert len(steps) >= 8, len(steps)
        assert all(s.trace_id != request.trace_id and s.parent_span_id == "" for s in steps)
        assert all(s.attributes["pagoda.batch_size"] >= 1 and s.attributes["pagoda.forward_ns"] > 0 for s in steps)
        assert sum(s.attributes["pagoda.num_tokens"] for s in steps) >= 100 + 7
        _check_http_traceparent(http_port, receiver)
    # Log lines name the trace: the scheduler's admission and the executor's sequence.
    for event in ("request_admitted", "sequence_added"):
        lines = [x for x in _log_lines(tmp_path, event) if x.get("request_id") == "traced-1"]
        assert lines and all(x.get("trace_id") == client.trace_id for x in lines), (event, lines)


def _check_http_traceparent(http_port: int, receiver: OtlpReceiver) -> None:
    """The OpenAI-compatible HTTP API continues the trace of a `traceparent` header."""
    traceparent = _traceparent(random.Random(1))
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "traceparent": traceparent}
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60) as response:
        assert response.status == 200
    _, trace_id, span_id, _ = traceparent.split("-")
    spans = receiver.wait_for(_request_done(trace_id), SPAN_WAIT_S, "the HTTP request's span")
    assert _one(_of_trace(spans, trace_id), "pagoda.request").parent_span_id == span_id


def test_a_preempted_request_carries_the_preemption(tiny_model_dir, receiver, tmp_path):
    """Six blocks of 16 tokens for four requests of 20 + 60 tokens (5 blocks each): some are preempted."""
    rng = random.Random(5)
    traceparents = [_traceparent(rng) for _ in range(4)]
    requests = [dict(token_ids=[rng.randrange(3, 384) for _ in range(20)], max_tokens=60) for _ in range(4)]
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    with fp32_launcher(tiny_model_dir, tmp_path, kv_cache_memory="48KiB", block_size=16, env=env) as system:
        with Client(system.target, timeout=120, max_retries=0) as client:

            def run(i: int) -> list[int]:
                options = dict(temperature=0, ignore_eos=True, traceparent=traceparents[i])
                return client.generate(**requests[i], **options).token_ids

            with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
                results = list(pool.map(run, range(len(requests))))
            assert client.status().num_preemptions_total > 0, "the pool was not under pressure"
    assert [len(r) for r in results] == [60] * 4
    trace_ids = [tp.split("-")[1] for tp in traceparents]
    spans = receiver.wait_for(lambda got: all(_request_done(t)(got) for t in trace_ids), SPAN_WAIT_S, "4 requests")
    preempted = 0
    for trace_id in trace_ids:
        trace = _of_trace(spans, trace_id)
        request = _one(trace, "pagoda.request")
        events = [e for s in trace if s.name in ("pagoda.request", "decode") for e in s.event_names()]
        assert events.count("preempted") == request.attributes["pagoda.num_preemptions"]
        if "preempted" in events:
            preempted += 1
            reasons = [s.attributes["pagoda.queue_reason"] for s in trace if s.name == "queue"]
            assert "preempted" in reasons
            assert len([s for s in trace if s.name == "prefill"]) >= 2
    assert preempted > 0


def test_a_request_survives_an_executor_sigkill_with_the_event_in_its_trace(receiver, tmp_path):
    """Two simulated executors; the one computing the request is killed (kill -9 from outside) mid-stream."""
    traceparent = _traceparent(random.Random(9))
    trace_id = traceparent.split("-")[1]
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}
    with Launcher(
        num_executors=2,
        log_dir=tmp_path,
        env=env,
        extra_executor_args=["--simulate", "--simulate-time-scale", "1"],
        startup_timeout_s=120,
    ) as system:
        with Client(system.target, timeout=120, max_retries=0) as client:
            tokens: list[int] = []
            killed = ""
            for delta in client.stream(
                token_ids=[7] * 30, max_tokens=300, temperature=0.8, seed=3, traceparent=traceparent
            ):
                tokens += delta.token_ids
                if len(tokens) >= 20 and not killed:
                    busy = [e.address for e in client.status().executors if e.num_running]
                    assert len(busy) == 1, busy
                    killed = busy[0]
                    system.kill_executor(system.executor_addresses.index(killed), signal.SIGKILL)
    assert killed and len(tokens) == 300
    spans = receiver.wait_for(_request_done(trace_id), SPAN_WAIT_S, "the request span")
    trace = _of_trace(spans, trace_id)
    request, decode = _one(trace, "pagoda.request"), _one(trace, "decode")
    lost = [attrs for name, attrs in decode.events if name == "executor_lost"]
    assert lost and lost[0]["pagoda.executor"] == killed
    assert [
        s.attributes["pagoda.queue_reason"]
        for s in sorted((s for s in trace if s.name == "queue"), key=lambda s: s.start_ns)
    ] == ["new", "executor_lost"]
    prefills = sorted((s for s in trace if s.name == "prefill"), key=lambda s: s.start_ns)
    assert len(prefills) == 2 and prefills[1].attributes["pagoda.recompute"] is True
    assert prefills[1].attributes["pagoda.executor"] != killed
    # The survivor's part: its sequence span under the request, its steps linked to the request.
    survivor = [s for s in trace if s.name == "executor.sequence"]
    assert survivor and all(s.parent_span_id == request.span_id for s in survivor)
    assert any((trace_id, request.span_id) in s.links for s in spans if s.name == "executor.step")


def test_one_serve_flag_traces_the_scheduler_and_the_executors(tiny_model_dir, receiver, tmp_path):
    """`pagoda serve --otlp-endpoint URL`: both services export, each says where at start, one request is one trace."""
    port = free_port()
    argv = [sys.executable, "-m", "pagoda_client.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port)]
    argv += ["--log-dir", str(tmp_path), "--kv-offload-dir", "", "--dtype", "float32", "--kv-cache-memory", "256KiB"]
    argv += ["--otlp-endpoint", receiver.endpoint, "--log-format", "json", "--no-restart"]
    env = {**os.environ, **FAST_EXPORT}
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        env.pop(name, None)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        read_until(proc, "Press Ctrl-C", 180)
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            result = client.generate(token_ids=[5, 6, 7, 8], max_tokens=4, ignore_eos=True, request_id="serve-traced")
        assert len(result.token_ids) == 4
        spans = receiver.wait_for(
            lambda got: (
                any(
                    s.name == "executor.sequence" and s.attributes.get("pagoda.request_id") == "serve-traced"
                    for s in got
                )
                and any(
                    s.name == "pagoda.request" and s.attributes.get("pagoda.request_id") == "serve-traced" for s in got
                )
            ),
            SPAN_WAIT_S,
            "the scheduler's and the executor's spans of the request",
        )
        request = next(
            s for s in spans if s.name == "pagoda.request" and s.attributes["pagoda.request_id"] == "serve-traced"
        )
        assert {s.service for s in _of_trace(spans, request.trace_id)} == {"pagoda-scheduler", "pagoda-executor"}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    address = receiver.endpoint.removeprefix("http://")
    starts = _log_lines(tmp_path, "tracing_export")
    assert sorted(x["service"] for x in starts) == ["pagoda-executor", "pagoda-scheduler"]
    assert all(x["endpoint"] == address and x["tls"] is False and x["source"] == "--otlp-endpoint" for x in starts)
    assert _log_lines(tmp_path, "otlp_collector_unreachable") == []
