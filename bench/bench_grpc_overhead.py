"""What the gRPC hop costs: the same workload through the two services versus
the same scheduler core and model runner called in one process.

Workload (issue W-mixed): 64 requests, prompt 16-512 and output 16-256 tokens
uniform (random.Random(0)), all sent at once, outputs forced to length, greedy.
Prints output tokens/s of both, their ratio, and the executor's idle time
between steps in the gRPC run.

    .venv/bin/python bench/bench_grpc_overhead.py [--model DIR] [--dtype bfloat16] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request

from pagoda_bench.workload import random_workload


def in_process(model: str, dtype: str, workload, kv_bytes: int, budget: int) -> tuple[float, int]:
    """(seconds, steps) to run the workload with Scheduler + ModelRunner, no gRPC."""
    from executor_svc.runner.model_runner import ModelRunner
    from pagoda.params import SamplingParams, StoppingCriteria
    from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
    from scheduler_svc.core.sequence import SchedulerSequence

    runner = ModelRunner(model, dtype=dtype, kv_cache_memory_bytes=kv_bytes)
    runner.warmup()
    info = runner.info
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_batched_tokens=budget,
            max_model_len=info.max_model_len,
        )
    )
    for r in workload:
        sched.add(
            SchedulerSequence(
                r.index + 1,
                str(r.index),
                list(r.prompt_token_ids),
                SamplingParams(temperature=0.0),
                StoppingCriteria(max_tokens=r.output_len, ignore_eos=True),
            )
        )
    start = time.perf_counter()
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(runner.execute(plan))  # both sides speak pagoda.step
        steps += 1
    return time.perf_counter() - start, steps


async def _through_grpc(target: str, workload) -> float:
    from pagoda_client import AsyncClient

    async with AsyncClient(target, timeout=3600) as client:
        await client.generate(token_ids=[5, 6, 7], max_tokens=2, temperature=0)
        start = time.perf_counter()
        await asyncio.gather(
            *(
                client.generate(
                    token_ids=list(r.prompt_token_ids), max_tokens=r.output_len, temperature=0, ignore_eos=True
                )
                for r in workload
            )
        )
        return time.perf_counter() - start


def _scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    from executor_svc.loading.model_cache import resolve_model
    from pagoda.launch.launcher import Launcher, free_port

    model = resolve_model(args.model or "default")
    workload = random_workload(args.num_prompts, (16, 512), (16, 256), seed=0, vocab_size=49152, excluded_ids=(0, 1, 2))
    num_output = sum(r.output_len for r in workload)
    kv = 1 << 30
    metrics_port = free_port()
    with Launcher(
        model,
        dtype=args.dtype,
        kv_cache_memory=str(kv),
        extra_executor_args=["--metrics-port", str(metrics_port)],
        extra_scheduler_args=["--max-num-batched-tokens", str(args.max_num_batched_tokens)],
    ) as system:
        idle0, steps0 = (
            _scrape(metrics_port, "pagoda_executor_idle_seconds_sum"),
            _scrape(metrics_port, "pagoda_executor_steps_total"),
        )
        grpc_s = asyncio.run(_through_grpc(system.target, workload))
        idle = _scrape(metrics_port, "pagoda_executor_idle_seconds_sum") - idle0
        steps = _scrape(metrics_port, "pagoda_executor_steps_total") - steps0
    local_s, local_steps = in_process(model, args.dtype, workload, kv, args.max_num_batched_tokens)
    print(f"model {model} dtype {args.dtype}: {len(workload)} requests, {num_output} output tokens")
    print(f"in-process : {local_s:7.1f} s  {num_output / local_s:7.1f} output tok/s  ({local_steps} steps)")
    print(
        f"two services: {grpc_s:7.1f} s  {num_output / grpc_s:7.1f} output tok/s  ({steps:.0f} steps, "
        f"executor idle {idle:.2f} s in all = {idle / grpc_s * 100:.1f}% of the run, {idle / steps * 1e3:.2f} ms/step)"
    )
    print(f"throughput ratio services / in-process: {local_s / grpc_s:.3f}")


if __name__ == "__main__":
    main()
