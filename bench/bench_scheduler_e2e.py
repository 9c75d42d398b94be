"""Scheduler effects through the real services, on the default model:

1. time to first token of a request whose 1,024-token prefix is cached vs not;
2. inter-token latency of 16 decoding sequences while a 4,096-token prompt
   arrives, with chunked prefill (token budget 512) vs without (budget 8,192).

    .venv/bin/python bench/bench_scheduler_e2e.py [--model DIR] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import threading
import time

from pagoda.launch.launcher import Launcher
from pagoda_client import Client


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def ttft_s(client: Client, token_ids: list[int]) -> float:
    start = time.perf_counter()
    for delta in client.stream(token_ids=token_ids, max_tokens=1, temperature=0):
        if delta.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token")


def bench_prefix_cache(target: str, runs: int) -> tuple[float, float]:
    """Median TTFT without and with the 1,024-token prefix cached."""
    rng = random.Random(0)
    cold, warm = [], []
    with Client(target, timeout=600) as client:
        ttft_s(client, _tokens(rng, 64))  # warm-up
        for _ in range(runs):
            prefix = _tokens(rng, 1024)
            cold.append(ttft_s(client, prefix + _tokens(rng, 8)))
            warm.append(ttft_s(client, prefix + _tokens(rng, 8)))
    return statistics.median(cold), statistics.median(warm)


def bench_itl_during_long_prompt(target: str) -> list[float]:
    """Gaps (s) between streamed tokens of 16 decoders while a 4,096-token prompt is prefilled."""
    rng = random.Random(1)
    gaps: list[float] = []
    lock = threading.Lock()
    started = threading.Barrier(17)

    def decoder() -> None:
        last = None
        count = 0
        for delta in client.stream(token_ids=_tokens(rng, 32), max_tokens=160, temperature=0, ignore_eos=True):
            now = time.perf_counter()
            count += len(delta.token_ids)
            if count == 20:
                started.wait()
            if last is not None and count > 20:
                with lock:
                    gaps.append((now - last) / max(len(delta.token_ids), 1))
            last = now

    with Client(target, timeout=600) as client:
        ttft_s(client, _tokens(rng, 64))
        with concurrent.futures.ThreadPoolExecutor(17) as pool:
            futures = [pool.submit(decoder) for _ in range(16)]
            started.wait()
            client.generate(token_ids=_tokens(rng, 4096), max_tokens=1, temperature=0)
            for f in futures:
                f.result()
    return gaps


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from executor_svc.loading.model_cache import resolve_model

    model = resolve_model(args.model or "default")
    common = dict(dtype=args.dtype, kv_cache_memory="768MiB")
    with Launcher(model, **common, extra_scheduler_args=["--max-num-batched-tokens", "512"]) as system:
        cold, warm = bench_prefix_cache(system.target, args.runs)
        chunked = bench_itl_during_long_prompt(system.target)
    with Launcher(model, **common, extra_scheduler_args=["--max-num-batched-tokens", "8192"]) as system:
        whole = bench_itl_during_long_prompt(system.target)
    print(f"model {model} dtype {args.dtype}")
    print(f"TTFT 1024-token prefix: uncached {cold * 1e3:.0f} ms, cached {warm * 1e3:.0f} ms, ratio {cold / warm:.1f}x")
    for name, gaps in (("chunked (budget 512)", chunked), ("unchunked (budget 8192)", whole)):
        print(
            f"ITL of 16 decoders during a 4096-token prefill, {name}: p50 {p(gaps, 0.5) * 1e3:.0f} ms, "
            f"p99 {p(gaps, 0.99) * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
