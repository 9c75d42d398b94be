"""Each new family over the real gRPC path: a scheduler and an executor started as processes.

Tiny random checkpoints of Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen3-MoE and
OLMoE (the executor tests' shapes, with a trained tokenizer). Three concurrent
requests (so steps mix prefill chunks and decodes): 64 greedy tokens each
equal transformers' generate, and the logprobs that come back (the sampled
token and the top 5, from the executor's fp32 logits) equal transformers'
log-softmax at every position within 1e-4.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import pytest
import torch
from support.tiny_model import hf_greedy, write_tokenizer_files

from pagoda_client import Client
from tests.executor.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.integration

VOCAB = 384
FAMILIES = ("gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "olmoe")


@pytest.fixture(scope="module", params=FAMILIES)
def family_system(request, tmp_path_factory):
    """(folder, running system) of one family, fp32, 4-token KV blocks (prompts span many)."""
    from pagoda.launch.launcher import Launcher

    root = tmp_path_factory.mktemp(request.param)
    folder = write_tokenizer_files(make_tiny_checkpoint(root, request.param, vocab_size=VOCAB), VOCAB)
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
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 23, 40)]


def test_greedy_and_logprobs_match_transformers(family_system):
    folder, system = family_system
    prompts = _prompts()
    with Client(system.target, timeout=300) as client:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: client.generate(token_ids=p, max_tokens=64, temperature=0, ignore_eos=True, logprobs=5),
                    prompts,
                )
            )
        info = client.model_info()
    assert (info.model_name, info.vocab_size) == (folder.name, VOCAB)
    assert info.architecture == json.loads((folder / "config.json").read_text())["architectures"][0]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(folder, prompt, 64)
        _assert_logprobs(folder, prompt, result)


def _assert_logprobs(folder, prompt: list[int], result) -> None:
    """Every generated position: the sampled token's and the top 5 logprobs equal transformers'."""
    from support.tiny_model import _load

    with torch.no_grad():
        logits = _load(folder)(torch.tensor([prompt + result.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [64, V], the rows that sampled
    assert len(result.logprobs) == len(result.token_ids) == expected.shape[0]
    for row, entry in zip(expected, result.logprobs):
        assert abs(entry.sampled.logprob - row[entry.sampled.token_id].item()) < 1e-4
        assert [t.token_id for t in entry.top] == row.topk(5).indices.tolist()
        for top in entry.top:
            assert abs(top.logprob - row[top.token_id].item()) < 1e-4
