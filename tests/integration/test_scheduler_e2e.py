"""Scheduler depth through the real services: KV pressure and the prefix cache."""

from __future__ import annotations

import concurrent.futures
import random

import pytest

from pagoda.launch.launcher import Launcher
from pagoda_client import Client

pytestmark = pytest.mark.integration


def _requests(n: int) -> list[dict]:
    rng = random.Random(5)
    out = []
    for i in range(n):
        kwargs = dict(
            token_ids=[rng.randrange(3, 384) for _ in range(rng.randrange(16, 64))],
            max_tokens=rng.randrange(60, 120),
            ignore_eos=True,
            temperature=0,
        )
        if i % 5 == 0:
            kwargs.update(temperature=0.8, seed=i)
        out.append(kwargs)
    return out


def _run(target: str, requests: list[dict]):
    with Client(target, timeout=600, max_retries=0) as client:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(lambda kw: client.generate(**kw), requests))
        return results, client.status()


def test_five_times_the_pool_completes_with_identical_outputs(tiny_model_dir, tmp_path):
    requests = _requests(100)
    blocks_needed = sum(-(-(len(r["token_ids"]) + r["max_tokens"]) // 16) for r in requests)
    # 512 bytes of KV per token for the tiny model: 16 tokens = 8 KiB per block.
    small_blocks = blocks_needed // 5
    small = f"{small_blocks * 8}KiB"
    with Launcher(
        str(tiny_model_dir), dtype="float32", kv_cache_memory=small, block_size=16, log_dir=tmp_path / "small"
    ) as system:
        tight, status = _run(system.target, requests)
        assert status.executors[0].num_kv_blocks == small_blocks
        assert status.num_preemptions_total > 0, "the pool was not under pressure"
        assert status.executors[0].num_free_kv_blocks == small_blocks
    with Launcher(str(tiny_model_dir), dtype="float32", kv_cache_memory="16MiB", log_dir=tmp_path / "big") as system:
        roomy, status = _run(system.target, requests)
        assert status.num_preemptions_total == 0
    for a, b, r in zip(tight, roomy, requests):
        assert len(a.token_ids) == r["max_tokens"]
        assert a.token_ids == b.token_ids


def test_shared_prefix_is_served_from_cache(tiny_model_dir, tmp_path):
    rng = random.Random(9)
    prefix = [rng.randrange(3, 384) for _ in range(512)]
    with Launcher(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", log_dir=tmp_path) as system:
        with Client(system.target, timeout=120) as client:
            first = client.generate(token_ids=prefix + [7, 8, 9], max_tokens=4, temperature=0, ignore_eos=True)
            assert first.usage.cached_tokens == 0
            second = client.generate(token_ids=prefix + [10, 11], max_tokens=4, temperature=0, ignore_eos=True)
            assert second.usage.cached_tokens >= 480
            salted = client.generate(
                token_ids=prefix + [10, 11], max_tokens=4, temperature=0, ignore_eos=True, cache_salt="tenant-b"
            )
            assert salted.usage.cached_tokens == 0
            assert salted.token_ids == second.token_ids
            status = client.status()
            assert status.prefix_cache_hits_total >= 480
