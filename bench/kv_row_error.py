"""How much of SmolLM2's own K and V a per-row quantization loses: int8 (the int8 KV cache) against fp8 e4m3.

Usage:
    python bench/kv_row_error.py [--model DIR] [--tokens 512] [--text bench/data/perplexity.txt]

Runs the bf16 model over the first ``--tokens`` tokens of the text (one prefill), takes every layer's K and V
rows from its bf16 KV cache, quantizes each (token, kv head) row scaled to its own maximum, int8 as
``kv_cache.quantize_rows`` does (127 steps) and fp8 e4m3 (``max|row|`` mapped to 448), and prints the relative
RMS error of each against the rows themselves.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tokenizers
import torch

from executor_svc.kv.cache import dequantize_rows, quantize_rows
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
E4M3_MAX = 448.0
BLOCK_SIZE = 32


def cached_rows(model: str, token_ids: list[int]) -> torch.Tensor:
    """K and V rows the bf16 model cached for the tokens: [L, 2, KVH, T, Dh] fp32."""
    runner = ModelRunner(model, dtype="bfloat16", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**28)
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    new = t.NewSequence(
        1,
        "r",
        tuple(token_ids),
        len(token_ids),
        SamplingParams(temperature=0.0),
        tuple(range(num_blocks)),
        0,
        len(token_ids),
    )
    result = runner.execute(t.StepPlan(1, new_seqs=(new,)))
    assert not result.errors, result.errors
    rows = runner.kv_cache.storage[:, :, :, :num_blocks].float()  # [L, 2, KVH, nb, BS, Dh]
    return rows.flatten(3, 4)[:, :, :, : len(token_ids)]


def relative_error(approx: torch.Tensor, rows: torch.Tensor) -> float:
    return ((approx - rows).norm() / rows.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--text", type=Path, default=ROOT / "bench" / "data" / "perplexity.txt")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from executor_svc.loading.model_cache import prepare_default_model

        model = str(prepare_default_model())
    tokenizer = tokenizers.Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    rows = cached_rows(model, tokenizer.encode(args.text.read_text(encoding="utf-8")).ids[: args.tokens])
    quantized, scale = quantize_rows(rows)
    int8 = dequantize_rows(quantized, scale, torch.float32)
    fp8_scale = rows.abs().amax(-1, keepdim=True) / E4M3_MAX
    fp8 = (rows / fp8_scale.clamp_min(1e-30)).to(torch.float8_e4m3fn).float() * fp8_scale
    print(f"{rows.shape[3]} tokens, {rows.shape[0]} layers; relative RMS error per row-scaled format:")
    for name, approx in (("int8 + fp32 scale", int8), ("fp8 e4m3 + fp32 scale", fp8)):
        k, v = relative_error(approx[:, 0], rows[:, 0]), relative_error(approx[:, 1], rows[:, 1])
        print(f"  {name:<24} K {k * 100:.2f}%  V {v * 100:.2f}%")


if __name__ == "__main__":
    main()
