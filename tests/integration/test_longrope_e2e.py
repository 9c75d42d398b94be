"""Phi-3 LongRoPE over the real gRPC path: a scheduler and an executor started as processes.

A tiny Phi-3 allowing 128 positions whose LongRoPE switches at 32 (its
original_max_position_embeddings), served at 128. Four concurrent requests,
so steps batch sequences of both factor sets: one within 32 tokens, one past
them from its prompt, two crossing them mid-generation. Greedy tokens equal
transformers' generate in fp32, and every returned logprob equals
transformers' log-softmax for that prefix (a forward of the prefix: the set
of its length) within 1e-4. The same requests again hit the prefix cache,
each in blocks of its own set, and give the same tokens.
"""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch
from support.tiny_model import _load, hf_greedy, write_tokenizer_files

from pagoda_client import Client
from tests.executor.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.integration

VOCAB = 384
ORIGINAL = 32
SCALING = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(12)],
    "long_factor": [1.0 + 0.5 * i for i in range(12)],
    "original_max_position_embeddings": ORIGINAL,
}
# (prompt tokens, max tokens): within 32, past 32 from the start, crossing after 12, crossing after 1.
SHAPES = ((9, 20), (40, 24), (20, 30), (31, 12))


@pytest.fixture(scope="module")
def phi3_system(tmp_path_factory):
    from pagoda.launch.launcher import Launcher

    root = tmp_path_factory.mktemp("phi3-longrope")
    checkpoint = make_tiny_checkpoint(
        root,
        "phi3",
        vocab_size=VOCAB,
        max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=SCALING,
    )
    folder = write_tokenizer_files(checkpoint, VOCAB)
    with Launcher(
        str(folder),
        num_executors=1,
        dtype="float32",
        kv_cache_memory="2MiB",
        block_size=4,
        log_dir=root / "logs",
        startup_timeout_s=180,
    ) as system:
        yield folder, system


def _prompts() -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n, _ in SHAPES]


def _generate_all(client: Client, prompts: list[list[int]]) -> list:
    def one(index: int):
        return client.generate(
            token_ids=prompts[index], max_tokens=SHAPES[index][1], temperature=0, ignore_eos=True, logprobs=1
        )

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def test_each_sequence_runs_on_the_set_transformers_gives_it(phi3_system):
    folder, system = phi3_system
    prompts = _prompts()
    with Client(system.target, timeout=300) as client:
        first = _generate_all(client, prompts)
        again = _generate_all(client, prompts)
    expected = [hf_greedy(folder, prompt, max_tokens) for prompt, (_, max_tokens) in zip(prompts, SHAPES)]
    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in again] == expected
    assert all(r.usage.cached_tokens > 0 for r in again)  # each from the blocks of its own set
    for prompt, result in zip(prompts, first):
        _assert_logprobs(folder, prompt, result)


def _assert_logprobs(folder, prompt: list[int], result) -> None:
    """The sampled token's logprob at every position: transformers' forward of that prefix."""
    model = _load(folder)
    tokens = prompt + result.token_ids
    assert len(result.logprobs) == len(result.token_ids)
    with torch.no_grad():
        for i, entry in enumerate(result.logprobs):
            logits = model(torch.tensor([tokens[: len(prompt) + i]])).logits[0, -1].float()
            expected = torch.log_softmax(logits, dim=-1)
            assert entry.sampled.token_id == tokens[len(prompt) + i]
            assert abs(entry.sampled.logprob - expected[entry.sampled.token_id].item()) < 1e-4, (len(prompt), i)
