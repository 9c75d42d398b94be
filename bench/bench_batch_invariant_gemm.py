"""What batch-invariant linear layers cost: each layer as the executor builds it, invariant vs. not, per M.

For SmolLM2-135M's matmul shapes (K = 576 into N = 576, 192, 1536 and the
49,152-row LM head; K = 1536 into N = 576) and M rows of bf16 activations,
times one call of the layer each way, the two alternating within each round
(the order flips every round), and prints the median of the rounds:

- ``bf16``: ``get_layer_ops("cpp", batch_invariant=...)`` (both run the bf16 panel GEMM where it exists);
- ``int8`` / ``q8_0``: the ``--quantization`` mode's layers (the invariant ones keep one activation kind:
  no widening past 128 rows on AMX-INT8, none past 16 rows for GGUF blocks); ``int8/bf16``, ``q8_0/bf16``:
  the invariant side with ``--quantized-activations bf16`` instead (widened at every step);
- ``bf16-fallback``: what a CPU with AVX-512 but neither AVX512-BF16 nor AMX would pay: oneDNN (the default
  there) vs. the bf16 weight as fp32 panels (the invariant path there).

Usage: python bench/bench_batch_invariant_gemm.py [--rows 1,8,48,128,512] [--rounds 5]
    [--configs bf16,int8,q8_0,int8/bf16,q8_0/bf16,bf16-fallback]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from executor_svc.models.layer_ops import CppLayerOps, PackedWeight, get_layer_ops
from executor_svc.quant.modes import resolve_quantization

SHAPES = [(576, 576), (576, 192), (576, 1536), (576, 49152), (1536, 576)]  # (K, N)
CPU = torch.device("cpu")
Layer = Callable[[torch.Tensor], torch.Tensor]


def _ops(config: str, invariant: bool):
    """The layer ops (quantized where the config says) an executor with this switch builds; ``MODE/bf16``: the
    invariant side with bf16 activations (widened at every step), the plain side ``auto``."""
    base = get_layer_ops("cpp", CPU, torch.bfloat16, batch_invariant=invariant)
    if config in ("bf16", "bf16-fallback"):
        return base
    mode, _, activations = config.partition("/")
    activations = activations if invariant and activations else "auto"
    quantization = resolve_quantization(mode, activations, Path("model"), CPU, torch.bfloat16, base, invariant)
    return quantization.wrap(base)


def _layer(config: str, invariant: bool, weight: torch.Tensor) -> Layer:
    """x -> the layer's output, weight packed once."""
    ops = _ops(config, invariant)
    if config == "bf16-fallback":
        assert isinstance(ops, CppLayerOps)
        if invariant:
            packed = ops._pack_invariant(weight)
        else:
            packed = PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight, None), weight.shape[0])
    else:
        packed = ops.pack(weight)
    return lambda x: ops.linear(x, packed)


def _seconds(layer: Layer, x: torch.Tensor, budget_s: float = 0.03) -> float:
    """Mean seconds a call, over calls for at least budget_s (at least two)."""
    layer(x)
    calls, start = 0, time.perf_counter()
    while calls < 2 or time.perf_counter() - start < budget_s:
        layer(x)
        calls += 1
    return (time.perf_counter() - start) / calls


def _compare(plain: Layer, invariant: Layer, x: torch.Tensor, rounds: int) -> tuple[float, float]:
    """Median seconds a call of each, alternating which runs first every round."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for which in (False, True) if r % 2 == 0 else (True, False):
            times[which].append(_seconds(invariant if which else plain, x))
    return statistics.median(times[False]), statistics.median(times[True])


def run(configs: list[str], rows: list[int], rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {rounds} alternating rounds, median ms per call")
    for config in configs:
        print(f"\n{config}: {'M':>4} {'K':>5} {'N':>6} {'plain ms':>9} {'invar. ms':>9} {'invar./plain':>12}")
        totals = {m: [0.0, 0.0] for m in rows}
        for k, n in SHAPES:
            weight = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
            plain, invariant = _layer(config, False, weight), _layer(config, True, weight)
            for m in rows:
                x = torch.randn(m, k, generator=gen).bfloat16()
                a, b = _compare(plain, invariant, x, rounds)
                totals[m][0] += a
                totals[m][1] += b
                print(f"{'':{len(config) + 1}} {m:>4} {k:>5} {n:>6} {a * 1e3:>9.3f} {b * 1e3:>9.3f} {b / a:>12.3f}")
        for m, (a, b) in totals.items():
            print(f"{'':{len(config) + 1}} {m:>4}   all shapes {a * 1e3:>9.3f} {b * 1e3:>9.3f} {b / a:>12.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,48,128,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default="bf16,int8,q8_0,bf16-fallback")
    args = parser.parse_args()
    run(args.configs.split(","), [int(r) for r in args.rows.split(",")], args.rounds)


if __name__ == "__main__":
    main()
