"""The KV offload tier's figures (docs/kv-offload.md), each measured side by side in one run.

Parts (``--part``, default all):

- ``ttft``: time to first token of N distinct prompts of each length (1k, 3k,
  8k tokens), cold (a fresh tier), then after the whole system was stopped
  (SIGTERM) and started again on the same tier directory; medians and ratios.
- ``bandwidth``: the tier's load bandwidth (blocks of the served model's layout,
  from the page cache and, after ``posix_fadvise(DONTNEED)`` on the tier's own
  files, from the disk) against the prefill speed the cold runs measured, and
  the crossover: the bandwidth at which loading a block costs what computing it
  does.
- ``miss``: W-mixed (``pagoda bench`` defaults) with the tier on, on a fresh
  directory each round (no hit possible), against the tier off, in alternating
  rounds; medians and the ratio.
- ``swap``: 100 requests needing about 5x the KV pool, with the tier (swaps)
  and without (recompute); output tok/s, preemptions, swaps, and whether the
  outputs are identical.

Every system binds 127.0.0.1 and is stopped when the benchmark ends, however it
ends (SIGTERM and SIGINT stop the children's process groups). Run it alone on
the machine (the figures in the doc were taken with nothing else running; the
load average is printed with them). Usage:

    python bench/bench_kv_offload.py --part ttft --lengths 1024,3072,8000 --prompts 3
    python bench/bench_kv_offload.py --part miss --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stop_signals import stop_on_signals

from pagoda.launch.launcher import Launcher, OffloadPlan
from pagoda_client import Client

BENCH_TIMEOUT_S = 1200.0


@contextmanager
def system(args: argparse.Namespace, log_dir: Path, tier: Path | None, **options: object) -> Iterator[Launcher]:
    """One scheduler and one executor of the model, with the tier in ``tier`` (None: no tier)."""
    plan = OffloadPlan(str(tier)) if tier is not None else None
    kv_memory = options.pop("kv_cache_memory", args.kv_cache_memory)
    launcher = Launcher(
        args.model,
        dtype=args.dtype,
        kv_cache_memory=str(kv_memory),
        log_dir=log_dir,
        startup_timeout_s=600,
        kv_offload=plan,
        **options,  # type: ignore[arg-type]
    )
    with launcher:
        yield launcher


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def _ttft(target: str, token_ids: list[int]) -> tuple[float, int, tuple[int, ...]]:
    """(server-side TTFT s, offloaded cached tokens, token ids) of one greedy request."""
    with Client(target, timeout=BENCH_TIMEOUT_S, max_retries=3) as client:
        out = client.generate(token_ids=token_ids, max_tokens=4, temperature=0, ignore_eos=True)
    return out.timings.time_to_first_token_s, out.usage.cached_tokens_offloaded, tuple(out.token_ids)


def part_ttft(args: argparse.Namespace, work: Path) -> dict[str, object]:
    figures: dict[str, object] = {}
    for length in args.lengths:
        prompts = [_prompt(1000 * length + i, length) for i in range(args.prompts)]
        tier = work / f"tier-{length}"
        runs = []
        for phase in ("cold", "warm"):
            with system(args, work / f"logs-{length}-{phase}", tier) as launcher:
                _ttft(launcher.target, _prompt(7, 64))  # the first request of a process pays its own warm-up
                runs.append([_ttft(launcher.target, p) for p in prompts])
        cold, warm = runs
        assert all(c[2] == w[2] for c, w in zip(cold, warm)), "warm tokens differ from cold ones"
        assert all(w[1] > 0 for w in warm), "the warm runs did not load from the tier"
        cold_s, warm_s = statistics.median(c[0] for c in cold), statistics.median(w[0] for w in warm)
        figures[str(length)] = {
            "cold_ttft_s": [round(c[0], 4) for c in cold],
            "warm_ttft_s": [round(w[0], 4) for w in warm],
            "median_cold_s": round(cold_s, 4),
            "median_warm_s": round(warm_s, 4),
            "ratio": round(cold_s / warm_s, 1),
            "prefill_tok_s": round(length / cold_s, 1),
        }
        print(f"ttft {length} tokens: cold {cold_s:.3f} s, warm {warm_s:.3f} s, {cold_s / warm_s:.1f}x", flush=True)
    return figures


def part_bandwidth(args: argparse.Namespace, work: Path, prefill_tok_s: float | None) -> dict[str, object]:
    """Loads of N blocks through the real store, page cache then disk; the crossover with prefill."""
    code = f"""
