"""The linear layers of one decode or prefill step: our panel GEMM vs torch's.

Runs every linear layer of a SmolLM2-135M-shaped model (30 layers of qkv, o,
gate_up, down; the LM head for decode-sized batches) with distinct random
weights, so the weights come from memory as in a real step, and prints the
time per step for each path side by side:

- fp32: our panel GEMM (AVX-512, or AVX2 + FMA) vs ``F.linear`` (MKL sgemm) and oneDNN packed;
- bf16: our panel GEMM (AMX tiles, or AVX512-BF16 dot products; on AVX2 alone the bf16 weights widened to
  our fp32 panels, as the executor runs them) vs oneDNN packed (what runs without either), and the quantized layers of
  ``--quantized`` (``--quantization`` modes: int8, q8_0, q4_0; q4_1 as a GGUF file stores it) with bf16 inputs,
  each as the executor builds it (``executor_svc.quant``): ``bf16/X`` is the bf16 GEMM's time over X's.

Usage: python bench/bench_linear.py [--rows 1,8,24,48,64,512,2048] [--dtypes float32,bfloat16]
    [--quantized int8,q8_0,q4_0,q4_1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from executor_svc.models.layer_ops import get_layer_ops, onednn_bf16_packs
from executor_svc.native import loader
from executor_svc.quant import gguf_blocks
from executor_svc.quant.modes import MODES, Target

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
NUM_LAYERS = 30
DECODE_ROWS = 64  # the LM head runs only on sampled rows


def _paths(gemm, dtype):
    """name -> (pack(weight) -> packed, run(x, packed, out_features))."""
    onednn = (
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        lambda x, p, n: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
    )
    if dtype == torch.float32:
        return {
            "pagoda": (gemm.pack_f32, lambda x, p, n: gemm.linear_f32(x, p, n, None)),
            "sgemm": (lambda w: w, lambda x, p, n: F.linear(x, p)),
            "onednn": onednn,
        }
    paths = {"onednn": onednn} if onednn_bf16_packs() else {}
    if gemm.bf16_kernels_ready():
        paths["pagoda"] = (gemm.pack_bf16, lambda x, p, n: gemm.linear_bf16(x, p, n, None))
    elif not paths:  # AVX2 alone: the executor widens bf16 weights to our fp32 panels (f32-panel-widened)
        ops = get_layer_ops("cpp", torch.device("cpu"), torch.bfloat16)
        paths["pagoda"] = (ops.pack, lambda x, p, n: ops.linear(x, p))
    return paths


def _quantized_paths(kernels, names: list[str]):
    """name -> (pack(bf16 weight) -> the executor's quantized layer, run(x, layer, out_features))."""
    target = Target(torch.device("cpu"), torch.bfloat16, kernels, "auto")

    def packer(name):
        if name == "q4_1":  # no mode quantizes to Q4_1 (a GGUF file's own type): its blocks, as the loader keeps them
            return lambda w: gguf_blocks.block_linear(
                gguf_blocks.quantize_blocks(w, gguf_blocks.Q.Q4_1), *target.block_kernels()
            )
        return lambda w: MODES[name].quantize(w, target)

    return {name: (packer(name), lambda x, layer, n: layer(x)) for name in names}


def _step(run, weights, rows, dtype) -> float:
    inputs = {k: torch.randn(rows, k, dtype=torch.float32).to(dtype) for k in (576, 1536)}
    start = time.perf_counter()
    for layer in weights["layers"]:
        for name, (n, k) in SHAPES.items():
            run(inputs[k], layer[name], n)
    if rows <= DECODE_ROWS:
        run(inputs[576], weights["lm_head"], LM_HEAD[0])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,24,48,64,512,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--quantized", default="int8", help="quantized layers beside bf16: int8,q8_0,q4_0,q4_1")
    args = parser.parse_args()
    kernels = loader.kernels()
    if kernels is None or "f32_panels" not in kernels.features:
        raise SystemExit("the installed C++ kernels have no panel GEMM (AVX-512 or AVX2 + FMA; make install builds it)")
    gemm = kernels.ops
    gen = torch.Generator().manual_seed(0)
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        paths = _paths(gemm, dtype)
        if dtype == torch.bfloat16 and args.quantized:
            paths.update(_quantized_paths(kernels, args.quantized.split(",")))
        if "pagoda" not in paths:
            print(f"{dtype}: oneDNN's packed bf16 runs here, not our bf16 panels (the executor runs oneDNN)")
            continue
        dense = {
            "layers": [
                {k: (torch.randn(*s, generator=gen) * 0.02).to(dtype) for k, s in SHAPES.items()}
                for _ in range(NUM_LAYERS)
            ],
            "lm_head": (torch.randn(*LM_HEAD, generator=gen) * 0.02).to(dtype),
        }
        packed = {
            name: {
                "layers": [{k: pack(w) for k, w in layer.items()} for layer in dense["layers"]],
                "lm_head": pack(dense["lm_head"]),
            }
            for name, (pack, _) in paths.items()
        }
        for rows in (int(r) for r in args.rows.split(",")):
            best = {}
            for _ in range(args.repeats):  # paths alternate, best of the repeats
                for name, (_, run) in paths.items():
                    best[name] = min(best.get(name, float("inf")), _step(run, packed[name], rows, dtype))
            flops = (
                2
                * rows
                * (
                    NUM_LAYERS * sum(n * k for n, k in SHAPES.values())
                    + (LM_HEAD[0] * LM_HEAD[1] if rows <= DECODE_ROWS else 0)
                )
            )
            cells = "  ".join(f"{name} {t * 1e3:7.1f} ms ({flops / t / 1e9:5.0f} GFLOP/s)" for name, t in best.items())
            ratio = "  ".join(
                f"{name}/pagoda {t / best['pagoda']:.2f}x"
                if name in ("sgemm", "onednn")
                else f"bf16/{name} {best['pagoda'] / t:.2f}x"
                for name, t in best.items()
                if name != "pagoda" and "pagoda" in best
            )
            print(f"{str(dtype).removeprefix('torch.'):9s} rows {rows:5d}: {cells}  {ratio}")


if __name__ == "__main__":
    main()
