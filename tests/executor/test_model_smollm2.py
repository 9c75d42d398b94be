"""The real default model (SmolLM2-135M-Instruct) against transformers. Slow."""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import GREEDY, BlockAllocator, blocks_needed

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def smollm2_folder():
    from executor_svc.loading.model_cache import prepare_default_model

    return prepare_default_model()


def test_smollm2_greedy_batch_matches_generate(smollm2_folder):
    """Eight prompts of different lengths decoded together give HF's greedy tokens (fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    runner = ModelRunner(
        str(smollm2_folder),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=2**28,
        attention_backend="auto",
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 44, 61, 80, 120)]
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    new = tuple(
        t.NewSequence(
            i, str(i), tuple(p), len(p), GREEDY, alloc.take(blocks_needed(len(p) + 32, BLOCK_SIZE)), 0, len(p)
        )
        for i, p in enumerate(prompts)
    )
    outputs = {i: [] for i in range(len(prompts))}
    for step in range(32):
        plan = (
            t.StepPlan(step, new_seqs=new)
            if step == 0
            else t.StepPlan(step, scheduled_seqs=tuple(t.ScheduledSequence(i, 1) for i in outputs))
        )
        out = runner.execute(plan)
        assert not out.errors
        for o in out.outputs:
            outputs[o.seq_id].extend(o.token_ids)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :]
        assert outputs[i] == expected.tolist(), f"prompt {i}"


def test_smollm2_bf16_logits_track_fp32_transformers(smollm2_folder):
    """bf16 on the CPU kernels (panel GEMM, prefill and decode attention, with
    the default block size) stays within bf16 error of transformers in fp32:
    prompts of 1-150 tokens, then decode steps, logits compared at every step."""
    import transformers

    from tests.executor.conftest import install_recorder

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, torch_dtype=torch.float32).eval()
    runner = ModelRunner(str(smollm2_folder), dtype="bfloat16", device="cpu", kv_cache_memory_bytes=2**28)
    block_size = runner.info.block_size
    recorder = install_recorder(runner)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (1, 16, 33, 70, 150)]
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    new = tuple(
        t.NewSequence(i, str(i), tuple(p), len(p), GREEDY, alloc.take(blocks_needed(len(p) + 8, block_size)), 0, len(p))
        for i, p in enumerate(prompts)
    )
    for step in range(6):
        plan = (
            t.StepPlan(step, new_seqs=new)
            if step == 0
            else t.StepPlan(step, scheduled_seqs=tuple(t.ScheduledSequence(i, 1) for i in range(len(prompts))))
        )
        assert not runner.execute(plan).errors
    assert len(recorder.records) == 6 * len(prompts)
    for token_ids, logits in recorder.records:
        with torch.no_grad():
            expected = hf(torch.tensor([token_ids])).logits[0, -1]
        got = logits.float()
        cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
        assert cosine > 0.995, (len(token_ids), cosine)
        top2 = expected.topk(2).values
        if (top2[0] - top2[1]).item() > 0.5:  # a clear fp32 winner must stay the winner
            assert got.argmax().item() == expected.argmax().item(), len(token_ids)
