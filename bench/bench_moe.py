"""Decode step time of a mixture of experts against a dense model with the same active parameters.

Usage:
    python bench/bench_moe.py [--out DIR] [--batches 1,8,48] [--context 400] [--dtype bfloat16]
        [--steps 5] [--rounds 2] [--layers 30] [--experts 8] [--top-k 2]

Builds (once, under --out, default ~/.cache/pagoda/bench-moe) two random-weight
checkpoints with SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads, 30
layers, its tokenizer): ``moe``, a Mixtral with ``--experts`` experts of
SmolLM2's MLP (intermediate 1536) and top ``--top-k`` routing, and ``dense``, a
Llama whose one MLP has ``top_k`` x 1536 intermediate units, so a token goes
through the same number of weights in both. Both are served by the executor's
C++ kernels; each round times a decode step of every batch on each model,
alternating, and the table prints them side by side with the experts each MoE
layer read per step. The folders also serve ``pagoda serve --model DIR`` and
``pagoda bench --compare-hf --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics

import torch
from bench_executor import AttentionTimer, decode_step

from executor_svc.loading.model_cache import default_cache_dir, prepare_default_model
from executor_svc.models.moe import MoeBlock
from executor_svc.runner.model_runner import ModelRunner

SMOLLM2 = dict(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.02,
)
EXPERT_INTERMEDIATE = 1536  # SmolLM2-135M's MLP
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def build_checkpoints(out: pathlib.Path, layers: int, experts: int, top_k: int) -> dict[str, pathlib.Path]:
    """The MoE and dense folders (random bf16 weights, SmolLM2's tokenizer); reused when already there."""
    import transformers

    configs = {
        "moe": transformers.MixtralConfig(
            **SMOLLM2,
            num_hidden_layers=layers,
            intermediate_size=EXPERT_INTERMEDIATE,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
        ),
        "dense": transformers.LlamaConfig(
            **SMOLLM2, num_hidden_layers=layers, intermediate_size=top_k * EXPERT_INTERMEDIATE
        ),
    }
    tokenizer_source = prepare_default_model()
    folders = {}
    for name, config in configs.items():
        folder = out / f"{name}-{layers}l-{experts}e-top{top_k}"
        if not (folder / "model.safetensors").is_file():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(folder)
            for file_name in TOKENIZER_FILES:
                if (tokenizer_source / file_name).is_file():
                    shutil.copy(tokenizer_source / file_name, folder / file_name)
            del model
        folders[name] = folder
    return folders


class ExpertCounter:
    """Counts the experts one MoE layer reads per call (wraps its block, same computation)."""

    def __init__(self, block: MoeBlock):
        self.block, self.path, self.counts = block, block.path, []
        self.linear = block.linear
        block.linear = self._linear

    def _linear(self, x, weight, bias=None):
        self.reads += 1
        return self.linear(x, weight, bias)

    def __call__(self, x):
        self.reads = 0
        out = self.block(x)
        self.counts.append((self.reads - 1) // 2)  # the router, then two matrices per expert read
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=default_cache_dir() / "bench-moe")
    parser.add_argument("--batches", default="1,8,48")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    folders = build_checkpoints(args.out, args.layers, args.experts, args.top_k)
    runners = {name: _runner(folder, args, max(batches)) for name, folder in folders.items()}
    counter = ExpertCounter(runners["moe"].model.layers[0].mlp)
    runners["moe"].model.layers[0].mlp = counter
    for name, runner in runners.items():
        print(
            f"{name}: {folders[name]} ({_describe(runner)}; attention {runner.backend.name}, {runner.model.mlp_path})"
        )
    times: dict[tuple[str, int], list[float]] = {}
    experts_read: dict[int, list[int]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, runner in runners.items():
                counter.counts.clear()
                step_s, _ = decode_step(runner, batch, args.context, args.steps)
                times.setdefault((name, batch), []).append(step_s)
                if name == "moe":
                    experts_read.setdefault(batch, []).extend(counter.counts[1:])  # after the prefill step
    print(f"\ndecode step, context {args.context}, {args.dtype}, threads {torch.get_num_threads()}, median of rounds")
    print(f"{'batch':>6} {'dense ms':>9} {'moe ms':>8} {'moe/dense':>10} {'experts read / layer':>21}")
    for batch in batches:
        dense, moe = (statistics.median(times[(name, batch)]) for name in ("dense", "moe"))
        read = statistics.mean(experts_read[batch])
        print(f"{batch:>6} {dense * 1e3:>9.1f} {moe * 1e3:>8.1f} {moe / dense:>10.2f} {read:>16.1f} / {args.experts}")


def _runner(folder: pathlib.Path, args, max_batch: int) -> ModelRunner:
    """The model on the CPU kernels, with KV memory for every sequence of the largest batch (and no more)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    tokens = max_batch * (args.context + args.steps + 64)  # + a block of slack per sequence
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    kv_bytes = tokens * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * elem
    runner = ModelRunner(
        str(folder), dtype=args.dtype, device="cpu", kv_cache_memory_bytes=kv_bytes, max_model_len=2048
    )
    runner.backend = AttentionTimer(runner.backend, runner.device)
    runner.warmup()
    return runner


def _describe(runner: ModelRunner) -> str:
    c = runner.config
    attention = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    )
    experts = getattr(c, "num_experts", 0)
    mlp = 3 * c.hidden_size * c.intermediate_size
    total = c.num_layers * (attention + mlp * max(experts, 1)) + c.vocab_size * c.hidden_size
    active = (
        c.num_layers * (attention + mlp * (getattr(c, "num_experts_per_tok", 0) or 1)) + c.vocab_size * c.hidden_size
    )
    return f"{total / 1e6:.0f}M parameters, {active / 1e6:.0f}M active per token"


if __name__ == "__main__":
    main()
