"""Step time with LoRA adapters against the base model alone, on a SmolLM2-135M-shaped model.

Usage:
    python bench/bench_lora.py [--out DIR] [--dtype bfloat16] [--batch 64] [--adapters 8] [--rank 16]
        [--context 300] [--prefill 512] [--steps 5] [--rounds 3] [--threads N]

Builds (once, under --out, default ~/.cache/pagoda/bench-lora) a random-weight
Llama with SmolLM2-135M's shapes and ``--adapters`` random PEFT adapters of
rank ``--rank`` on all seven modules of every layer. One runner, adapters
registered, ``--adapters`` slots. Each round times, alternating so all see the
same period of a noisy machine: decode steps of ``--batch`` sequences with no
adapter (the fused decode runs them) and with the rows spread evenly over the
adapters, and with no adapter through the layer loop (what a step with
adapters runs instead of the fused decode); then a ``--prefill``-token prompt
with no adapter and with one. The steps with adapters run twice: with the
grouped C++ op (one ``lora_add_`` call per layer and fused linear layer,
native/csrc/cpu_lora.cpp) and with two GEMMs per segment
(``LoraStepState.grouped_kernel`` off). It prints medians and the ratios to
the base model's steps. ``--threads 1`` times CPU work without the forks
that wait for a core other jobs hold on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
from bench_moe import SMOLLM2
from safetensors.torch import save_file

from executor_svc.loading.model_cache import default_cache_dir
from executor_svc.lora.batch import LoraStepState
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
MODULES = {  # inside model.layers.N. -> (out, in) at SmolLM2-135M's shapes
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (192, 576),
    "self_attn.v_proj": (192, 576),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (1536, 576),
    "mlp.up_proj": (1536, 576),
    "mlp.down_proj": (576, 1536),
}


def build(out: pathlib.Path, num_adapters: int, rank: int) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """The base folder and the adapter folders (random, reused when already there)."""
    import transformers

    base = out / "base"
    if not (base / "model.safetensors").is_file():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**SMOLLM2, num_hidden_layers=30, intermediate_size=1536)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(base)
    adapters = []
    for index in range(num_adapters):
        folder = out / f"lora-r{rank}-{index}"
        if not (folder / "adapter_model.safetensors").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            gen = torch.Generator().manual_seed(index)
            tensors = {}
            for layer in range(30):
                for module, (out_features, in_features) in MODULES.items():
                    name = f"base_model.model.model.layers.{layer}.{module}"
                    tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
                    tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
            save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
            config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
            (folder / "adapter_config.json").write_text(json.dumps(config))
        adapters.append(folder)
    return base, adapters


class Steps:
    """Plans for one runner: sequences started with their adapters, then decode steps; step ids never repeat."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.step_id = runner, 0

    def run(self, plan_args: dict) -> float:
        """Seconds of one step."""
        self.step_id += 1
        start = time.perf_counter()
        out = self.runner.execute(t.StepPlan(self.step_id, **plan_args))
        seconds = time.perf_counter() - start
        assert not out.errors, out.errors[0]
        return seconds

    def start(self, names: list[str | None], num_tokens: int, num_computed: int, num_blocks: int) -> float:
        """New sequences, one per entry of ``names`` (an adapter or None), computing tokens past num_computed."""
        self.runner.reset()
        new = tuple(
            t.NewSequence(
                i,
                f"b{i}",
                tuple((7 * i + j) % 1000 + 10 for j in range(num_tokens)),
                num_tokens,
                GREEDY,
                tuple(range(i * num_blocks, (i + 1) * num_blocks)),
                num_computed,
                num_tokens - num_computed,
                lora_name=names[i] or "",
            )
            for i in range(len(names))
        )
        return self.run({"new_seqs": new})

    def decode(self, names: list[str | None], context: int, num_steps: int) -> float:
        """Median seconds of ``num_steps`` decode steps of the sequences of ``names``."""
        self.start(names, context, context - 1, -(-(context + num_steps + 1) // self.runner.block_size))
        plan = {"scheduled_seqs": tuple(t.ScheduledSequence(i, 1) for i in range(len(names)))}
        return statistics.median(self.run(plan) for _ in range(num_steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=default_cache_dir() / "bench-lora")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    base, folders = build(args.out, args.adapters, args.rank)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    tokens = args.batch * (args.context + args.steps + 64) + args.prefill + 64
    runner = ModelRunner(
        str(base),
        dtype=args.dtype,
        device="cpu",
        kv_cache_memory_bytes=tokens * 30 * 2 * 3 * 64 * elem,
        max_model_len=2048,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
    )
    names = [runner.add_lora(f"lora{i}", str(folder)).name for i, folder in enumerate(folders)]
    runner.warmup()
    steps = Steps(runner)
    spread = [names[i % len(names)] for i in range(args.batch)]
    pages = -(-args.prefill // runner.block_size)
    fused = runner.model.fused_decode

    def layer_loop() -> float:
        """Decode steps with no adapter through the model's layer loop, as steps with adapters run."""
        runner.model.fused_decode = None
        try:
            return steps.decode([None] * args.batch, args.context, args.steps)
        finally:
            runner.model.fused_decode = fused

    cases = {
        "decode, no adapter": lambda: steps.decode([None] * args.batch, args.context, args.steps),
        "decode, no adapter, layer loop": layer_loop,
        f"decode, {len(names)} adapters": lambda: steps.decode(spread, args.context, args.steps),
        "prefill, no adapter": lambda: steps.start([None], args.prefill, 0, pages),
        "prefill, 1 adapter": lambda: steps.start([names[0]], args.prefill, 0, pages),
    }
    with_adapters = (f"decode, {len(names)} adapters", "prefill, 1 adapter")
    paths = {"": True, " (two GEMMs)": False}  # LoraStepState.grouped_kernel
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for case, run in cases.items():
            for suffix, grouped in paths.items() if case in with_adapters else [("", True)]:
                LoraStepState.grouped_kernel = grouped
                times.setdefault(case + suffix, []).append(run())
    LoraStepState.grouped_kernel = True
    medians = {case: statistics.median(seconds) for case, seconds in times.items()}
    print(f"{base}: {args.dtype}, layer ops {runner.model.ops.name}, decode path {runner.model.decode_path}")
    print(f"rank {args.rank}, all 7 modules; threads {torch.get_num_threads()}; median of {args.rounds} rounds")
    for case, seconds in medians.items():
        print(f"{case:>37}: {seconds * 1e3:8.1f} ms")
    for suffix in paths:
        decode = medians[f"decode, {len(names)} adapters{suffix}"] / medians["decode, no adapter"]
        prefill = medians[f"prefill, 1 adapter{suffix}"] / medians["prefill, no adapter"]
        path = suffix.strip(" ()") or "grouped op"
        print(f"ratio decode ({args.batch} rows, {len(names)} adapters / none), {path}: {decode:.2f}")
        print(f"ratio prefill ({args.prefill} tokens, 1 adapter / none), {path}: {prefill:.2f}")


if __name__ == "__main__":
    main()
