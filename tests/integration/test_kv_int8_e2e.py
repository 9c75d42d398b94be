"""An int8 KV cache served end to end (``pagoda serve --kv-cache-dtype int8``): reported by GetModelInfo and
status, the pool sized from the executor's block count, prefix-cached and chunked prefills giving the tokens a
recompute gives, HF's greedy tokens, and a bad KV dtype refused at startup."""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import subprocess
import sys

import pytest
import torch
from support.system import fp32_launcher

from executor_svc.kv.cache import KVCacheSpec
from pagoda.launch.commands import free_port
from pagoda_client import Client

pytestmark = pytest.mark.integration

BUDGET = 256 * 1024
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def int8_system(tiny_model_dir, tmp_path_factory):
    """fp32 weights, an int8 KV cache, prefill chunks of at most 48 tokens (so prompts cross chunk boundaries)."""
    with fp32_launcher(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        f"{BUDGET // 1024}KiB",
        block_size=BLOCK_SIZE,
        kv_cache_dtype="int8",
        extra_scheduler_args=["--max-num-batched-tokens", "48"],
    ) as system:
        yield system


def _tiny_spec(model_dir, dtype: torch.dtype) -> KVCacheSpec:
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    return KVCacheSpec(config["num_hidden_layers"], kv_heads, head_dim, BLOCK_SIZE, dtype)


def test_int8_is_reported_and_the_pool_has_the_blocks_the_budget_holds(int8_system, tiny_model_dir):
    with Client(int8_system.target, timeout=60) as client:
        info = client.model_info()
        status = client.status()
    assert info.kv_cache_dtype == "int8" and info.dtype == "float32"
    (executor,) = status.executors
    assert executor.kv_cache_dtype == "int8"
    int8, fp32 = _tiny_spec(tiny_model_dir, torch.int8), _tiny_spec(tiny_model_dir, torch.float32)
    assert executor.num_kv_blocks == BUDGET // int8.bytes_per_block  # the scheduler's pool: the executor's count
    assert executor.num_kv_blocks >= 3 * (BUDGET // fp32.bytes_per_block)  # head_dim 16: 64 bytes a row vs 16 + 4


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


def _hf_logprobs(model_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """HF fp32's log-probabilities [n, V] of the positions that produced ``generated`` (teacher-forced)."""
    from support.tiny_model import _load

    with torch.no_grad():
        logits = _load(model_dir)(torch.tensor([prompt + generated])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def test_every_greedy_step_stays_close_to_transformers_fp32(int8_system, tiny_model_dir):
    """Decode and chunked prefill over int8 K/V: at every step, the token the server picked is HF fp32's choice up
    to a near-tie, and its logprob is HF's within 0.15 (teacher-forced on the server's own tokens, so a tie that
    went the other way early does not hide the later steps). This random model's rows are 16 values with
    outliers, its logits flat: an int8 cache moves a logprob by up to ~0.1 here, a bf16 one by ~0.025 (measured
    on these prompts); a wrong scale moves them by whole units. Exact greedy tokens are what an fp32 cache is held
    to (test_e2e_tiny.py); the real model's perplexity is in docs/quantization.md."""
    prompts = _prompts(5, seed=3)
    with Client(int8_system.target, timeout=120) as client:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: client.generate(token_ids=p, max_tokens=16, temperature=0, ignore_eos=True, logprobs=0),
                    prompts,
                )
            )
    for prompt, result in zip(prompts, results):
        expected = _hf_logprobs(tiny_model_dir, prompt, result.token_ids)
        for step, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
            assert abs(entry.sampled.logprob - expected[step, token].item()) < 0.15, step
            assert expected[step].max().item() - expected[step, token].item() < 0.1, step  # argmax, or a near-tie


def test_a_cached_prefix_gives_the_tokens_of_a_recompute(int8_system):
    """The prefix cache hands out int8 blocks (with their scales) exactly as they were written."""
    (prefix,) = _prompts(1, seed=11)
    prefix = (prefix * 3)[:100]  # six full blocks of 16
    with Client(int8_system.target, timeout=120) as client:
        first = client.generate(token_ids=prefix + [5, 6], max_tokens=12, temperature=0, ignore_eos=True)
        cached = client.generate(token_ids=prefix + [7, 8], max_tokens=12, temperature=0, ignore_eos=True)
        recomputed = client.generate(
            token_ids=prefix + [7, 8], max_tokens=12, temperature=0, ignore_eos=True, cache_salt="fresh"
        )
    assert first.usage.cached_tokens == 0
    assert cached.usage.cached_tokens >= 96 and recomputed.usage.cached_tokens == 0
    assert cached.token_ids == recomputed.token_ids


@pytest.mark.parametrize("bad", ["fp8", "int4"])
def test_an_unknown_kv_cache_dtype_stops_the_executor_with_a_clear_error(tiny_model_dir, bad):
    argv = [sys.executable, "-m", "executor_svc.main", "--host", "127.0.0.1", "--port", str(free_port())]
    argv += ["--model", str(tiny_model_dir), "--kv-cache-dtype", bad, "--log-format", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"unsupported KV cache dtype '{bad}'; use auto (the model dtype)" in done.stdout + done.stderr


def test_an_int8_prefix_served_from_the_offload_tier_gives_the_recomputed_tokens(tiny_model_dir, tmp_path):
    """The tier stores an int8 block's rows and scales unchanged: a restarted executor serves the prompt from its
    tier with the tokens it computed; an fp32-KV executor on the same directory never reads those blocks."""
    prompt = [random.Random(21).randrange(3, 384) for _ in range(600)]
    tier = ["--kv-offload-dir", str(tmp_path / "tier"), "--kv-offload-size", "64MiB"]
    options = dict(block_size=BLOCK_SIZE, extra_executor_args=tier)
    with fp32_launcher(tiny_model_dir, tmp_path / "a", "4MiB", kv_cache_dtype="int8", **options) as system:
        cold = _greedy(system.target, prompt)
        system.kill_executor(0, signal.SIGTERM)  # drains and stores what is queued
        system.restart_executor(0)
        warm = _greedy(system.target, prompt)
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens_offloaded == 592  # every full block but the last, from the tier
    assert warm.token_ids == cold.token_ids
    with fp32_launcher(tiny_model_dir, tmp_path / "b", "4MiB", **options) as system:
        other_layout = _greedy(system.target, prompt)
    assert other_layout.usage.cached_tokens_offloaded == 0  # fp32 rows: another layout, a miss


def _greedy(target: str, token_ids: list[int]):
    with Client(target, timeout=120, max_retries=3) as client:
        return client.generate(token_ids=token_ids, max_tokens=8, temperature=0, ignore_eos=True)
