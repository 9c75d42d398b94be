"""Overload: a full waiting queue refuses at once; a burst far beyond the KV
capacity completes exactly, without deadlock or leaked blocks."""

from __future__ import annotations

import concurrent.futures
import random
import time

import grpc
import pytest
from support.pool import wait_pool_whole
from support.system import fp32_launcher

from pagoda.v1 import generation_pb2 as g
from pagoda_client import Client

pytestmark = pytest.mark.integration
GENERATE = "/pagoda.v1.Generation/Generate"


def _request(prompt: list[int], max_tokens: int) -> g.GenerateRequest:
    msg = g.GenerateRequest(token_ids=g.TokenIdsInput(token_ids=prompt))
    msg.sampling.temperature = 0.0
    msg.stopping.max_tokens = max_tokens
    msg.stopping.ignore_eos = True
    return msg


def _timed_generate(target: str, request: g.GenerateRequest, timeout_s: float = 120):
    """(status, token ids, seconds until the call ended)."""
    start = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream(
            GENERATE,
            request_serializer=g.GenerateRequest.SerializeToString,
            response_deserializer=g.GenerateResponse.FromString,
        )
        try:
            tokens = [t for response in call(request, timeout=timeout_s) for t in response.token_ids]
            return grpc.StatusCode.OK, tokens, time.monotonic() - start
        except grpc.RpcError as error:
            return error.code(), [], time.monotonic() - start


def _assert_pool_whole(target: str, timeout_s: float = 10) -> None:
    with Client(target, timeout=10) as client:
        wait_pool_whole(client, timeout_s, nothing_waiting=True)


def test_full_waiting_queue_refuses_at_once(security_model_dir, tmp_path):
    args = ["--max-waiting-requests", "4", "--max-num-seqs", "2"]
    prompts = [[random.Random(i).randrange(3, 384) for _ in range(12)] for i in range(24)]
    with fp32_launcher(security_model_dir, tmp_path, extra_scheduler_args=args) as system:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: _timed_generate(system.target, _request(p, 120)), prompts))
        refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [r for r in results if r[0] == grpc.StatusCode.OK]
        assert len(refused) + len(served) == len(prompts), [r[0] for r in results]
        assert refused and len(served) >= 4, (len(refused), len(served))  # at least the queue bound
        assert all(len(tokens) == 120 for _, tokens, _ in served)
        # refused at once: before any served request could finish, and well under a second
        assert max(s for _, _, s in refused) < min(1.0, min(s for _, _, s in served))
        _assert_pool_whole(system.target)


def test_burst_of_ten_times_kv_capacity_completes_exactly(security_model_dir, tmp_path):
    with fp32_launcher(security_model_dir, tmp_path, "64KiB", block_size=16) as system:
        with Client(system.target, timeout=120) as client:
            executor = client.status().executors[0]
            capacity_tokens = executor.num_kv_blocks * 16
            prompts = [[random.Random(100 + i).randrange(3, 384) for _ in range(30 + 7 * i)] for i in range(5)]
            solo = [
                client.generate(token_ids=p, max_tokens=48, temperature=0, ignore_eos=True).token_ids for p in prompts
            ]
        tokens_per_request = sum(len(p) + 48 for p in prompts) / len(prompts)
        num_requests = int(10 * capacity_tokens / tokens_per_request) + 1
        burst = [i % len(prompts) for i in range(num_requests)]
        with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
            results = list(pool.map(lambda i: _timed_generate(system.target, _request(prompts[i], 48), 300), burst))
        assert [code for code, _, _ in results] == [grpc.StatusCode.OK] * num_requests
        for i, (_, tokens, _) in zip(burst, results):
            assert tokens == solo[i]
        _assert_pool_whole(system.target)
        with Client(system.target, timeout=30) as client:
            assert client.status().num_preemptions_total > 0, "the burst should have needed preemption"
