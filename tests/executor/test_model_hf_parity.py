"""Each tiny architecture against transformers: mixed-step logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import (
    ARCHS,
    GREEDY,
    BlockAllocator,
    blocks_needed,
    install_recorder,
    load_hf,
    long_rope,
)

BLOCK_SIZE = 4


def _runner(folder, **kwargs) -> ModelRunner:
    options = dict(
        dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**20, attention_backend="torch"
    )
    return ModelRunner(str(folder), **{**options, **kwargs})


def _new(runner, seq_id, tokens, blocks, num_computed, num_scheduled) -> t.NewSequence:
    return t.NewSequence(
        seq_id,
        f"r{seq_id}",
        tuple(tokens),
        len(tokens),
        GREEDY,
        blocks,
        num_computed,
        num_scheduled,
        long_rope=long_rope(runner, len(tokens)),
    )


def _hf_last_logits(hf, token_ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0, -1].float()


def mixed_step_prompts() -> list[list[int]]:
    """The mixed step's four prompts: A (21 tokens), B (13), C (7), D (A's first 16 + 5 of its own)."""
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(3, 128, (21,), generator=gen).tolist()
    prompt_b = torch.randint(3, 128, (13,), generator=gen).tolist()
    prompt_c = torch.randint(3, 128, (7,), generator=gen).tolist()
    prompt_d = prompt_a[:16] + torch.randint(3, 128, (5,), generator=gen).tolist()
    return [prompt_a, prompt_b, prompt_c, prompt_d]


def greedy_prompts() -> list[list[int]]:
    """The greedy test's three prompts (5, 11 and 18 tokens)."""
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 11, 18)]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_mixed_step_logits_match_transformers(arch, backend, checkpoints, request):
    """Prefill chunks, decodes and a cached-prefix sequence in one step match HF within 1e-4 (torch or C++ code)."""
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    hf = load_hf(checkpoints[arch])
    # torch: the torch path end to end, layer ops and linear layers too.
    runner = _runner(checkpoints[arch], attention_backend=backend, layer_ops=backend)
    assert runner.backend.name == backend
    assert runner.model.ops.name == backend
    recorder = install_recorder(runner)
    prompt_a, prompt_b, prompt_c, prompt_d = mixed_step_prompts()
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    blocks_a = alloc.take(blocks_needed(21, BLOCK_SIZE))
    # Step 1: A's first chunk (12 tokens), B and C whole prompts (they sample).
    out1 = runner.execute(
        t.StepPlan(
            1,
            new_seqs=(
                _new(runner, 1, prompt_a, blocks_a, 0, 12),
                _new(runner, 2, prompt_b, alloc.take(blocks_needed(14, BLOCK_SIZE)), 0, 13),
                _new(runner, 3, prompt_c, alloc.take(blocks_needed(8, BLOCK_SIZE)), 0, 7),
            ),
        )
    )
    assert not out1.errors and {o.seq_id for o in out1.outputs} == {2, 3}
    # Step 2: A's second chunk reaches the prompt end; B, C decode; D reuses A's 4 full blocks.
    blocks_d = blocks_a[:4] + alloc.take(blocks_needed(22, BLOCK_SIZE) - 4)
    out2 = runner.execute(
        t.StepPlan(
            2,
            new_seqs=(_new(runner, 4, prompt_d, blocks_d, 16, 5),),
            scheduled_seqs=(
                t.ScheduledSequence(1, 9),
                t.ScheduledSequence(2, 1),
                t.ScheduledSequence(3, 1),
            ),
        )
    )
    assert not out2.errors and {o.seq_id for o in out2.outputs} == {1, 2, 3, 4}
    assert out2.num_scheduled_tokens == 9 + 1 + 1 + 5
    assert len(recorder.records) == 6
    for token_ids, logits in recorder.records:
        expected = _hf_last_logits(hf, token_ids)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def _generate(runner, prompts, num_new, chunk):
    """A minimal scheduler: chunked prefill of `chunk` tokens, then decode, fresh blocks."""
    alloc = BlockAllocator(runner.info.num_kv_blocks, seed=3)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    computed = {i: 0 for i in tokens}
    tables = {i: () for i in tokens}
    generated = {i: [] for i in tokens}
    step_id = 0
    while any(len(g) < num_new for g in generated.values()):
        step_id += 1
        new, scheduled = [], []
        for i in tokens:
            if len(generated[i]) >= num_new:
                continue
            n = min(chunk, len(tokens[i]) - computed[i])
            more = alloc.take(blocks_needed(computed[i] + n, BLOCK_SIZE) - len(tables[i]))
            tables[i] += more
            if step_id == 1:
                new.append(_new(runner, i, tokens[i], tables[i], 0, n))
            else:
                scheduled.append(t.ScheduledSequence(i, n, more))
            computed[i] += n
        out = runner.execute(t.StepPlan(step_id, new_seqs=tuple(new), scheduled_seqs=tuple(scheduled)))
        assert not out.errors
        for o in out.outputs:
            tokens[o.seq_id].extend(o.token_ids)
            generated[o.seq_id].extend(o.token_ids)
    return generated


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_64_tokens_match_generate(arch, checkpoints):
    """64 greedy tokens of three concurrent sequences equal transformers generate."""
    hf = load_hf(checkpoints[arch])
    runner = _runner(checkpoints[arch])
    prompts = greedy_prompts()
    got = _generate(runner, prompts, 64, chunk=7)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt) :]
        assert got[i] == expected.tolist(), f"sequence {i}"
