"""How W-mixed's block tables lie in the KV pool, and what decode attention pays for it (a benchmark, never a test).

1. Tables (pure Python, the real scheduler): W-mixed stepped through ``scheduler_svc.core`` (one plan in
   flight, as bench/roofline.py steps it) on the pool ``pagoda serve --dtype bfloat16 --kv-cache-memory 1GiB``
   has (1456 blocks of 32 tokens): a first run, then a repeat on the same scheduler (its prompts' full blocks
   in the prefix cache). At each sequence's end: the share of its table's neighbouring pairs that are
   id, id + 1, and its runs of consecutive ids. Each decode step's rows (table, context) are kept.
2. ``--kernel``: the C++ decode attention (``paged_decode``, over ``--layers`` layers of a cache the size of
   that pool) on every ``--every``-th decode step's tables, best of ``--repeats``, summed over the steps;
   beside them the same steps with each row's blocks renumbered in order (the best layout) and shuffled over
   the pool (the worst). With ``--checkouts A,B``, the tables come from each checkout's scheduler (a
   subprocess with that checkout on ``PYTHONPATH``), and every layout is timed step by step in turn, in one
   process, so that a busy spell hits all alike.

Usage:
    python bench/bench_block_layout.py                                   # this tree's tables
    python bench/bench_block_layout.py --checkouts /tmp/before,. --kernel
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import SeqOutput, StepResult
from pagoda_bench.workload import random_workload
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence

# W-mixed, and the bf16 pool of 1 GiB as served (SmolLM2-135M: 30 layers x K, V x 3 kv heads x 64 x 2 bytes).
NUM_PROMPTS, PROMPT_RANGE, OUTPUT_RANGE, SEED, VOCAB = 64, (16, 512), (16, 256), 0, 49152
NUM_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, MAX_BATCHED_TOKENS = 1456, 32, 64, 2048
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
RUNS = ("first run", "repeat")

# One decode step: (block ids, context tokens) of each one-token row.
DecodeStep = list[tuple[list[int], int]]


def w_mixed_tables() -> dict:
    """Each run's tables at their sequences' ends and its decode steps, from this interpreter's scheduler."""
    config = SchedulerConfig(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_model_len=PROMPT_RANGE[1] + OUTPUT_RANGE[1],
    )
    scheduler = Scheduler(config)
    ended: list[list[int]] = []
    free = scheduler.kv.free

    def record_and_free(seq: SchedulerSequence) -> None:
        ended.append(list(seq.block_ids))
        free(seq)

    scheduler.kv.free = record_and_free  # type: ignore[method-assign]
    runs = {}
    for i, run in enumerate(RUNS):
        ended.clear()
        steps, cpu_s = _run_workload(scheduler, i * NUM_PROMPTS)
        runs[run] = {"tables": list(ended), "steps": steps, "scheduler_cpu_s": cpu_s}
    import scheduler_svc

    return {"scheduler": str(Path(scheduler_svc.__file__).parent), "runs": runs}


