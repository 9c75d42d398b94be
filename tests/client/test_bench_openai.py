"""``pagoda bench --backend openai`` against Pagoda's real HTTP API (tiny random Llama), and its failures."""

from __future__ import annotations

import json
import math
import re
import socket

import pytest
from fixtures_tiny import TINY_EOS_ID, TINY_VOCAB_SIZE
from support.system import fp32_launcher

from pagoda.launch.launcher import free_port
from pagoda_bench.backend_openai import OpenAIBackendConfig, StreamError, StreamTally, checkpoint_vocab, run_openai
from pagoda_bench.backend_pagoda import PagodaBackendConfig, run_pagoda
from pagoda_bench.metrics import RequestRecord, compute_metrics
from pagoda_bench.progress import ProgressBar
from pagoda_bench.workload import random_workload
from pagoda_client import Client
from pagoda_client.cli import main
from tests.http.conftest import wait_http_health

NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def http_tiny_system(client_tiny_model_dir, tmp_path_factory):
    """(launcher, base_url): one fp32 executor, a scheduler serving gRPC and the HTTP API."""
    port = free_port()
    logs = tmp_path_factory.mktemp("bench-openai-logs")
    with fp32_launcher(client_tiny_model_dir, logs, "512KiB", http_port=port, startup_timeout_s=180) as system:
        base_url = f"http://127.0.0.1:{port}"
        wait_http_health(base_url, timeout_s=60)
        yield system, base_url


def _workload(vocab_size: int = TINY_VOCAB_SIZE):
    return random_workload(NUM_PROMPTS, (4, 48), (2, 16), seed=3, vocab_size=vocab_size, excluded_ids=(TINY_EOS_ID,))


def _run(requests, config: OpenAIBackendConfig) -> tuple[list[RequestRecord], float]:
    return run_openai(requests, [0.0] * len(requests), config, ProgressBar(len(requests), enabled=False))


# ----- the stream's chunks → a record (no server) ------------------------------------------------


