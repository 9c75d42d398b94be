"""The client, async client and CLI against a real system (tiny random Llama)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
from fixtures_tiny import TINY_EOS_ID, TINY_VOCAB_SIZE

from pagoda.launch.launcher import Launcher, free_port
from pagoda_client import AsyncClient, Client, FinishReason, PagodaError

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 42, 99, 100, 7, 250]


def _wait_idle(client: Client, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.status()
        if status.num_running == 0 and status.num_waiting == 0:
            return
        assert time.monotonic() < deadline, f"requests still running: {status}"
        time.sleep(0.05)


def test_model_info(client_tiny_system):
    with Client(client_tiny_system.target, timeout=30) as client:
        info = client.model_info()
    assert info.vocab_size == TINY_VOCAB_SIZE
    assert TINY_EOS_ID in info.eos_token_ids
    assert info.has_chat_template and info.max_model_len > 0


def test_sync_whole_and_streamed_are_identical(client_tiny_system):
    with Client(client_tiny_system.target, timeout=60) as client:
        whole = client.generate(token_ids=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, request_id="w-1")
        deltas = list(client.stream(token_ids=PROMPT, max_tokens=12, temperature=0, ignore_eos=True))
    assert len(whole.token_ids) == 12
    assert whole.finish_reason is FinishReason.LENGTH
    assert whole.request_id == "w-1"
    assert whole.prompt_token_ids == PROMPT
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT), 12)
    assert 0 <= whole.timings.queue_s <= whole.timings.time_to_first_token_s <= whole.timings.total_s
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert [d.finish_reason for d in deltas][-1] is FinishReason.LENGTH
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_async_matches_sync(client_tiny_system):
    with Client(client_tiny_system.target, timeout=60) as client:
        expected = client.generate(token_ids=PROMPT, max_tokens=10, temperature=0, ignore_eos=True)

    async def run() -> tuple[list[int], list[int]]:
        async with AsyncClient(client_tiny_system.target, timeout=60) as aclient:
            whole = await aclient.generate(token_ids=PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
            streamed: list[int] = []
            async with aclient.stream(token_ids=PROMPT, max_tokens=10, temperature=0, ignore_eos=True) as deltas:
                async for delta in deltas:
                    streamed.extend(delta.token_ids)
            return whole.token_ids, streamed

    whole_ids, streamed_ids = asyncio.run(run())
    assert whole_ids == expected.token_ids == streamed_ids


def test_chat_messages_use_the_template(client_tiny_system):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    with Client(client_tiny_system.target, timeout=60) as client:
        result = client.chat(messages, max_tokens=4, temperature=0, ignore_eos=True)
        templated = client.tokenize(messages=messages)
        plain = client.tokenize("Hello", add_special_tokens=False)
        assert client.detokenize(plain) == "Hello"
    assert result.prompt_token_ids == templated
    assert len(result.token_ids) == 4 and len(templated) > len(plain)


def test_closing_a_stream_cancels_the_request(client_tiny_system):
    with Client(client_tiny_system.target, timeout=60) as client:
        stream = client.stream(token_ids=PROMPT, max_tokens=900, temperature=0, ignore_eos=True)
        received = [next(stream), next(stream)]
        stream.close()
        assert list(stream) == []
        assert sum(len(d.token_ids) for d in received) < 900
        _wait_idle(client)


def test_deadline_exceeded(client_tiny_system):
    with Client(client_tiny_system.target) as client:
        start = time.monotonic()
        with pytest.raises(PagodaError) as caught:
            client.generate(token_ids=PROMPT, max_tokens=900, ignore_eos=True, timeout=0.3)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 5.0
        _wait_idle(client)


def test_async_deadline_exceeded(client_tiny_system):
    async def run() -> grpc.StatusCode:
        async with AsyncClient(client_tiny_system.target, timeout=0.3) as aclient:
            try:
                await aclient.generate(token_ids=PROMPT, max_tokens=900, ignore_eos=True)
            except PagodaError as error:
                return error.code
        return grpc.StatusCode.OK

    assert asyncio.run(run()) == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_argument_is_mapped(client_tiny_system, kwargs, field):
    with Client(client_tiny_system.target, timeout=30) as client:
        with pytest.raises(PagodaError) as caught:
            client.generate(token_ids=PROMPT, request_id="bad-1", **kwargs)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in caught.value.message
        assert caught.value.request_id == "bad-1"
        assert len(client.generate(token_ids=PROMPT, max_tokens=2).token_ids) == 2  # still serving


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagoda_client.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_json_and_streamed_text(client_tiny_system):
    target = client_tiny_system.target
    with Client(target, timeout=60) as client:
        expected = client.generate(token_ids=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    flags = [
        "--token-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--target",
        target,
    ]
    proc = _cli("generate", *flags, "--json")
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert document["token_ids"] == expected.token_ids
    assert document["text"] == expected.text
    assert document["finish_reason"] == "length"
    assert document["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 6,
        "cached_tokens": document["usage"]["cached_tokens"],
        "cached_tokens_offloaded": 0,
    }
    proc = _cli("generate", *flags)
    assert proc.returncode == 0 and proc.stdout == expected.text + "\n"


def test_cli_errors_and_info_commands(client_tiny_system):
    target = client_tiny_system.target
    proc = _cli("generate", "hello", "--max-tokens", "0", "--target", target)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: INVALID_ARGUMENT: ") and "max_tokens" in proc.stderr
    proc = _cli("models", "--json", "--target", target)
    assert proc.returncode == 0 and json.loads(proc.stdout)["vocab_size"] == TINY_VOCAB_SIZE
    proc = _cli("status", "--json", "--target", target)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["executors"]) == 1
    proc = _cli("chat", "Hello", "--max-tokens", "3", "--json", "--target", target)
    assert proc.returncode == 0 and json.loads(proc.stdout)["usage"]["completion_tokens"] <= 3


def test_cli_bench_against_the_system(client_tiny_system, tmp_path):
    out = tmp_path / "bench.json"
    proc = _cli(
        "bench",
        "--target",
        client_tiny_system.target,
        "--num-prompts",
        "6",
        "--input-len-range",
        "4:40",
        "--output-len-range",
        "2:12",
        "--max-concurrency",
        "4",
        "--json",
        str(out),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    document = json.loads(out.read_text())
    records = document["runs"]["pagoda"]["requests"]
    assert [r["output_len"] for r in records] == [r["wanted_output_len"] for r in records]
    assert document["runs"]["pagoda"]["metrics"]["completed"] == 6


def test_retry_before_first_token_when_server_starts_late(client_tiny_model_dir, tmp_path):
    port = free_port()
    with Client(f"127.0.0.1:{port}", max_retries=0) as client:
        with pytest.raises(PagodaError) as caught:
            client.model_info()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    launcher = Launcher(
        str(client_tiny_model_dir),
        port=port,
        dtype="float32",
        kv_cache_memory="512KiB",
        log_dir=tmp_path,
        startup_timeout_s=180,
    )
    starter = threading.Thread(target=lambda: (time.sleep(0.5), launcher.start()))
    try:
        starter.start()
        with Client(
            launcher.target, max_retries=200, retry_backoff_s=0.1, retry_max_backoff_s=0.5, timeout=180
        ) as client:
            result = client.generate(token_ids=PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 3
    finally:
        starter.join()
        launcher.stop()


def test_logprobs_and_seeded_sampling(client_tiny_system):
    with Client(client_tiny_system.target, timeout=60) as client:
        result = client.generate(token_ids=PROMPT, max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
        first = client.generate(token_ids=PROMPT, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
        again = client.generate(token_ids=PROMPT, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    assert [e.sampled.token_id for e in result.logprobs] == result.token_ids
    for entry in result.logprobs:
        assert len(entry.top) == 2 and entry.sampled.logprob <= 0.0
        assert entry.top[0].token_id == entry.sampled.token_id  # greedy picks the most likely token
    assert first.token_ids == again.token_ids


def test_async_unary_calls_match_sync(client_tiny_system):
    messages = [{"role": "user", "content": "Hello"}]
    with Client(client_tiny_system.target, timeout=30) as client:
        expected = (client.model_info(), client.tokenize(messages=messages), client.detokenize(PROMPT))

    async def run() -> tuple[object, ...]:
        async with AsyncClient(client_tiny_system.target, timeout=30) as aclient:
            status = await aclient.status()
            assert [e.state for e in status.executors] == ["READY"]
            return (
                await aclient.model_info(),
                await aclient.tokenize(messages=messages),
                await aclient.detokenize(PROMPT),
            )

    assert asyncio.run(run()) == expected