import json, os, sys, time, torch
from pathlib import Path
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.kv.tier.block_file import TierNamespace
from executor_svc.kv.tier.disk_tier import DiskTier
from executor_svc.kv.tier.store import TierStore
r = ModelRunner({args.model_path!r}, dtype={args.dtype!r}, kv_cache_memory_bytes=512 * 2**20)
kv, n = r.kv_cache, {args.blocks}
ns = TierNamespace("bench", kv.block_layout(), kv.block_nbytes, kv.spec.block_size)
disk = DiskTier(Path({str(work / "bw")!r}), ns, 64 * 2**30); disk.scan()
store = TierStore(ns, disk, None, 2**31)
rows = torch.empty((n, kv.block_nbytes), dtype=torch.uint8)
kv.read_blocks(list(range(n)), rows)
tokens = tuple(range(kv.spec.block_size))
start = time.perf_counter(); store.submit([(i + 1, tokens) for i in range(n)], rows); store.flush(600)
write_s = time.perf_counter() - start
staging = torch.empty_like(rows)
out = {{"block_nbytes": kv.block_nbytes, "block_size": kv.spec.block_size, "blocks": n, "write_s": write_s}}
for where in ("page_cache", "disk"):
    times = []
    for _ in range(3):
        if where == "disk":  # written back, then dropped from the page cache: these files only
            for i in range(n):
                fd = os.open(disk.path(i + 1), os.O_RDONLY)
                os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
        start = time.perf_counter()
        assert set(store.load([(i + 1, tokens) for i in range(n)], staging)) == {{None}}
        kv.write_blocks(torch.arange(n), staging)
        times.append(time.perf_counter() - start)
    out[where + "_s"] = sorted(times)[1]
store.close(60)
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"bandwidth run failed:\n{proc.stderr[-3000:]}")
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    total = raw["blocks"] * raw["block_nbytes"]
    figures: dict[str, object] = {"block_nbytes": raw["block_nbytes"], "block_size": raw["block_size"]}
    figures["write_gib_s"] = round(total / raw["write_s"] / 2**30, 2)
    for where in ("page_cache", "disk"):
        per_block_ms = raw[f"{where}_s"] / raw["blocks"] * 1e3
        figures[where] = {"gib_s": round(total / raw[f"{where}_s"] / 2**30, 2), "ms_per_block": round(per_block_ms, 3)}
    if prefill_tok_s:
        compute_ms = raw["block_size"] / prefill_tok_s * 1e3
        figures["compute_ms_per_block"] = round(compute_ms, 3)
        figures["crossover_mib_s"] = round(raw["block_nbytes"] / (compute_ms / 1e3) / 2**20, 1)
    print(f"bandwidth: {json.dumps(figures)}", flush=True)
    return figures