def _chunk(text: str | None = None, finish: str | None = None, usage: int | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    chunk: dict = {"object": "text_completion", "choices": choices}
    if usage is not None:
        chunk["usage"] = {"completion_tokens": usage, "prompt_tokens_details": {"cached_tokens": 16}}
    return chunk


def test_tally_credits_textless_tokens_to_the_finishing_chunk():
    record = RequestRecord(0, 20, 5, start_s=1.0)
    tally = StreamTally(record)
    assert [tally.add(_chunk("a"), 1.5), tally.add(_chunk("b"), 1.75), tally.add(_chunk("", "length"), 2.0)] == [
        1,
        1,
        0,
    ]
    assert tally.add(_chunk(usage=5), 2.1) == 0
    assert tally.close() == 3
    assert tally.finished
    assert (record.chunk_times_s, record.chunk_num_tokens) == ([1.5, 1.75, 2.0], [1, 1, 3])
    assert (record.output_len, record.ttft_s, record.itls_s, record.cached_tokens) == (5, 0.5, [0.25, 0.25], 16)


def test_tally_credits_the_last_text_chunk_when_it_finished_the_stream():
    record = RequestRecord(0, 20, 4, start_s=0.0)
    tally = StreamTally(record)
    tally.add(_chunk("a"), 1.0)
    tally.add(_chunk("bc", "length"), 2.0)  # the last token's text and the finish in one chunk (vLLM, Pagoda)
    tally.add(_chunk(usage=4), 2.0)
    assert tally.close() == 2
    assert (record.chunk_times_s, record.chunk_num_tokens) == ([1.0, 2.0], [1, 3])


def test_tally_without_usage_counts_text_chunks():
    record = RequestRecord(0, 20, 9, start_s=0.0)
    tally = StreamTally(record)
    for i, text in enumerate(["a", "", "b", "c"]):
        tally.add(_chunk(text), float(i))
    assert tally.close() == 0
    assert not tally.finished  # no finish_reason: the run records a failure
    assert (record.output_len, record.chunk_times_s) == (3, [0.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "event, message",
    [
        ({"error": {"message": "boom", "type": "server_error"}}, "boom"),
        ({"object": "error", "message": "flat", "code": 400}, "flat"),
        ("not an object", "not an object"),
    ],
)
def test_tally_raises_on_error_events(event, message):
    with pytest.raises(StreamError, match=message):
        StreamTally(RequestRecord(0, 1, 1, 0.0)).add(event, 0.0)


# ----- against the real system --------------------------------------------------------------------


@pytest.mark.integration
def test_openai_backend_forces_lengths_and_matches_the_grpc_backend(http_tiny_system):
    system, base_url = http_tiny_system
    requests = _workload()
    records, duration_s = _run(requests, OpenAIBackendConfig(base_url, request_timeout_s=60))
    assert [r.error for r in records] == [""] * NUM_PROMPTS
    assert all(r.success for r in records)
    assert [r.output_len for r in records] == [q.output_len for q in requests]  # ignore_eos, max_tokens
    for record in records:
        assert 0.0 <= record.start_s < record.chunk_times_s[0] <= duration_s
        assert record.chunk_times_s == sorted(record.chunk_times_s)
    metrics = compute_metrics(records, duration_s)
    assert metrics["completed"] == NUM_PROMPTS and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == sum(q.output_len for q in requests)
    assert math.isfinite(metrics["ttft_ms"]["mean"]) and math.isfinite(metrics["itl_ms"]["mean"])
    grpc_records, _ = run_pagoda(
        requests, [0.0] * NUM_PROMPTS, PagodaBackendConfig(system.target), ProgressBar(NUM_PROMPTS, enabled=False)
    )
    assert [r.output_len for r in grpc_records] == [r.output_len for r in records]


@pytest.mark.integration
def test_cli_openai_backend_uses_the_servers_vocabulary(http_tiny_system, client_tiny_model_dir, tmp_path, capsys):
    system, base_url = http_tiny_system
    with Client(system.target, timeout=30) as client:
        info = client.model_info()
    assert checkpoint_vocab(str(client_tiny_model_dir))[:2] == (info.vocab_size, info.eos_token_ids)
    out = tmp_path / "bench.json"
    argv = ["bench", "--backend", "openai", "--base-url", f"{base_url}/v1/", "--model", str(client_tiny_model_dir)]
    argv += ["--num-prompts", str(NUM_PROMPTS), "--input-len-range", "4:48", "--output-len-range", "2:16"]
    argv += ["--seed", "3", "--max-concurrency", "3", "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    assert f"Serving Benchmark Result (openai {base_url}/v1/)" in capsys.readouterr().out
    document = json.loads(out.read_text())
    records = document["runs"]["openai"]["requests"]
    expected = random_workload(NUM_PROMPTS, (4, 48), (2, 16), 3, info.vocab_size, info.eos_token_ids)
    assert [(r["prompt_len"], r["output_len"]) for r in records] == [(q.prompt_len, q.output_len) for q in expected]
    assert document["runs"]["openai"]["metrics"]["completed"] == NUM_PROMPTS


@pytest.mark.integration
def test_the_same_prompts_sent_again_are_reported_as_served_from_the_cache(
    http_tiny_system, client_tiny_model_dir, capsys
):
    """A second run with the same --seed is mostly prefix-cache hits: the report says its figures include them."""
    _, base_url = http_tiny_system
    argv = ["bench", "--backend", "openai", "--base-url", base_url, "--model", str(client_tiny_model_dir)]
    argv += ["--num-prompts", "4", "--input-len-range", "40:72", "--output-len-range", "2:4", "--seed", "11"]
    argv += ["--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "warning" not in first and _value(first, "Prefix-cached prompt tokens:") == 0
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert _value(again, "Prefix-cached prompt tokens:") > 0
    assert "prompt tokens came from the server's cache" in again.splitlines()[-1]


def _value(report: str, label: str) -> int:
    return int(next(line for line in report.splitlines() if line.startswith(label)).split()[-1])


@pytest.mark.integration
def test_requests_the_server_refuses_are_failed_records(http_tiny_system):
    _, base_url = http_tiny_system
    out_of_vocab = _workload(vocab_size=100_000)  # ids past the tiny vocabulary: 400
    records, _ = _run(out_of_vocab, OpenAIBackendConfig(base_url, request_timeout_s=60))
    assert all(any(t >= TINY_VOCAB_SIZE for t in q.prompt_token_ids) for q in out_of_vocab)
    assert not any(r.success for r in records)
    assert all(r.error.startswith("HTTP 400: ") and "outside the vocabulary" in r.error for r in records)
    records, _ = _run(_workload(), OpenAIBackendConfig(base_url, model_name="no-such-model"))
    assert {r.error.split(":")[0] for r in records} == {"HTTP 404"}
    assert all("no-such-model" in r.error for r in records)


def test_unreachable_server_gives_failed_records_and_a_report(client_tiny_model_dir, tmp_path, capsys):
    dead_url = f"http://127.0.0.1:{free_port()}"
    records, _ = _run(_workload(), OpenAIBackendConfig(dead_url))
    assert {r.error.split(":")[0] for r in records} == {"not sent"}
    assert all("GET /v1/models failed: ClientConnectorError" in r.error for r in records)
    records, _ = _run(_workload(), OpenAIBackendConfig(dead_url, model_name="m"))
    assert all(r.error.startswith("ClientConnectorError") and not r.success for r in records)
    out = tmp_path / "bench.json"
    argv = ["bench", "--backend", "openai", "--base-url", dead_url, "--model", str(client_tiny_model_dir)]
    assert main([*argv, "--num-prompts", "3", "--json", str(out), "--no-progress"]) == 1
    report = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+0\n", report) and re.search(r"Failed requests:\s+3\n", report)
    assert all(r["error"] for r in json.loads(out.read_text())["runs"]["openai"]["requests"])


def test_silent_server_is_bounded_by_both_timeouts():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        records, _ = _run(_workload(), OpenAIBackendConfig(url, model_name="m", request_timeout_s=0.3))
        assert {r.error for r in records} == {"timed out after 0.3 s"}
        records, duration_s = _run(_workload(), OpenAIBackendConfig(url, model_name="m", max_duration_s=0.3))
        assert {r.error for r in records} == {"cancelled: --max-duration-s reached"}
        assert duration_s < 5.0
        records, _ = _run(_workload(), OpenAIBackendConfig(url, max_duration_s=0.3))
        assert {r.error for r in records} == {"not sent: GET /v1/models failed: timed out after 0.3 s"}


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "needs --base-url"),
        (["--base-url", "http://10.1.2.3:8000"], "only targets loopback addresses"),
        (["--base-url", "http://localhost:8000", "--compare-hf"], "go with --backend pagoda"),
    ],
)
def test_cli_refuses_bad_openai_flags(extra, message, capsys):
    assert main(["bench", "--backend", "openai", "--no-progress", *extra]) == 1
    assert message in capsys.readouterr().err
