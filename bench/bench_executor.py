"""Executor micro-benchmark: decode step time, prefill speed, attention share, roofline.

Usage:
    python bench/bench_executor.py [--model DIR_OR_GGUF] [--batches 1,8,32,64,128]
        [--context 512] [--dtypes float32,bfloat16] [--kv-dtypes auto,int8] [--quantizations none,int8]
        [--backends torch,cpp]
        [--block-size 16] [--kv-cache-memory 3GiB] [--steps 5] [--rounds 1] [--threads N] [--layer-loop]

With several --kv-dtypes or --quantizations, one runner per variant (each KV
dtype with each quantization) is built and they take turns batch by batch, so
their decode steps are measured side by side; a last table gives each one's
step and attention time against the first's.

Decode steps run as served: all layers in one C++ call where the model has it
(models/fused_decode.py), so no attention share is measured ("fused" in the
attention columns); ``--layer-loop`` runs them through the Python layer loop,
which times the attention backend's calls.

Without --model it prepares the default model (SmolLM2) with
``executor_svc.loading.model_cache``. Decode sequences are registered with
``context - 1`` tokens already cached (the plan says so), so no long prefill is
needed: attention reads the same number of blocks as after a real prefill.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from executor_svc.attention import cpu_kernel, get_backend, triton_available
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import SamplingParams
from pagoda.runtime.flags import parse_size

GREEDY = SamplingParams(temperature=0.0)


def measure_peaks(device: torch.device) -> dict[str, float]:
    """Measured GEMM TFLOP/s (fp32, bf16) and copy bandwidth GB/s on this machine."""
    peaks = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(2048, 2048, dtype=dtype, device=device)
        b = torch.randn(2048, 2048, dtype=dtype, device=device)
        seconds = _best_time(lambda a=a, b=b: torch.mm(a, b), device)
        peaks[f"gemm_{name}_tflops"] = 2 * 2048**3 / seconds / 1e12
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device)
    peaks["copy_gbps"] = 2 * src.numel() * 4 / seconds / 1e9  # read + write
    return peaks


def _best_time(fn, device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class AttentionTimer:
    """Wraps a backend's forward to add up the time spent in attention."""

    def __init__(self, backend, device):
        self.backend, self.device, self.seconds = backend, device, 0.0
        self.name = backend.name

    def prepare(self, meta):
        return self.backend.prepare(meta)

    def forward(self, *args):
        _sync(self.device)
        start = time.perf_counter()
        out = self.backend.forward(*args)
        _sync(self.device)
        self.seconds += time.perf_counter() - start
        return out


