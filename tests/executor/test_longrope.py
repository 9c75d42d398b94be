"""Phi-3 LongRoPE served past its original length: each sequence on the factor set transformers gives it.

A tiny Phi-3 whose config allows 128 positions but was "trained" on 32
(original_max_position_embeddings), served at 128. transformers computes a
sequence's next token with the short factors while the sequence holds at most
32 tokens and with the long ones past that, and recomputes its cache once when
it crosses. The executor follows the plan's choice per sequence (short and
long sequences in one batch), and the real scheduler core chooses as
transformers does: greedy tokens equal generate's in fp32, logits equal
transformers' forward of the same prefix within 1e-4, on the torch path and
the C++ one (its rotary kernel and the one-call fused decode).
"""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.native import loader
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import StoppingCriteria
from scheduler_svc.core.config import DraftSource
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from tests.executor.conftest import (
    GREEDY,
    BlockAllocator,
    blocks_needed,
    install_recorder,
    load_hf,
    make_tiny_checkpoint,
)

BLOCK_SIZE = 4
ORIGINAL = 32
MAX_LEN = 128
# Short factors close to 1, long ones far from them: the two sets give other logits (checked below).
SCALING = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(12)],
    "long_factor": [1.0 + 0.5 * i for i in range(12)],
    "original_max_position_embeddings": ORIGINAL,
}


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory):
    """Phi-3 allowing 128 positions, its LongRoPE switching at 32."""
    root = tmp_path_factory.mktemp("phi3-longrope")
    return make_tiny_checkpoint(
        root,
        "phi3",
        max_position_embeddings=MAX_LEN,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=SCALING,
    )


@pytest.fixture(scope="module")
def hf(phi3_long):
    return load_hf(phi3_long)


def _runner(folder, backend: str = "torch", **kwargs) -> ModelRunner:
    options = dict(
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=2**21,
        attention_backend=backend,
        layer_ops=backend,
        max_model_len=MAX_LEN,
    )
    return ModelRunner(str(folder), **{**options, **kwargs})


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(num_tokens)]


def _hf_generate(hf, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)[0, len(prompt) :].tolist()


def _hf_next_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for the token after token_ids: its forward of that prefix (the set of its length)."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0, -1].float()


def test_the_executor_reports_where_the_factors_switch(phi3_long, checkpoints):
    assert _runner(phi3_long).info.rope_switch_len == ORIGINAL
    # Served within the original length, only the short factors are ever used; a model without LongRoPE has none.
    assert _runner(phi3_long, max_model_len=ORIGINAL).info.rope_switch_len == 0
    assert _runner(checkpoints["llama"]).info.rope_switch_len == 0


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_short_and_long_sequences_in_one_batch(backend, phi3_long, hf, request):
    """A short-factor sequence (12 + 20 tokens: never past 32) and a long-factor one (45 + 20) prefill in one
    step and decode together: every step's logits equal transformers' for that prefix, the tokens generate's."""
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    runner = _runner(phi3_long, backend)
    kernels = loader.kernels()
    if backend == "cpp" and kernels is not None and "f32_panels" in kernels.features:
        assert runner.model.fused_decode is not None  # decode steps take the one-call C++ path (fp32 panels)
    recorder = install_recorder(runner)
    prompts = {1: _prompt(12, 1), 2: _prompt(45, 2)}
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    new = tuple(
        t.NewSequence(i, f"r{i}", tuple(p), len(p), GREEDY, alloc.take(blocks_needed(len(p) + 20, BLOCK_SIZE)), 0,
                      len(p), long_rope=len(p) > ORIGINAL)
        for i, p in prompts.items()
    )  # fmt: skip
    got = {i: [] for i in prompts}
    result = runner.execute(t.StepPlan(0, new_seqs=new))
    for step_id in range(1, 21):
        assert not result.errors
        for out in result.outputs:
            got[out.seq_id] += out.token_ids
        if step_id < 20:
            result = runner.execute(t.StepPlan(step_id, scheduled_seqs=tuple(t.ScheduledSequence(i, 1) for i in got)))
    for i, prompt in prompts.items():
        assert got[i] == _hf_generate(hf, prompt, 20), i
    assert len(recorder.records) == 40
    for token_ids, logits in recorder.records:
        torch.testing.assert_close(logits, _hf_next_logits(hf, token_ids), atol=1e-4, rtol=0)


def test_the_two_sets_give_other_logits(phi3_long, hf):
    """The same prompt on the long factors: transformers' logits past the switch, not the short ones' (so the
    tests above would see a sequence on the wrong set)."""
    runner = _runner(phi3_long)
    prompt = _prompt(20, 3)
    logits = {}
    for long_rope in (False, True):
        recorder = install_recorder(runner)
        blocks = BlockAllocator(runner.info.num_kv_blocks).take(blocks_needed(len(prompt), BLOCK_SIZE))
        new = t.NewSequence(1, "r", tuple(prompt), len(prompt), GREEDY, blocks, 0, len(prompt), long_rope=long_rope)
        result = runner.execute(t.StepPlan(int(long_rope), new_seqs=(new,)))
        assert not result.errors
        logits[long_rope] = recorder.records[0][1]
        runner.reset()
    torch.testing.assert_close(logits[False], _hf_next_logits(hf, prompt), atol=1e-4, rtol=0)
    assert (logits[True] - logits[False]).abs().max() > 1e-2


