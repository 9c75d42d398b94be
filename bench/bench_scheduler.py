"""Scheduler cost per step: schedule() + update() in steady decode, no model, no network.

For each number of running sequences and each context length, fills a
scheduler with sequences that have finished their prefill, then runs the
engine's overlapped loop (plan N+1 is scheduled before result N is applied)
and times schedule() and update() separately. The executor's result for each
plan (one token per sampling sequence) is built outside the timed region: in
the service that is proto conversion, measured elsewhere.

The cost should follow what changes per step (one token per sequence, a block
every block_size steps), not the context each sequence holds.

Usage:
    .venv/bin/python bench/bench_scheduler.py
    .venv/bin/python bench/bench_scheduler.py --num-seqs 256 --context 2048 --steps 500 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import SeqOutput, StepPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence

BLOCK_SIZE = 16
TOKEN = 7  # every sampled token; never EOS


def build(num_seqs: int, context: int, num_steps: int, seed: int = 0) -> Scheduler:
    """A scheduler whose num_seqs sequences hold `context` tokens each, all decoding."""
    max_tokens = num_steps * 2 + 64
    blocks_per_seq = -(-(context + max_tokens) // BLOCK_SIZE)
    config = SchedulerConfig(
        num_blocks=num_seqs * blocks_per_seq + 16,
        block_size=BLOCK_SIZE,
        max_num_seqs=num_seqs,
        # Large enough to prefill everything in one setup step; a decode step
        # uses num_seqs tokens of it whatever its size.
        max_num_batched_tokens=num_seqs * context + num_seqs,
        max_model_len=context + max_tokens,
    )
    scheduler = Scheduler(config)
    rng = random.Random(seed)
    for seq_id in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(context)]
        scheduler.add(SchedulerSequence(seq_id, f"r{seq_id}", prompt, SamplingParams(), StoppingCriteria(max_tokens)))
    plan = scheduler.schedule()
    scheduler.update(fake_result(plan))
    assert scheduler.num_running == num_seqs and scheduler.num_waiting == 0
    return scheduler


def fake_result(plan: StepPlan) -> StepResult:
    """One token for every sequence in the plan (in steady decode, all of them sample)."""
    seq_ids = [s.seq_id for s in plan.new_seqs] + [s.seq_id for s in plan.scheduled_seqs]
    return StepResult(plan.step_id, "bench", tuple(SeqOutput(seq_id, (TOKEN,)) for seq_id in seq_ids))


def measure(num_seqs: int, context: int, num_steps: int, warmup: int = 20) -> dict:
    """Median and p90 of schedule(), update() and their sum, in ms per step.

    Timed twice: thread CPU time (what the scheduler costs, unaffected by other
    processes taking the core) and wall time.
    """
    scheduler = build(num_seqs, context, num_steps + warmup)
    gc.collect()
    gc.freeze()  # setup objects are long-lived; keep the collector off them
    cpu = time.thread_time_ns
    wall = time.perf_counter_ns
    schedule_ns, update_ns, wall_ns = [], [], []
    prev = scheduler.schedule()
    for step in range(warmup + num_steps):
        w0, t0 = wall(), cpu()
        plan = scheduler.schedule()
        t1, w1 = cpu(), wall()
        result = fake_result(prev)
        w2, t2 = wall(), cpu()
        scheduler.update(result)
        t3, w3 = cpu(), wall()
        assert len(plan.scheduled_seqs) == num_seqs, "not in steady decode"
        if step >= warmup:
            schedule_ns.append(t1 - t0)
            update_ns.append(t3 - t2)
            wall_ns.append(w1 - w0 + w3 - w2)
        prev = plan
    gc.unfreeze()
    total_ns = sorted(a + b for a, b in zip(schedule_ns, update_ns))
    return {
        "num_seqs": num_seqs,
        "context": context,
        "schedule_ms": statistics.median(schedule_ns) / 1e6,
        "update_ms": statistics.median(update_ns) / 1e6,
        "total_ms": statistics.median(total_ns) / 1e6,
        "total_p90_ms": total_ns[int(0.9 * len(total_ns))] / 1e6,
        "wall_ms": statistics.median(wall_ns) / 1e6,
        "us_per_seq": statistics.median(total_ns) / 1e3 / num_seqs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 2048, 8192])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    print("CPU time per step (median; p90 of the total), and the wall-clock median")
    print(
        f"{'seqs':>5} {'context':>8} {'schedule ms':>12} {'update ms':>10} {'total ms':>9} {'p90 ms':>7} "
        f"{'us/seq':>7} {'wall ms':>8}"
    )
    for context in args.context:
        for num_seqs in args.num_seqs:
            row = measure(num_seqs, context, args.steps)
            rows.append(row)
            print(
                f"{num_seqs:>5} {context:>8} {row['schedule_ms']:>12.3f} {row['update_ms']:>10.3f} "
                f"{row['total_ms']:>9.3f} {row['total_p90_ms']:>7.3f} {row['us_per_seq']:>7.2f} {row['wall_ms']:>8.3f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
