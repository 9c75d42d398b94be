"""Many executors on one machine:

1. throughput of the W-mixed workload with 2 executors versus 1, each executor
   limited to one thread and pinned to its own core (taskset), in one run;
2. time from SIGKILL of one executor to the first token its sequences produce
   on the other one.

    .venv/bin/python bench/bench_executors.py [--model DIR] [--dtype bfloat16] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import signal
import subprocess
import threading
import time

from pagoda.launch.launcher import Launcher
from pagoda_bench.workload import random_workload
from pagoda_client import AsyncClient, Client


def pin(pids: list[int]) -> None:
    """Pin every thread of executor i to core i."""
    for core, pid in enumerate(pids):
        subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True, capture_output=True)


async def _run(target: str, workload) -> float:
    async with AsyncClient(target, timeout=3600) as client:
        await client.generate(token_ids=[5, 6, 7], max_tokens=2)
        start = time.perf_counter()
        await asyncio.gather(
            *(
                client.generate(token_ids=list(r.prompt_token_ids), max_tokens=r.output_len, ignore_eos=True)
                for r in workload
            )
        )
        return time.perf_counter() - start


def throughput(model: str, dtype: str, workload, num_executors: int) -> float:
    """Output tokens/s of the workload with `num_executors` single-thread pinned executors."""
    with Launcher(
        model,
        num_executors=num_executors,
        dtype=dtype,
        kv_cache_memory="768MiB",
        extra_executor_args=["--num-threads", "1"],
    ) as system:
        pin(system.executor_pids)
        seconds = asyncio.run(_run(system.target, workload))
    return sum(r.output_len for r in workload) / seconds


def recovery_s(model: str, dtype: str) -> list[float]:
    """Per stream: seconds from the kill to its next token (the moved ones recompute)."""
    with Launcher(
        model, num_executors=2, dtype=dtype, kv_cache_memory="768MiB", extra_executor_args=["--num-threads", "1"]
    ) as system:
        pin(system.executor_pids)
        killed_at: list[float] = []
        waits: list[float] = []
        lock = threading.Lock()
        started = threading.Barrier(17)

        def stream(i: int) -> None:
            count = 0
            with Client(system.target, timeout=600, max_retries=0) as client:
                for delta in client.stream(token_ids=[100 + i] * 64, max_tokens=240, ignore_eos=True):
                    count += len(delta.token_ids)
                    if count == 20:
                        started.wait()
                    if killed_at and len(killed_at) == 1 and delta.token_ids:
                        with lock:
                            if i not in seen:
                                seen.add(i)
                                waits.append(time.perf_counter() - killed_at[0])

        seen: set[int] = set()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(stream, i) for i in range(16)]
            started.wait()
            time.sleep(0.5)
            killed_at.append(time.perf_counter())
            system.kill_executor(0, signal.SIGKILL)
            for f in futures:
                f.result()
        return sorted(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args()
    from executor_svc.loading.model_cache import resolve_model

    model = resolve_model(args.model or "default")
    workload = random_workload(args.num_prompts, (16, 512), (16, 256), seed=0, vocab_size=49152, excluded_ids=(0, 1, 2))
    one = throughput(model, args.dtype, workload, 1)
    two = throughput(model, args.dtype, workload, 2)
    waits = recovery_s(model, args.dtype)
    print(f"model {model} dtype {args.dtype}, {len(workload)} requests, one thread per executor, pinned")
    print(f"1 executor : {one:7.1f} output tok/s")
    print(f"2 executors: {two:7.1f} output tok/s   ratio {two / one:.2f}x")
    print(
        f"kill -> next token per stream (s): median {waits[len(waits) // 2]:.2f}, max {waits[-1]:.2f} "
        f"(16 streams; the killed executor's streams recompute on the other)"
    )


if __name__ == "__main__":
    main()