def _serve(runner: ModelRunner, requests: dict[int, tuple[list[int], int]], **config) -> tuple[dict, Scheduler]:
    """The real scheduler core driving the runner, one plan at a time: each request's tokens, and the core."""
    info = runner.info
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            max_num_batched_tokens=24,  # long prompts take several chunks
            rope_switch_len=info.rope_switch_len,
            **config,
        )
    )
    for seq_id, (prompt, max_tokens) in requests.items():
        stopping = StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
        scheduler.add(SchedulerSequence(seq_id, f"r{seq_id}", prompt, GREEDY, stopping))
    got: dict[int, list[int]] = {seq_id: [] for seq_id in requests}
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        result = runner.execute(plan)
        assert not result.errors, result.errors
        for update in scheduler.update(result):
            got[update.seq.seq_id] += update.new_token_ids
    assert not scheduler.has_unfinished()
    return got, scheduler


REQUESTS = {
    1: (_prompt(12, 11), 18),  # 30 tokens: short throughout
    2: (_prompt(20, 12), 30),  # crosses 32 after 12 tokens: short, then recomputed on the long factors
    3: (_prompt(40, 13), 16),  # past 32 from the start: long throughout
    4: (_prompt(31, 14), 6),  # one short token, then long
}


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_the_scheduler_chooses_the_set_transformers_uses(backend, phi3_long, hf, request):
    """Four sequences through the scheduler core: those within 32 tokens, past them, and crossing them
    mid-generation, all greedy tokens equal to generate's; the crossing ones were recomputed once each."""
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    got, scheduler = _serve(_runner(phi3_long, backend), REQUESTS)
    for seq_id, (prompt, max_tokens) in REQUESTS.items():
        assert got[seq_id] == _hf_generate(hf, prompt, max_tokens), seq_id
    assert scheduler.counters.num_rope_restarts == 2


def test_one_long_factor_set_for_every_token_would_be_other_tokens(hf):
    """What the test above guards: the crossing sequence on the long factors from its start (as the executor
    did before) differs from generate in its tokens before the crossing."""
    prompt, max_tokens = REQUESTS[2]
    expected = _hf_generate(hf, prompt, max_tokens)
    with torch.no_grad():  # one forward over the whole sequence: past 32 tokens, the long factors everywhere
        all_long = hf(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert all_long != expected


def _repeating(num_tokens: int, seed: int) -> list[int]:
    """A prompt repeating 6 tokens: the model's output then repeats n-grams too (drafts are found)."""
    return (_prompt(6, seed) * num_tokens)[:num_tokens]


# Two crossing at other offsets from the switch (drafts of 4 would pass it), a short one and a long one.
SPEC_REQUESTS = {
    1: (_repeating(21, 0), 24),
    2: (_repeating(24, 3), 20),
    3: (_repeating(14, 1), 16),
    4: (_repeating(36, 2), 12),
}


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_drafts_stay_within_the_short_factors(speculative, phi3_long, hf):
    """With n-gram drafts or a draft model (the same Phi-3, so it drafts on the sequence's own set), drafts of
    a short-factor sequence stop at the switch (else the executor refuses the plan), and every token of a
    crossing, a short and a long sequence is still generate's."""
    draft = str(phi3_long) if speculative == "draft" else None
    runner = _runner(phi3_long, draft_model_path=draft)
    got, scheduler = _serve(runner, SPEC_REQUESTS, speculative=speculative, speculative_adaptive=False)
    for seq_id, (prompt, max_tokens) in SPEC_REQUESTS.items():
        assert got[seq_id] == _hf_generate(hf, prompt, max_tokens), seq_id
    assert scheduler.drafter is not None
    stats = scheduler.drafter.stats[DraftSource.MODEL if speculative == "draft" else DraftSource.NGRAM]
    assert stats.num_drafts > 0
    if speculative == "draft":  # the draft model computes what the model does: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_plans_against_the_switch_fail_only_their_sequence(phi3_long, checkpoints):
    """A short-factor sequence scheduled past the switch, or long factors asked of a model without them:
    that sequence fails with the reason, the other one runs."""
    runner = _runner(phi3_long)
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    past = _prompt(40, 5)
    ok = _prompt(40, 6)
    plan = t.StepPlan(
        0,
        new_seqs=(
            t.NewSequence(1, "r1", tuple(past), 40, GREEDY, alloc.take(10), 0, 40),
            t.NewSequence(2, "r2", tuple(ok), 40, GREEDY, alloc.take(10), 0, 40, long_rope=True),
        ),
    )
    result = runner.execute(plan)
    (error,) = result.errors
    assert error.seq_id == 1 and "short RoPE factors" in error.message and "long_rope" in error.message
    assert [out.seq_id for out in result.outputs] == [2]
    assert not runner.has_sequence(1)

    llama = _runner(checkpoints["llama"])
    new = t.NewSequence(1, "r1", (5, 6, 7), 3, GREEDY, (0,), 0, 3, long_rope=True)
    (error,) = llama.execute(t.StepPlan(0, new_seqs=(new,))).errors
    assert "one RoPE factor set" in error.message
    assert llama.num_sequences() == 0


def test_the_offload_tier_of_a_longrope_model_has_a_namespace_of_its_own(phi3_long, tmp_path):
    """Blocks are hashed by factor set now; before, a long-context executor stored every block on the long
    factors under the hashes short ones have now. Its tier directory is therefore another one."""
    from executor_svc.config import ExecutorConfig
    from executor_svc.kv.tier.identity import model_identity
    from executor_svc.kv.tier.open_tier import lock_dir
    from executor_svc.main import open_runner_tier

    config = ExecutorConfig(kv_offload_dir=str(tmp_path))
    tier = open_runner_tier(config, _runner(phi3_long), str(phi3_long), lock_dir(config), None)
    assert "rope=longrope-per-sequence" in tier.store.ns.identity
    assert tier.store.ns.identity != model_identity(phi3_long, "float32")
    tier.close(10)
