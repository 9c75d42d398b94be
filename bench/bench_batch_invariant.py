"""What ``--batch-invariant`` costs: executor step times side by side, then (``--w-mixed``) served throughput.

Step times: for each mode (bf16; int8 weights + int8 KV) one runner with the
switch and one without take turns, batch by batch, on decode steps at
--context (batch 1, 8, 48, 128) and on one prefill of --context tokens; the
table prints each one's median and the ratio (invariant / default; above 1:
the invariant one is slower).

``--w-mixed``: then the served W-mixed workload (64 prompts of 16..512 tokens,
16..256 output tokens), invariant against default, alternating rounds in one
run, through ``bench/ab_serve.py`` (one ``pagoda serve`` per run, a cold KV
offload tier each time), for both modes.

    python bench/bench_batch_invariant.py                      # the step table (a few minutes)
    python bench/bench_batch_invariant.py --w-mixed --rounds 3 # and served throughput (about 25 minutes)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_executor import decode_step, prefill_tokens_per_s

from executor_svc.runner.model_runner import ModelRunner

MODES = {
    "bf16": dict(quantization="none", kv_cache_dtype="auto"),
    "int8": dict(quantization="int8", kv_cache_dtype="int8"),
}
SERVE = "--dtype bfloat16 --kv-cache-memory 1GiB --kv-offload-dir {tmpdir}"
SERVE_ARGS = {"bf16": SERVE, "int8": SERVE + " --quantization int8 --kv-cache-dtype int8"}
W_MIXED = "--num-prompts 64 --input-len-range 16:512 --output-len-range 16:256 --seed 0"


def _runner(model: str, mode: str, invariant: bool, context: int, steps: int) -> ModelRunner:
    runner = ModelRunner(
        model,
        dtype="bfloat16",
        kv_cache_memory_bytes=2 * 2**30,
        max_model_len=max(context + steps + 8, 1024),
        batch_invariant=invariant,
        **MODES[mode],
    )
    runner.warmup()
    return runner


def step_table(model: str, mode: str, batches: list[int], context: int, steps: int, rounds: int) -> None:
    runners = {name: _runner(model, mode, name == "invariant", context, steps) for name in ("default", "invariant")}
    decode: dict[tuple[str, int], list[float]] = {}
    prefill: dict[str, list[float]] = {}
    for _ in range(rounds):
        for batch in batches:
            for name, runner in runners.items():
                decode.setdefault((name, batch), []).append(decode_step(runner, batch, context, steps)[0])
        for name, runner in runners.items():
            prefill.setdefault(name, []).append(prefill_tokens_per_s(runner, context))
    print(f"\n== {mode}: decode step at context {context} (median of {rounds}), ms")
    print(f"{'batch':>6} {'default':>9} {'invariant':>10} {'ratio':>7}")
    for batch in batches:
        base, mine = statistics.median(decode[("default", batch)]), statistics.median(decode[("invariant", batch)])
        print(f"{batch:>6} {base * 1e3:>9.2f} {mine * 1e3:>10.2f} {mine / base:>7.3f}")
    base, mine = statistics.median(prefill["default"]), statistics.median(prefill["invariant"])
    print(
        f"prefill of {context} tokens: default {base:.0f} tok/s, invariant {mine:.0f} tok/s ({base / mine:.3f}x time)"
    )


def w_mixed(mode: str, rounds: int) -> None:
    """Served W-mixed throughput, invariant (B) against default (A), alternating rounds (bench/ab_serve.py)."""
    here = Path(__file__).parent
    command = [
        sys.executable,
        str(here / "ab_serve.py"),
        "--a",
        ".",
        "--b",
        ".",
        "--rounds",
        str(rounds),
        f"--serve-args={SERVE_ARGS[mode]}",
        "--serve-args-b=--batch-invariant",
        f"--bench-args={W_MIXED}",
    ]
    print(f"\n== {mode}: W-mixed served, A default vs B --batch-invariant\n$ {' '.join(command)}", flush=True)
    subprocess.run(command, check=True, cwd=here.parent, timeout=3 * 3600)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--modes", default="bf16,int8")
    parser.add_argument("--batches", default="1,8,48,128")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--w-mixed", action="store_true", help="then served W-mixed throughput (bench/ab_serve.py)")
    parser.add_argument("--no-steps", action="store_true", help="skip the step table")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from executor_svc.loading.model_cache import prepare_default_model

        model = str(prepare_default_model())
    print(f"model {model}  threads {torch.get_num_threads()}")
    modes = args.modes.split(",")
    for mode in modes if not args.no_steps else ():
        step_table(model, mode, [int(b) for b in args.batches.split(",")], args.context, args.steps, args.rounds)
    if args.w_mixed:
        for mode in modes:
            w_mixed(mode, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