def _run_workload(scheduler: Scheduler, first_id: int) -> tuple[list[DecodeStep], float]:
    """Every step of W-mixed to the end (each sampled token a fixed id, never a stop): its decode steps, and
    the thread CPU seconds of schedule() and update() (with the recording of ended tables)."""
    for r in random_workload(NUM_PROMPTS, PROMPT_RANGE, OUTPUT_RANGE, SEED, VOCAB):
        stopping = StoppingCriteria(r.output_len)
        seq_id = first_id + r.index
        scheduler.add(SchedulerSequence(seq_id, f"r{seq_id}", list(r.prompt_token_ids), SamplingParams(), stopping))
    steps, cpu_s = [], 0.0
    while scheduler.has_unfinished():
        start = time.thread_time()
        plan = scheduler.schedule()
        cpu_s += time.thread_time() - start
        scheduled = [(s.seq_id, s.num_scheduled_tokens) for s in (*plan.new_seqs, *plan.scheduled_seqs)]
        seqs = [(scheduler.get(seq_id), n) for seq_id, n in scheduled]
        rows = [
            (seq.block_ids[: -(-seq.num_computed_tokens // BLOCK_SIZE)], seq.num_computed_tokens)
            for seq, n in seqs
            if n == 1
        ]
        if rows:
            steps.append([(list(ids), context) for ids, context in rows])
        sampled = [seq.seq_id for seq, _ in seqs if seq.num_pending_tokens]
        result = StepResult(plan.step_id, "layout", tuple(SeqOutput(seq_id, (11,)) for seq_id in sampled))
        start = time.thread_time()
        scheduler.update(result)
        cpu_s += time.thread_time() - start
    return steps, cpu_s


def contiguity(tables: list[list[int]]) -> str:
    """Share of neighbouring pairs that are id, id + 1, and runs of consecutive ids a table."""
    pairs = sum(max(0, len(t) - 1) for t in tables)
    consecutive = sum(b == a + 1 for t in tables for a, b in zip(t, t[1:]))
    runs = sum(1 + sum(b != a + 1 for a, b in zip(t, t[1:])) for t in tables if t)
    blocks = sum(map(len, tables))
    return (
        f"{len(tables)} tables, {blocks} blocks: id+1 pairs {consecutive}/{pairs} = {consecutive / pairs:.1%}, "
        f"runs a table {runs / len(tables):.2f}, blocks a run {blocks / runs:.2f}"
    )


def tables_of(checkout: str, folder: str) -> dict:
    """w_mixed_tables() of ``checkout``'s scheduler, run in a subprocess that imports it first."""
    out = Path(folder) / f"tables-{len(os.listdir(folder))}.json"
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
    subprocess.run([sys.executable, __file__, "--dump", str(out)], check=True, env=env, cwd=folder)
    return json.loads(out.read_text())


def reference_layouts(steps: list[DecodeStep], seed: int = 1) -> dict[str, list[DecodeStep]]:
    """The same steps with each row's blocks in order, one row after another, and shuffled over the pool."""
    import random

    rng = random.Random(seed)
    in_order, shuffled = [], []
    for step in steps:
        sizes = [len(ids) for ids, _ in step]
        ids = list(range(sum(sizes)))
        pool = rng.sample(range(NUM_BLOCKS), len(ids))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        in_order.append([(ids[s : s + n], ctx) for s, n, (_, ctx) in zip(starts, sizes, step)])
        shuffled.append([(pool[s : s + n], ctx) for s, n, (_, ctx) in zip(starts, sizes, step)])
    return {"in order": in_order, "shuffled": shuffled}


def time_layouts(layouts: dict[str, list[DecodeStep]], num_layers: int, repeats: int) -> dict[str, float]:
    """Seconds of one layer's decode attention summed over the steps, for each layout (same steps, same order)."""
    import torch
    from bench_kv_kernels import make_caches

    from executor_svc.native import loader

    ops = loader.ops()
    caches = make_caches("bf16", num_layers, NUM_BLOCKS, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(3)
    names = list(layouts)
    num_steps = len(layouts[names[0]])
    contexts = [[[ctx for _, ctx in step] for step in steps] for steps in layouts.values()]
    assert all(c == contexts[0] for c in contexts), "the layouts are of different steps"
    args = {}
    for name in names:
        for i, step in enumerate(layouts[name]):
            width = max(len(ids) for ids, _ in step)
            tables = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in step])  # [B, max_blocks] int64
            lens = torch.tensor([ctx for _, ctx in step])  # [B] int64
            args[name, i] = (tables, lens)
    queries = [
        torch.randn(len(layouts[names[0]][i]), NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
        for i in range(num_steps)
    ]
    best = {key: float("inf") for key in args}
    for _ in range(repeats):
        for i in range(num_steps):
            for name in names:
                tables, lens = args[name, i]
                start = time.perf_counter()
                for c in caches:
                    ops.paged_decode(queries[i], c.k, c.v, tables, lens, HEAD_DIM**-0.5, 0, 0.0, c.k_scale, c.v_scale)
                best[name, i] = min(best[name, i], time.perf_counter() - start)
    return {name: sum(best[name, i] for i in range(num_steps)) / num_layers for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkouts", default="", help="comma-separated checkouts whose schedulers make the tables")
    parser.add_argument("--kernel", action="store_true", help="time decode attention on the tables")
    parser.add_argument("--every", type=int, default=3, help="time every N-th decode step")
    parser.add_argument("--layers", type=int, default=4, help="layers of cache (4 x 36 MiB: well past the L3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dump", help=argparse.SUPPRESS)  # the subprocess of tables_of
    args = parser.parse_args()
    if args.dump:
        Path(args.dump).write_text(json.dumps(w_mixed_tables()))
        return
    with tempfile.TemporaryDirectory() as folder:
        results = (
            {c: tables_of(c, folder) for c in args.checkouts.split(",")} if args.checkouts else {"": w_mixed_tables()}
        )
    for result in results.values():
        print(f"tables of {result['scheduler']}")
        for run in RUNS:
            data = result["runs"][run]
            steps = data["steps"]
            decode_tables = [ids for step in steps for ids, _ in step]
            print(f"  {run}, at each sequence's end: {contiguity(data['tables'])}")
            print(f"  {run}, decode rows of {len(steps)} steps: {contiguity(decode_tables)}")
            print(f"  {run}, scheduler CPU: {data['scheduler_cpu_s'] * 1e3:.1f} ms")
    if not args.kernel:
        return
    print(f"bf16 decode attention, a layer, summed over 1 decode step in {args.every}, best of {args.repeats}:")
    for run in RUNS:
        layouts = {}
        for checkout, result in results.items():
            layouts[checkout or "this tree"] = result["runs"][run]["steps"][:: args.every]
        layouts.update(reference_layouts(next(iter(layouts.values()))))
        seconds = time_layouts(layouts, args.layers, args.repeats)
        steps = next(iter(layouts.values()))
        kv_bytes = sum(ctx for step in steps for _, ctx in step) * 2 * NUM_KV_HEADS * HEAD_DIM * 2
        base = next(iter(seconds.values()))
        for name, s in seconds.items():
            print(f"  {run:<9} {name:<30} {s * 1e3:8.2f} ms  {kv_bytes / s / 1e9:5.1f} GB/s  {base / s:.2f}x")


if __name__ == "__main__":
    main()
