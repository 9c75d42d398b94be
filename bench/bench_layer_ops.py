"""The elementwise ops of a decoder layer: our C++ ops vs the torch code they replace.

Times, per call, each op a Llama-family layer runs between its GEMMs, at
SmolLM2-135M's widths (hidden 576, intermediate 1,536, 9 + 3 heads of 64
rotated), in bf16, for each row count: RMSNorm with the residual add,
SiLU-and-multiply, and the rotary update in place. ``torch/cpp`` is the torch
code's time over ours. The model runs each of them 30 times a step (the norm
twice), so a step's share is 30x the figure.

Usage: python bench/bench_layer_ops.py [--rows 1,16,64,512,2048] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from executor_svc.models.layer_ops import CppLayerOps, TorchLayerOps
from executor_svc.native import loader

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 576, 1536, 9, 3, 64, 8192


def _per_call_us(fn, min_s: float = 0.3) -> float:
    """Best of 5 timings of enough calls to take ``min_s``, after a warm-up, in µs per call."""
    for _ in range(10):
        fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= min_s / 5:
            break
        calls *= 2
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _cases(rows: int, gen: torch.Generator):
    """name -> (inputs, run(ops, inputs)); inputs fresh per op set, as in-place ops change them."""
    residual = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).bfloat16()
    gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=gen) * 3).bfloat16()
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    positions = torch.randint(0, MAX_LEN, (rows,), generator=gen)
    freqs = torch.outer(torch.arange(MAX_LEN).float(), torch.rand(HEAD_DIM // 2, generator=gen))
    cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
    # What each op set's rotary_for gives a step: the kernel indexes the tables by row, torch takes the rows.
    cpp_rotary, torch_rotary = (positions, cos, sin), (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    return {
        "add_rms_norm": lambda ops: ops.add_rms_norm(x, residual, weight, 1e-5),
        "silu_and_mul": lambda ops: ops.silu_and_mul(gate_up),
        "rotary": lambda ops: ops.rotate(
            qkv[:, : HEADS + KV_HEADS], cpp_rotary if isinstance(ops, CppLayerOps) else torch_rotary
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,512,2048")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = loader.kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels are not built here (make install builds them)")
    print(f"kernels: {sorted(kernels.features)}; threads {torch.get_num_threads()}; bf16, µs per call")
    cpp, reference = CppLayerOps(), TorchLayerOps()
    print(f"{'op':>14} {'rows':>6} {'cpp':>10} {'torch':>10} {'torch/cpp':>10}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, run in _cases(rows, torch.Generator().manual_seed(rows)).items():
            ours, theirs = (_per_call_us(lambda run=run, ops=ops: run(ops)) for ops in (cpp, reference))
            print(f"{name:>14} {rows:>6} {ours:>10.1f} {theirs:>10.1f} {theirs / ours:>9.2f}x")


if __name__ == "__main__":
    main()
