"""Decode steps through all layers in one C++ call against the Python layer loop, alternating in one process.

Usage:
    python bench/bench_fused_decode.py [--model DIR_OR_GGUF] [--dtype bfloat16] [--quantization int8]
        [--kv-cache-dtype int8] [--batches 1,8,32,64] [--context 300] [--rounds 3] [--steps 6]

One runner; for each batch, each round runs a few decode steps fused, then
the same steps with the model's fused decode switched off (the Python loop of
``LlamaModel.forward``), so both see the same period of a noisy machine. It
prints the median step time of each and their ratio, and whether the two
produced the same tokens (they must: the same kernels in the same order).
Without --model it prepares the default model (SmolLM2).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_executor import decode_plan, start_decode

from executor_svc.runner.model_runner import ModelRunner
from pagoda.runtime.flags import parse_size


def decode_steps(runner: ModelRunner, batch: int, context: int, steps: int) -> tuple[float, list]:
    """Median seconds of ``steps`` decode steps of ``batch`` sequences at ``context``, and their tokens."""
    start_decode(runner, batch, context, steps)
    times, tokens = [], []
    for step in range(steps):
        start = time.perf_counter()
        out = runner.execute(decode_plan(step + 1, batch))
        times.append(time.perf_counter() - start)
        assert not out.errors, out.errors[0]
        tokens.append([o.token_ids for o in out.outputs])
    return statistics.median(times), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from executor_svc.loading.model_cache import prepare_default_model

        model = str(prepare_default_model())
    runner = ModelRunner(
        model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory),
        max_model_len=max(1024, args.context + args.steps + 8),
    )
    runner.warmup()
    fused = runner.model.fused_decode
    print(f"model {model}  {args.dtype}, weights {runner.info.quantization}, KV {runner.info.kv_cache_dtype}")
    if fused is None:
        raise SystemExit(f"this model's decode steps are not fused here: {runner.model.decode_path}")
    print(f"{'batch':>6} {'fused ms':>9} {'loop ms':>8} {'ratio':>7}  same tokens")
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {"fused": [], "loop": []}
        tokens: dict[str, list] = {}
        for _ in range(args.rounds):
            for name, value in (("fused", fused), ("loop", None)):
                runner.model.fused_decode = value
                seconds, tokens[name] = decode_steps(runner, batch, args.context, args.steps)
                times[name].append(seconds)
        runner.model.fused_decode = fused
        on, off = statistics.median(times["fused"]), statistics.median(times["loop"])
        same = tokens["fused"] == tokens["loop"]
        print(f"{batch:>6} {on * 1e3:>9.2f} {off * 1e3:>8.2f} {off / on:>6.2f}x  {same}")


if __name__ == "__main__":
    main()