def _bench(target: str, bench_args: list[str]) -> dict[str, float]:
    """``pagoda bench`` against target: its metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        command = [str(Path(sys.executable).parent / "pagoda"), "bench", "--target", target, "--no-progress"]
        command += ["--json", str(report), *bench_args]
        subprocess.run(command, check=True, timeout=BENCH_TIMEOUT_S, stdout=subprocess.DEVNULL)
        metrics: dict[str, float] = json.loads(report.read_text())["runs"]["pagoda"]["metrics"]
        return metrics


def part_miss(args: argparse.Namespace, work: Path) -> dict[str, object]:
    results: dict[str, list[float]] = {"off": [], "on": []}
    for round_index in range(args.rounds):
        order = ["off", "on"] if round_index % 2 == 0 else ["on", "off"]
        for variant in order:
            tier = work / f"miss-{round_index}-{variant}" if variant == "on" else None  # a fresh directory
            with system(args, work / f"logs-miss-{round_index}-{variant}", tier) as launcher:
                metrics = _bench(launcher.target, args.bench_args)
            results[variant].append(float(metrics["output_throughput"]))
            print(f"miss round {round_index + 1} tier {variant}: {results[variant][-1]:.1f} output tok/s", flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"miss: tier off {off:.1f}, tier on (fresh) {on:.1f} output tok/s, on/off = {on / off:.3f}", flush=True)
    return {
        "off_tok_s": results["off"],
        "on_tok_s": results["on"],
        "median_off": off,
        "median_on": on,
        "ratio": on / off,
    }


def _swap_requests() -> list[dict[str, object]]:
    rng = random.Random(11)
    return [
        {"token_ids": _prompt(500 + i, rng.randrange(200, 400)), "max_tokens": rng.randrange(100, 200)}
        for i in range(100)
    ]


def _run_all(target: str, requests: list[dict[str, object]]) -> tuple[list[tuple[int, ...]], float, object]:
    import concurrent.futures

    with Client(target, timeout=BENCH_TIMEOUT_S, max_retries=0) as client:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            outs = list(pool.map(lambda kw: client.generate(temperature=0, ignore_eos=True, **kw), requests))
        elapsed = time.perf_counter() - start
        return [tuple(o.token_ids) for o in outs], sum(len(o.token_ids) for o in outs) / elapsed, client.status()


def _block_shape(args: argparse.Namespace) -> tuple[int, int]:
    """(tokens per block, bytes per block) of the executor's default CPU block: one 4 KiB page of K per kv head."""
    config = json.loads((Path(args.model_path) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = 2 if args.dtype in ("bfloat16", "float16") else 4
    block_size = max(16, min(128, 4096 // (head_dim * element)))
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return block_size, 2 * config["num_hidden_layers"] * kv_heads * block_size * head_dim * element


def part_swap(args: argparse.Namespace, work: Path) -> dict[str, object]:
    requests = _swap_requests()
    block_size, block_bytes = _block_shape(args)
    blocks = sum(-(-(len(r["token_ids"]) + r["max_tokens"]) // block_size) for r in requests)  # type: ignore[arg-type]
    pool = f"{blocks // 5 * block_bytes // 1024}KiB"
    figures: dict[str, object] = {"blocks_needed": blocks, "pool": pool}
    outputs = {}
    variants = (("roomy", None, args.kv_cache_memory), ("recompute", None, pool), ("swap", work / "swap-tier", pool))
    for variant, tier, memory in variants:
        with system(args, work / f"logs-swap-{variant}", tier, kv_cache_memory=memory) as launcher:
            outputs[variant], tok_s, status = _run_all(launcher.target, requests)
        figures[variant] = {
            "output_tok_s": round(tok_s, 1),
            "preemptions": status.num_preemptions_total,  # type: ignore[attr-defined]
            "swaps": status.num_swaps_total,  # type: ignore[attr-defined]
            # Outputs equal to the roomy run's (no preemption): in fp32 all are; in bf16 a recomputed prefix can
            # round differently from the first computation (another chunking), a loaded one cannot.
            "same_as_roomy": sum(a == b for a, b in zip(outputs[variant], outputs["roomy"])),
        }
        print(f"swap: {variant} {json.dumps(figures[variant])}", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "ttft", "bandwidth", "miss", "swap"), default="all")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 3072, 8000])
    parser.add_argument("--prompts", type=int, default=3, help="distinct prompts per length (ttft)")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per load (bandwidth)")
    parser.add_argument("--prefill-tok-s", type=float, default=None, help="bandwidth alone: the prefill speed")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (miss)")
    parser.add_argument("--bench-args", default="", help="pagoda bench flags (miss; default: W-mixed)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    args = parser.parse_args()
    args.bench_args = args.bench_args.split()
    stop_on_signals()
    from executor_svc.loading.model_cache import prepare_default_model

    args.model_path = args.model or str(prepare_default_model())
    args.model = args.model_path
    figures: dict[str, object] = {"dtype": args.dtype, "load": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-kv-offload-") as tmp:
        work = Path(tmp)
        if args.part in ("all", "ttft"):
            figures["ttft"] = part_ttft(args, work)
        if args.part in ("all", "bandwidth"):
            ttft = figures.get("ttft")
            prefill = max(v["prefill_tok_s"] for v in ttft.values()) if isinstance(ttft, dict) else args.prefill_tok_s
            figures["bandwidth"] = part_bandwidth(args, work, prefill)
        if args.part in ("all", "miss"):
            figures["miss"] = part_miss(args, work)
        if args.part in ("all", "swap"):
            figures["swap"] = part_swap(args, work)
    print(json.dumps(figures, indent=1))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
