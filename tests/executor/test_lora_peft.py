"""LoRA adapters against transformers + PEFT: two adapters and the base model in one batch, every family."""

from __future__ import annotations

import peft
import pytest
import torch

from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import GREEDY, MOE_ARCHS, BlockAllocator, blocks_needed, install_recorder, load_hf

BLOCK_SIZE = 4
# One checkpoint of each family in the registry (PEFT adapts them all).
FAMILY_ARCHS = ("llama", "mistral_window", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", *MOE_ARCHS)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def adapter_targets(arch: str) -> tuple[list[str], list[str]]:
    """The target modules of the two adapters: every module, and a few (attention only on MoE models)."""
    if arch == "phi3":  # q/k/v and gate/up are fused modules in transformers' Phi-3 too
        return ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]
    if arch in MOE_ARCHS:
        return ATTENTION, ["k_proj", "o_proj"]
    return ATTENTION + ["gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj", "down_proj"]


def make_peft_adapter(base_folder, out_folder, seed: int, **config):
    """A PEFT LoRA adapter on the base checkpoint with random lora_B (PEFT starts it at zero), saved to
    ``out_folder``; returns the PEFT model, the oracle."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(load_hf(base_folder), peft.LoraConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    model.save_pretrained(out_folder)
    return model.eval()


def two_adapters(arch, base_folder, tmp_path):
    """Adapter 1: every module, r 8, alpha 16. Adapter 2: a few modules, rsLoRA, r 4 with one module of rank 2,
    one module's alpha 3 (rank_pattern, alpha_pattern)."""
    full, few = adapter_targets(arch)
    first = make_peft_adapter(base_folder, tmp_path / "a1", 11, r=8, lora_alpha=16, target_modules=full)
    second = make_peft_adapter(
        base_folder,
        tmp_path / "a2",
        12,
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=few,
        rank_pattern={few[-1]: 2},
        alpha_pattern={few[0]: 3},
    )
    return {"a1": first, "a2": second}


def _runner(folder, **kwargs) -> ModelRunner:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**20)
    return ModelRunner(str(folder), **{**options, **kwargs})


def generate(runner, requests, num_new: int, chunk: int) -> list[list[int]]:
    """Greedy tokens of ``requests`` [(prompt, adapter or None)], all in one batch: chunked prefill of ``chunk``
    tokens, then decode, the new sequences naming their adapters."""
    alloc = BlockAllocator(runner.info.num_kv_blocks, seed=3)
    tokens = [list(prompt) for prompt, _ in requests]
    computed, tables, generated = [0] * len(requests), [()] * len(requests), [[] for _ in requests]
    long_rope = [0 < runner.info.rope_switch_len < len(p) + num_new for p in tokens]
    step_id = 0
    while any(len(g) < num_new for g in generated):
        step_id += 1
        new, scheduled = [], []
        for i, (prompt, name) in enumerate(requests):
            if len(generated[i]) >= num_new:
                continue
            n = min(chunk, len(tokens[i]) - computed[i])
            more = alloc.take(blocks_needed(computed[i] + n, BLOCK_SIZE) - len(tables[i]))
            tables[i] += more
            if step_id == 1:
                new.append(
                    t.NewSequence(
                        i,
                        f"r{i}",
                        tuple(prompt),
                        len(prompt),
                        GREEDY,
                        tables[i],
                        0,
                        n,
                        long_rope=long_rope[i],
                        lora_name=name or "",
                    )
                )
            else:
                scheduled.append(t.ScheduledSequence(i, n, more))
            computed[i] += n
        out = runner.execute(t.StepPlan(step_id, new_seqs=tuple(new), scheduled_seqs=tuple(scheduled)))
        assert not out.errors, out.errors
        for o in out.outputs:
            tokens[o.seq_id].extend(o.token_ids)
            generated[o.seq_id].extend(o.token_ids)
    return generated


