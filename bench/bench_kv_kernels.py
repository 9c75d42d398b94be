"""The C++ attention kernels alone over bf16, int8 and fp32 KV caches, side by side: decode and bf16 prefill.

Usage:
    python bench/bench_kv_kernels.py [--caches bf16/32,int8/64,int8/32] [--decode 1x400,8x400,48x400,128x400,8x2000]
        [--prefill 2048+0,512+1536] [--layers 30] [--repeats 7]

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64, bf16 queries; fp32 ones for an fp32
cache, an fp32 model's); each cache is ``dtype/block_size`` (bf16, int8, fp32) with random rows (int8:
quantized by ``kv_cache.quantize_rows``), one per layer, so a
call per layer walks as many bytes as a model step does. Decode cases are ``batch x context``, or ``batch x
low-high`` for contexts drawn uniformly from [low, high] (seed 1) and ordered by length as the executor orders
its decode rows (64x16-768: W-mixed's 64 sequences of 16-512 prompt and up to 256 output tokens), prefill ones
``chunk + cached prefix`` tokens (one sequence). Prints the best of ``--repeats`` for all layers, and each
cache's time against the first one's. The caches take turns case by case.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from executor_svc.kv.cache import LayerKV, quantize_rows
from executor_svc.native import loader

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def make_caches(kind: str, num_layers: int, num_blocks: int, block_size: int) -> list[LayerKV]:
    """One cache [KVH, NB, BS, D] per layer, bf16, fp32 or int8 with scales."""
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(num_layers):
        rows = torch.randn(2, NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM, generator=gen)
        if kind == "int8":
            quantized, scale = quantize_rows(rows)
            caches.append(LayerKV(quantized[0], quantized[1], scale[0], scale[1]))
        else:
            rows = rows.to(torch.float32 if kind == "fp32" else torch.bfloat16)
            caches.append(LayerKV(rows[0], rows[1]))
    return caches


def best_of(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def decode_case(ops, kind: str, block_size: int, batch: int, context: tuple[int, int], args) -> float:
    low, high = context
    blocks_per_seq = -(-high // block_size)
    caches = make_caches(kind, args.layers, batch * blocks_per_seq + 1, block_size)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.float32 if kind == "fp32" else torch.bfloat16)
    tables = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq)
    lens = torch.randint(low, high + 1, (batch,), generator=gen).sort().values

    def run() -> None:
        for c in caches:
            ops.paged_decode(q, c.k, c.v, tables, lens, HEAD_DIM**-0.5, 0, 0.0, c.k_scale, c.v_scale)

    return best_of(run, args.repeats)


def prefill_case(ops, kind: str, block_size: int, chunk: int, cached: int, args) -> float:
    num_blocks = -(-(chunk + cached) // block_size)
    caches = make_caches(kind, args.layers, num_blocks, block_size)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(chunk, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    tables = torch.arange(num_blocks).view(1, num_blocks)
    spans = torch.tensor([[0, chunk, cached, 0]])

    def run() -> None:
        for c in caches:
            ops.paged_prefill(q, c.k, c.v, tables, spans, HEAD_DIM**-0.5, out, 0, 0.0, c.k_scale, c.v_scale)

    return best_of(run, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default="bf16/32,int8/64,int8/32", help="dtype/block_size, the first the base")
    parser.add_argument(
        "--decode",
        default="1x400,8x400,48x400,128x400,8x2000,48x2000,64x16-768",
        help="batch x context, or batch x low-high",
    )
    parser.add_argument("--prefill", default="2048+0,512+1536", help="chunk + cached tokens (needs AMX or AVX512-BF16)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ops = loader.ops()
    caches = [(kind, int(size)) for kind, size in (c.split("/") for c in args.caches.split(","))]
    cases: list[tuple[str, Callable[[str, int], float]]] = []
    for case in filter(None, args.decode.split(",")):
        batch_text, context_text = case.split("x")
        batch, (low, _, high) = int(batch_text), context_text.partition("-")
        context = (int(low), int(high or low))
        cases.append((f"decode {case}", lambda k, s, b=batch, c=context: decode_case(ops, k, s, b, c, args)))
    if ops.bf16_kernels_ready():
        for case in filter(None, args.prefill.split(",")):
            chunk, cached = (int(x) for x in case.split("+"))
            cases.append((f"prefill {case}", lambda k, s, n=chunk, c=cached: prefill_case(ops, k, s, n, c, args)))
    print(f"threads {torch.get_num_threads()}, {args.layers} layers, best of {args.repeats}; ms for all layers")
    print(f"{'case':<20}" + "".join(f"{f'{k}/{s}':>12}" for k, s in caches) + "   vs " + "/".join(map(str, caches[0])))
    for name, run in cases:
        if name.startswith("prefill") and any(kind == "fp32" for kind, _ in caches):
            continue  # the prefill kernel is bf16 only (fp32 models prefill through sdpa)
        times = [run(kind, size) * 1e3 for kind, size in caches]
        ratios = "  ".join(f"{times[0] / t:.2f}x" for t in times[1:])
        print(f"{name:<20}" + "".join(f"{t:>12.2f}" for t in times) + f"   {ratios}")


if __name__ == "__main__":
    main()
