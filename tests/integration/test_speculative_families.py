"""Speculation through the real system for every architecture: greedy tokens equal transformers'.

For each tiny random checkpoint of the executor tests (one per architecture and
switch: Llama 3 RoPE, a head_dim of its own, Mistral's sliding window, Qwen 2
and 3, Gemma 2 and 3, Phi-3, Mixtral, Qwen3-MoE, OLMoE; plain Llama is
tests/integration/test_draft_model_e2e.py's), a scheduler and an executor as
processes, the executor drafting with the model itself (``--draft-model`` the
same folder) and the scheduler on ``--speculative ngram+draft``: n-gram drafts
where the tokens repeat, the draft model's elsewhere. The KV pool holds 40
blocks of 4 tokens (both models' KV), too few for any two of the five concurrent
requests, so sequences are preempted and recomputed with their drafts; before them, the
first request alone, twice (the second from the prefix cache). Every output equals transformers' greedy
generate (which plain decoding equals: test_e2e_families), the draft model's
drafts are accepted, and the pool is whole afterwards.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
from pathlib import Path

import pytest
from support.pool import wait_pool_whole
from support.services import wait_until
from support.system import fp32_launcher, paused
from support.tiny_model import hf_greedy, write_tokenizer_files

from pagoda_client import Client
from tests.executor.conftest import ARCHS, make_tiny_checkpoint

pytestmark = pytest.mark.integration

VOCAB = 384
BLOCK_SIZE = 4
NUM_BLOCKS = 40
# Each request needs 20-25 blocks (a 20-40 token prompt and 60 outputs): any two running together outgrow
# the pool, and the five are queued together (the executor paused meanwhile), so sequences are preempted.
NUM_OUTPUT = 60
# Plain Llama runs in test_draft_model_e2e.py and test_speculative_e2e.py.
FAMILY_ARCHS = [arch for arch in ARCHS if arch != "llama"]


def _kv_bytes_per_block(folder: Path) -> int:
    """fp32 K and V of one block over all layers (executor_svc.kv.cache.KVCacheSpec.bytes_per_block)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * BLOCK_SIZE * head_dim * 4


@pytest.fixture(scope="module", params=FAMILY_ARCHS)
def drafting_system(request, tmp_path_factory):
    """(folder, running system): the architecture's tiny model drafting for itself, NUM_BLOCKS KV blocks."""
    root = tmp_path_factory.mktemp(request.param)
    folder = write_tokenizer_files(make_tiny_checkpoint(root, request.param, vocab_size=VOCAB), VOCAB)
    # Each block holds the model's KV and its draft model's (the same model): twice the bytes.
    memory = NUM_BLOCKS * 2 * _kv_bytes_per_block(folder)
    with fp32_launcher(
        folder,
        root / "logs",
        kv_cache_memory=str(memory),
        block_size=BLOCK_SIZE,
        extra_executor_args=["--draft-model", str(folder)],
        # Not adaptive: a tiny model drafting for itself does not pay, but its drafts are what is tested here.
        extra_scheduler_args=[
            "--speculative",
            "ngram+draft",
            "--num-speculative-tokens",
            "4",
            "--speculative-adaptive",
            "false",
        ],
        startup_timeout_s=180,
    ) as system:
        yield folder, system


def _prompts() -> list[list[int]]:
    """Five prompts of 20-40 tokens; the first two repeat a short phrase (n-gram drafts follow it)."""
    rng = random.Random(11)
    prompts = []
    for i, length in enumerate((36, 28, 40, 20, 32)):
        phrase = [rng.randrange(3, VOCAB) for _ in range(5 if i < 2 else length)]
        prompts.append((phrase * 8)[:length])
    return prompts


def _generate(client: Client, prompts: list[list[int]], executor_pid: int | None = None) -> list:
    """Each prompt's greedy result; with ``executor_pid``, all of them queued before the executor runs a step.

    The executor is paused (SIGSTOP) until the scheduler holds every request, so they run together however
    slowly the client's threads start on a loaded machine: without it, a request could end before the next
    arrives, and nothing would be preempted.
    """
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:

        def submit() -> list[concurrent.futures.Future]:
            return [
                pool.submit(client.generate, token_ids=p, max_tokens=NUM_OUTPUT, temperature=0, ignore_eos=True)
                for p in prompts
            ]

        if executor_pid is None:
            return [f.result() for f in submit()]
        with paused(executor_pid):
            futures = submit()
            wait_until(
                lambda: (lambda s: s.num_running + s.num_waiting)(client.status()) == len(prompts),
                30,
                "every request queued at the scheduler",
            )
        return [f.result() for f in futures]


def test_greedy_with_drafts_equals_transformers(drafting_system):
    folder, system = drafting_system
    prompts = _prompts()
    with Client(system.target, timeout=300) as client:
        first, again = (_generate(client, prompts[:1])[0] for _ in range(2))
        results = _generate(client, prompts, system.executor_pids[0])
        status = client.status()
        wait_pool_whole(client)
    assert status.executors[0].draft_model
    assert status.num_preemptions_total > 0, "the pool was large enough: nothing was preempted"
    assert again.usage.cached_tokens > 0
    expected = [hf_greedy(folder, p, NUM_OUTPUT) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert first.token_ids == again.token_ids == expected[0]
    # Whether n-gram drafts are tried (and accepted) depends on the order the five requests arrive and are
    # preempted in; they verify as the draft model's do, so only the draft model's are counted on here.
    assert status.spec_num_drafts_total > 0
    # The model drafting for itself proposes its own tokens: nearly all are accepted.
    assert status.spec_model_accepted_tokens_total > 0.8 * status.spec_model_draft_tokens_total > 0
