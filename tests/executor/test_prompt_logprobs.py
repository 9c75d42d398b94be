"""``prompt_logprobs`` in the executor: every prompt token's logprob as transformers computes it, chunk by chunk."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import SamplingParams
from tests.executor.conftest import BlockAllocator, blocks_needed, load_hf

BLOCK_SIZE = 4


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_prompt_logprobs_match_transformers_over_chunks(checkpoints, backend, request):
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    folder = checkpoints["qwen2"]
    runner = ModelRunner(
        str(folder), dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**21,
        attention_backend=backend, layer_ops=backend,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 128, (23,), generator=gen).tolist()
    other = torch.randint(3, 128, (6,), generator=gen).tolist()
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    scored = SamplingParams(temperature=0.0, prompt_logprobs=3)
    new = (
        t.NewSequence(1, "a", tuple(prompt), 23, scored, alloc.take(blocks_needed(25, BLOCK_SIZE)), 0, 10),
        t.NewSequence(2, "b", tuple(other), 6, SamplingParams(temperature=0.0), alloc.take(2), 0, 6),
    )
    outputs = [runner.execute(t.StepPlan(1, new_seqs=new))]
    for step, chunk in ((2, 10), (3, 3)):
        outputs.append(runner.execute(t.StepPlan(step, scheduled_seqs=(t.ScheduledSequence(1, chunk),))))
    entries, starts = [], []
    for result in outputs:
        assert not result.errors
        for out in result.outputs:
            assert out.seq_id == 1 or not out.prompt_logprobs  # only the scored sequence
            if out.seq_id == 1:
                starts.append(out.prompt_logprobs_start)
                entries += out.prompt_logprobs
    assert starts == [1, 11, 21] and len(entries) == 22
    assert [o.token_ids for o in outputs[0].outputs if o.seq_id == 1] == [()]  # a chunk without its end samples none
    with torch.no_grad():
        expected = torch.log_softmax(load_hf(folder)(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [23, V]
    for position, entry in enumerate(entries, start=1):
        assert entry.sampled.token_id == prompt[position]
        assert entry.sampled.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=1e-4)
        top = expected[position - 1].topk(3)
        assert [c.token_id for c in entry.top] == top.indices.tolist()
        assert [c.logprob for c in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