def start_decode(runner: ModelRunner, batch: int, context: int, steps: int) -> None:
    """Registers ``batch`` sequences of ``context`` tokens, all but the last cached (the plan says so), with
    blocks for ``steps`` decode steps: ready for ``decode_plan``'s steps."""
    runner.reset()
    num_blocks = -(-(context + steps + 1) // runner.block_size)
    new = tuple(
        t.NewSequence(
            i,
            f"b{i}",
            tuple((7 * i + j) % 1000 + 10 for j in range(context)),
            context,
            GREEDY,
            tuple(range(i * num_blocks, (i + 1) * num_blocks)),
            context - 1,
            1,
        )
        for i in range(batch)
    )
    runner.execute(t.StepPlan(0, new_seqs=new))


def decode_plan(step: int, batch: int) -> t.StepPlan:
    """Step ``step`` (from 1) of ``start_decode``'s sequences: one token each."""
    return t.StepPlan(step, scheduled_seqs=tuple(t.ScheduledSequence(i, 1) for i in range(batch)))


def decode_step(runner: ModelRunner, batch: int, context: int, steps: int) -> tuple[float, float]:
    """Median decode step seconds and attention share at a given batch and context."""
    start_decode(runner, batch, context, steps)
    timer = runner.backend
    times, shares = [], []
    for step in range(steps):
        timer.seconds = 0.0
        start = time.perf_counter()
        out = runner.execute(decode_plan(step + 1, batch))
        elapsed = time.perf_counter() - start
        assert not out.errors, out.errors[0]
        times.append(elapsed)
        shares.append(timer.seconds / elapsed)
    if getattr(runner.model, "fused_decode", None) is not None:
        return statistics.median(times), math.nan  # attention ran inside the one C++ call: not timed apart
    return statistics.median(times), statistics.median(shares)


def prefill_tokens_per_s(runner: ModelRunner, context: int) -> float:
    """Tokens/s of one prompt of `context` tokens computed in one step."""
    runner.reset()
    blocks = tuple(range(-(-(context + 1) // runner.block_size)))
    new = t.NewSequence(0, "p", tuple(range(10, 10 + context)), context, GREEDY, blocks, 0, context)
    runner.execute(t.StepPlan(0, new_seqs=(new,)))  # warm
    runner.reset()
    start = time.perf_counter()
    runner.execute(t.StepPlan(1, new_seqs=(new,)))
    return context / (time.perf_counter() - start)


def decode_roofline_s(runner: ModelRunner, batch: int, context: int, peaks: dict[str, float], dtype: str) -> float:
    """Lower bound on a decode step: max(compute at GEMM peak, bytes at copy bandwidth)."""
    c = runner.config
    per_layer = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    )
    per_layer += 3 * c.hidden_size * c.intermediate_size
    weights = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    attn_flops = 4 * batch * context * c.num_heads * c.head_dim * c.num_layers
    flops = 2 * weights * batch + attn_flops
    elem = torch.empty((), dtype=runner.dtype).element_size()
    kv_bytes = batch * context * runner.kv_cache.spec.bytes_per_block / runner.block_size
    bytes_moved = weights * elem + kv_bytes
    return max(flops / (peaks[f"gemm_{dtype}_tflops"] * 1e12), bytes_moved / (peaks["copy_gbps"] * 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kv-dtypes", default="auto", help="KV cache dtypes to compare, e.g. auto,int8")
    parser.add_argument("--quantizations", default="auto", help="weight quantizations to compare, e.g. none,int8")
    parser.add_argument("--backends", default="torch,cpp", help="attention backends (those that run here)")
    parser.add_argument("--block-size", type=int, default=16, help="0: the executor's default for the KV dtype")
    parser.add_argument("--kv-cache-memory", default=None, help="KV budget per runner (default 1GiB), e.g. 3GiB")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="turns per (runner, batch); the median is printed")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--layer-loop", action="store_true", help="decode through the Python layer loop (times attention)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from executor_svc.loading.model_cache import prepare_default_model

        model = str(prepare_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    print(f"model {model}  threads {torch.get_num_threads()}  context {args.context}")
    for dtype in args.dtypes.split(","):
        _bench_dtype(model, dtype, batches, args)


def _runner(model: str, dtype: str, variant: tuple[str, str], batches: list[int], args) -> ModelRunner:
    kv_dtype, quantization = variant
    runner = ModelRunner(
        model,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        quantization=quantization,
        device=args.device,
        block_size=args.block_size or None,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        max_model_len=max(args.context + args.steps + 8, 1024),
    )
    num_blocks_needed = max(batches) * -(-(args.context + args.steps + 1) // runner.block_size) + 8
    if runner.info.num_kv_blocks < num_blocks_needed:
        raise SystemExit(
            f"not enough KV memory for batch {max(batches)} at context {args.context} with a {kv_dtype} cache "
            f"({runner.info.num_kv_blocks} blocks, {num_blocks_needed} needed): give --kv-cache-memory"
        )
    return runner


def _variant_name(runner: ModelRunner) -> str:
    """``KV bfloat16, weights none``: what a variant runs, read off its runner."""
    return f"KV {runner.info.kv_cache_dtype}, weights {runner.info.quantization}"


def _bench_dtype(model: str, dtype: str, batches: list[int], args) -> None:
    """Every variant's runner (KV dtype x quantization), taking turns batch by batch (side by side in one run),
    for each backend."""
    variants = list(dict.fromkeys((kv, q) for q in args.quantizations.split(",") for kv in args.kv_dtypes.split(",")))
    runners = {variant: _runner(model, dtype, variant, batches, args) for variant in variants}
    _share_weights(runners)
    device = next(iter(runners.values())).device
    peaks = measure_peaks(device)
    print(
        f"\n== {dtype} on {device}: GEMM fp32 {peaks['gemm_float32_tflops']:.2f} TFLOP/s, "
        f"bf16 {peaks['gemm_bfloat16_tflops']:.2f} TFLOP/s, copy {peaks['copy_gbps']:.1f} GB/s"
    )
    for backend_name in _backends(device, args.backends):
        for runner in runners.values():
            runner.backend = AttentionTimer(get_backend(backend_name, device, runner.dtype), device)
            if args.layer_loop:
                runner.model.fused_decode = None
            runner.warmup()
        times: dict[tuple[tuple[str, str], int], list[tuple[float, float]]] = {}
        for batch in batches:
            for _ in range(args.rounds):
                for variant, runner in runners.items():
                    times.setdefault((variant, batch), []).append(decode_step(runner, batch, args.context, args.steps))
        for variant, runner in runners.items():
            print(f"-- attention backend {backend_name}, {_variant_name(runner)}, block {runner.block_size}")
            print(f"{'batch':>6} {'step ms':>9} {'tok/s':>8} {'attn %':>7} {'roofline ms':>12} {'% roofline':>11}")
            for batch in batches:
                step_s, share = _median_step(times[(variant, batch)])
                bound = decode_roofline_s(runner, batch, args.context, peaks, dtype)
                attention = "fused" if math.isnan(share) else f"{share * 100:.1f}%"
                print(
                    f"{batch:>6} {step_s * 1e3:>9.1f} {batch / step_s:>8.1f} {attention:>7} "
                    f"{bound * 1e3:>12.2f} {bound / step_s * 100:>10.1f}%"
                )
            print(f"prefill {args.context} tokens: {prefill_tokens_per_s(runner, args.context):.0f} tokens/s")
        if len(variants) > 1:
            _print_ratios(runners, times, batches, variants)


def _share_weights(runners: dict[tuple[str, str], ModelRunner]) -> None:
    """Runners of one quantization run the first one's model (the same weight tensors): two copies of the same
    weights can stream at different speeds (measured: ~4 ms of a ~20 ms SmolLM2 step, stable for a copy's
    lifetime, whichever was loaded first), which would hide what the KV dtype changes."""
    first: dict[str, ModelRunner] = {}
    for (_, quantization), runner in runners.items():
        if quantization in first:
            runner.model = first[quantization].model
        else:
            first[quantization] = runner


def _backends(device: torch.device, asked: str) -> list[str]:
    """The asked backends that run on this device (torch always; cpp where built; triton on CUDA)."""
    runs = {"torch": True, "cpp": device.type == "cpu" and cpu_kernel.is_built()}
    runs["triton"] = device.type == "cuda" and triton_available()
    return [name for name in asked.split(",") if runs.get(name)]


def _median_step(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """The sample of median step time (step seconds, attention share)."""
    return sorted(samples)[len(samples) // 2]


def _print_ratios(runners, times, batches: list[int], variants: list[tuple[str, str]]) -> None:
    """Each variant's decode step and attention time against the first variant's, batch by batch."""
    base = variants[0]
    print(f"-- decode step vs {_variant_name(runners[base])} (x = its time / this one's)")
    for variant in variants[1:]:
        for batch in batches:
            mine, theirs = _median_step(times[(variant, batch)]), _median_step(times[(base, batch)])
            step = (
                f"   {_variant_name(runners[variant])}, batch {batch:>4}: {mine[0] * 1e3:.1f} ms vs "
                f"{theirs[0] * 1e3:.1f} ms ({theirs[0] / mine[0]:.2f}x)"
            )
            if math.isnan(mine[1]) or math.isnan(theirs[1]):
                print(step + "; attention inside the one-call decode (--layer-loop times it)")
                continue
            print(
                f"{step}; attention {mine[0] * mine[1] * 1e3:.1f} vs {theirs[0] * theirs[1] * 1e3:.1f} ms "
                f"({theirs[0] * theirs[1] / (mine[0] * mine[1]):.2f}x)"
            )


if __name__ == "__main__":
    main()