def mixed_requests() -> list[tuple[list[int], str | None]]:
    """Adapter 1, adapter 2, the base model and adapter 1 again, prompts of 5, 11, 8 and 14 tokens."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 11, 8, 14)]
    return list(zip(prompts, ["a1", "a2", None, "a1"]))


def _all_logits(model, token_ids) -> torch.Tensor:
    """A transformers (or PEFT) model's logits [len, V] at every position of ``token_ids``."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_mixed_batch_matches_peft(arch, checkpoints, tmp_path):
    """Greedy tokens of two adapters and the base model in one batch (chunked prefill, then decode) equal PEFT's
    generate per request; every sampled row's logits are PEFT's within 1e-4."""
    folder = checkpoints[arch]
    oracles = {**two_adapters(arch, folder, tmp_path), None: load_hf(folder)}
    runner = _runner(folder)
    for name in ("a1", "a2"):
        runner.add_lora(name, str(tmp_path / name))
    recorder = install_recorder(runner)
    requests = mixed_requests()
    got = generate(runner, requests, num_new=5, chunk=6)
    for (prompt, name), tokens in zip(requests, got):
        with torch.no_grad():
            expected = oracles[name].generate(input_ids=torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
        assert tokens == expected[0, len(prompt) :].tolist(), f"adapter {name}"
    moved = 0.0
    for (prompt, name), tokens in zip(requests, got):
        # Every sampled row of the request: its logits against PEFT's at that position of the whole sequence.
        full = prompt + tokens
        expected = _all_logits(oracles[name], full)
        rows = [(len(ids) - 1, logits) for ids, logits in recorder.records if ids == full[: len(ids)]]
        assert len(rows) == len(tokens)
        for position, logits in rows:
            torch.testing.assert_close(logits, expected[position], atol=1e-4, rtol=0)
        if name is not None:
            base = _all_logits(oracles[None], full)
            moved = max(moved, max((logits - base[position]).abs().max().item() for position, logits in rows))
    assert moved > 0.05, "the adapters hardly change the logits: the comparison would not see a missing delta"


def _prefill_logits(runner, requests) -> dict[tuple[int, ...], torch.Tensor]:
    """The logits after each prompt, every request's whole prompt in one step, by prompt."""
    recorder = install_recorder(runner)
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    new = tuple(
        t.NewSequence(
            i,
            f"r{i}",
            tuple(p),
            len(p),
            GREEDY,
            alloc.take(blocks_needed(len(p), BLOCK_SIZE)),
            0,
            len(p),
            lora_name=name or "",
        )
        for i, (p, name) in enumerate(requests)
    )
    assert not runner.execute(t.StepPlan(1, new_seqs=new)).errors
    return {tuple(token_ids): logits for token_ids, logits in recorder.records}


def test_bf16_and_int8_base_weights_run_the_adapters(checkpoints, tmp_path):
    """bf16 generates with the adapters mixed in one batch; its logits are PEFT's (fp32) within 0.15 (measured:
    0.07 at most, logits' spread 0.8), int8 base weights' are bf16's within 0.15 (measured: 0.08), while the
    adapters move them by more than 0.5 from the base model's."""
    folder = checkpoints["llama"]
    oracles = {**two_adapters("llama", folder, tmp_path), None: load_hf(folder)}
    requests = mixed_requests()
    logits = {}
    for kind, options in {"bf16": {}, "int8": {"quantization": "int8"}}.items():
        runner = _runner(folder, dtype="bfloat16", **options)
        for name in ("a1", "a2"):
            runner.add_lora(name, str(tmp_path / name))
        assert runner.info.quantization == ("none" if kind == "bf16" else "int8")
        logits[kind] = _prefill_logits(runner, requests)
        runner.reset()
        assert [len(tokens) for tokens in generate(runner, requests, num_new=3, chunk=6)] == [3] * len(requests)
    for prompt, name in requests:
        expected = _all_logits(oracles[name], prompt)[-1]
        bf16, int8 = logits["bf16"][tuple(prompt)].float(), logits["int8"][tuple(prompt)].float()
        torch.testing.assert_close(bf16, expected, atol=0.15, rtol=0)
        torch.testing.assert_close(int8, bf16, atol=0.15, rtol=0)
        if name is not None:
            assert (int8 - _all_logits(oracles[None], prompt)[-1]).abs().max() > 0.5
