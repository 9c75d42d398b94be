"""Speculative decoding through the real system (tiny random Llama): the same tokens as without it.

One system speculates (n-gram drafts, 4 per step) over two executors with
small KV pools, so that concurrent requests are preempted and recomputed; the
module's plain system (`tiny_system`, no speculation) and transformers are the
references. Last, an executor is killed (`kill -9`) mid-stream. The random
tiny model rarely repeats itself, so most drafts are rejected; two prompts are
known to make it loop, which n-gram drafts predict, and the first test checks
that drafts were accepted, so the accepting path runs too.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal

import pytest
from support.pool import wait_pool_whole
from support.streams import KillOnce, mixed_requests, run_streams
from support.system import fp32_launcher
from support.tiny_model import hf_greedy

from pagoda_client import Client

pytestmark = pytest.mark.integration
SPECULATIVE_ARGS = ["--speculative", "ngram", "--num-speculative-tokens", "4", "--speculative-max-batch", "8"]


@pytest.fixture(scope="module")
def spec_system(tiny_model_dir, tmp_path_factory):
    """Two executors with 24 KV blocks of 16 tokens each, their scheduler speculating."""
    logs = tmp_path_factory.mktemp("spec-logs")
    with fp32_launcher(
        tiny_model_dir,
        logs,
        kv_cache_memory="96KiB",
        block_size=16,
        num_executors=2,
        extra_scheduler_args=SPECULATIVE_ARGS,
    ) as system:
        yield system


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup is for), of 10-60 tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, 384) for _ in range(rng.randrange(3, 8))]
        prompts.append((phrase * 12)[: rng.randrange(10, 60)])
    return prompts


def _generate_all(target: str, requests: list[dict]) -> list:
    with Client(target, timeout=120) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda kwargs: client.generate(**kwargs), requests))


# The tiny model (random weights, seed 0) falls into a loop after these prompts within 80 tokens, which
# n-gram drafts then predict; most of its outputs never repeat.
LOOPING_PROMPTS = [[49] * 32, [298] * 30]


def test_greedy_equals_transformers_across_preemption_and_drafts_are_accepted(spec_system, tiny_model_dir):
    prompts = LOOPING_PROMPTS + _prompts(6, seed=1)
    requests = [dict(token_ids=p, max_tokens=80, temperature=0, ignore_eos=True) for p in prompts]
    results = _generate_all(spec_system.target, requests)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(tiny_model_dir, prompt, 80)
    with Client(spec_system.target, timeout=30) as client:
        status = client.status()
        wait_pool_whole(client)
    assert status.num_preemptions_total > 0, "the pool was large enough: nothing was preempted"
    assert status.spec_accepted_tokens_total > 0 and status.spec_num_drafts_total > 0


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(spec_system, tiny_system):
    prompts = _prompts(6, seed=2)
    requests = [
        dict(token_ids=p, max_tokens=40, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    speculated = _generate_all(spec_system.target, requests)
    plain = _generate_all(tiny_system.target, requests)
    assert [r.token_ids for r in speculated] == [r.token_ids for r in plain]


def test_stop_strings_end_where_plain_decoding_ends(spec_system, tiny_system):
    prompt = _prompts(1, seed=3)[0]
    with Client(tiny_system.target, timeout=60) as client:
        full = client.generate(token_ids=prompt, max_tokens=60, temperature=0, ignore_eos=True)
    # Stop strings cut from the looping text at many points: most fall inside an accepted run of drafts.
    text = full.text
    stops = sorted({text[i : i + 3] for i in range(4, len(text) - 3, 5) if text[i : i + 3].strip()})
    assert len(stops) >= 3, f"too little text to cut stop strings from: {text!r}"
    requests = [dict(token_ids=prompt, max_tokens=60, temperature=0, ignore_eos=True, stop=[s]) for s in stops]
    speculated = _generate_all(spec_system.target, requests)
    plain = _generate_all(tiny_system.target, requests)
    for stop, got, want in zip(stops, speculated, plain):
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason), stop
        assert got.usage.completion_tokens == want.usage.completion_tokens


def test_prefix_cache_hits_give_the_same_tokens(spec_system, tiny_model_dir):
    prompt = _prompts(1, seed=4)[0] * 2
    with Client(spec_system.target, timeout=60) as client:
        first = client.generate(token_ids=prompt, max_tokens=50, temperature=0, ignore_eos=True)
        second = client.generate(token_ids=prompt, max_tokens=50, temperature=0, ignore_eos=True)
        assert second.usage.cached_tokens > 0
        wait_pool_whole(client)
    assert first.token_ids == second.token_ids == hf_greedy(tiny_model_dir, prompt, 50)


def test_pool_is_whole_after_200_mixed_requests(spec_system):
    rng = random.Random(5)
    requests = []
    for i, prompt in enumerate(_prompts(200, seed=6)):
        kwargs = dict(token_ids=prompt, max_tokens=rng.randrange(1, 60), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.3:
            kwargs.update(temperature=1.0, seed=i)
        else:
            kwargs.update(temperature=0)
        if rng.random() < 0.2:
            kwargs.update(stop=["e", " t"])
        requests.append(kwargs)
    results = _generate_all(spec_system.target, requests)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    with Client(spec_system.target, timeout=30) as client:
        wait_pool_whole(client, nothing_waiting=True)


def test_executor_killed_mid_stream_changes_no_token(spec_system):
    """Runs last: the killed executor stays dead; its sequences are recomputed on the other one."""
    requests = mixed_requests(8, 80, seed=900)
    with Client(spec_system.target, timeout=180) as client:
        expected = run_streams(client, requests)
        total = sum(len(record.token_ids) for record in expected)
        kill = KillOnce(total // 4, lambda: os.kill(spec_system.executors[0].pid, signal.SIGKILL))
        got = run_streams(client, requests, kill)
    assert kill.fired_at is not None, "the executor was never killed"
    for i, (run, reference) in enumerate(zip(got, expected)):
        assert (run.token_ids, run.text) == (reference.token_ids, reference.text), f"stream {i}"
