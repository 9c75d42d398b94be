"""Fit the simulated executor's step-time model to measured model steps.

Measures real steps of a ModelRunner (the default model, SmolLM2-135M, unless
--model) on this machine over a grid of decode batches x contexts, prompt
chunks x cached prefixes, and a few mixed steps, with one intra-op thread; each
point is the median CPU time of --repeats steps in each of --passes passes over
the grid (CPU time, not wall time: the machine may be shared, and CPU time does
not count the waits for a core), so the model is one executor on one core.
Then fits `executor_svc.simulate.cost.StepCost` by least squares on the
relative error (every constant >= 0: the best of the fits over each subset of
the features), prints the constants, each point's error, and the median and
worst error, and writes the measurements and the fit as JSON.

    .venv/bin/python bench/fit_step_cost.py --out bench/data/step_cost_smollm2_bf16.json
    .venv/bin/python bench/fit_step_cost.py --refit bench/data/step_cost_smollm2_bf16.json   # no measuring
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Sequence

import numpy as np

from executor_svc.simulate.cost import StepCost, StepFeatures

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (128, 512, 2048)
PREFILL_CHUNKS = (32, 128, 512, 2048)
PREFILL_CACHED = (0, 1024)
MIXED = ((128, 8), (128, 32), (512, 8), (512, 32))  # (prompt chunk, decode batch at context 512)
MAX_KV_TOKENS = 65536  # batch x context of the largest decode point
FEATURES = ("prefill_tokens", "prefill_pairs", "decode_seqs", "context_tokens")


def measure(model: str, dtype: str, repeats: int, passes: int) -> list[dict]:
    """One row per grid point: its features, and the CPU time and wall time of its steps.

    The machine is shared, so wall time says as much about the neighbours as
    about the model; the CPU time the process spent in the step does not count
    the time it waited for a core. With one intra-op thread (see main) that CPU
    time is the step's time on one dedicated core, and it is what is fitted
    (`step_s`: the median over every repeat and pass); the fastest wall time is
    kept next to it (`wall_min_s`).
    """
    from executor_svc.runner.model_runner import ModelRunner

    runner = ModelRunner(model, dtype=dtype, kv_cache_memory_bytes=2 * 2**30, max_model_len=4096)
    runner.warmup()
    plans = grid_plans(runner.block_size, runner.info.num_kv_blocks, repeats)
    cpu: dict[str, list[float]] = {name: [] for name, _ in plans}
    wall: dict[str, list[float]] = {name: [] for name, _ in plans}
    for number in range(passes):
        print(f"pass {number + 1} of {passes}", flush=True)
        for name, steps in plans:
            runner.reset()
            for k, (plan, _) in enumerate(steps):
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                out = runner.execute(plan)
                if k > 0:  # the first step registers the sequences
                    cpu[name].append(time.process_time() - cpu_start)
                    wall[name].append(time.perf_counter() - wall_start)
                assert not out.errors, out.errors[0]
    rows = []
    for name, steps in plans:
        features = StepFeatures.of(steps[len(steps) // 2][1])
        row = {"point": name, **vars(features), "step_s": statistics.median(cpu[name]), "wall_min_s": min(wall[name])}
        rows.append(row)
    return rows


def grid_plans(block_size: int, num_kv_blocks: int, repeats: int) -> list[tuple[str, list]]:
    """(point name, [(plan, [(num_computed, num_scheduled), ...]) per step]); the first step of each is a warm-up."""
    from pagoda import step as t
    from pagoda.params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    blocks = iter(itertools.count())

    def new(seq_id: int, num_tokens: int, num_computed: int, num_scheduled: int, extra: int) -> t.NewSequence:
        num_blocks = -(-(num_tokens + extra) // block_size)
        table = tuple(next(blocks) % num_kv_blocks for _ in range(num_blocks))
        tokens = tuple((7 * seq_id + j) % 1000 + 10 for j in range(num_tokens))
        return t.NewSequence(seq_id, f"s{seq_id}", tokens, num_tokens, greedy, table, num_computed, num_scheduled)

    def decode_steps(batch: int, context: int, first_id: int, chunk: int = 0) -> list:
        """A first step that registers `batch` decoders (and a chunk), then decode steps."""
        seqs = [new(first_id + i, context, context - 1, 1, repeats + 2) for i in range(batch)]
        steps = []
        for k in range(repeats + 1):
            prefill = (new(first_id + batch + k, chunk, 0, chunk, 1),) if chunk else ()
            if k == 0:
                plan = t.StepPlan(k, new_seqs=tuple(seqs) + prefill)
            else:
                scheduled = tuple(t.ScheduledSequence(s.seq_id, 1) for s in seqs)
                plan = t.StepPlan(k, new_seqs=prefill, scheduled_seqs=scheduled)
            shape = [(context - 1 + k, 1)] * batch + ([(0, chunk)] if chunk else [])
            steps.append((plan, shape))
        return steps

    plans = []
    for context in DECODE_CONTEXTS:
        for batch in (b for b in DECODE_BATCHES if b * context <= MAX_KV_TOKENS):
            plans.append((f"decode b={batch} ctx={context}", decode_steps(batch, context, 0)))
    for chunk, cached in itertools.product(PREFILL_CHUNKS, PREFILL_CACHED):
        steps = [
            (t.StepPlan(k, new_seqs=(new(k, cached + chunk, cached, chunk, 1),)), [(cached, chunk)])
            for k in range(repeats + 1)
        ]
        plans.append((f"prefill n={chunk} cached={cached}", steps))
    for chunk, batch in MIXED:
        plans.append((f"mixed n={chunk} + b={batch} ctx=512", decode_steps(batch, 512, 0, chunk)))
    return plans


def fit(rows: Sequence[dict]) -> StepCost:
    """Non-negative least squares on the relative error: the best fit over each subset of the features."""
    x = np.array([StepFeatures(*(r[f] for f in FEATURES)).row() for r in rows], dtype=np.float64)
    y = np.array([r["step_s"] for r in rows], dtype=np.float64)
    xw, yw = x / y[:, None], np.ones_like(y)  # each row divided by its time: relative residuals
    best, best_err = None, np.inf
    for mask in itertools.product((True, False), repeat=x.shape[1] - 1):
        cols = [0] + [i + 1 for i, keep in enumerate(mask) if keep]
        coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(x.shape[1])
        full[cols] = coef
        err = float(np.sum((xw @ full - yw) ** 2))
        if err < best_err:
            best, best_err = full, err
    assert best is not None, "no non-negative fit"
    return StepCost.from_coefficients(best)


def report(rows: Sequence[dict], cost: StepCost) -> dict:
    """Prints each point's measured and modelled time; returns the error summary."""
    errors = []
    print(f"\n{'point':<28} {'measured ms':>12} {'model ms':>9} {'error':>7}")
    for r in rows:
        model_s = cost.seconds(StepFeatures(*(r[f] for f in FEATURES)))
        errors.append(model_s / r["step_s"] - 1)
        print(f"{r['point']:<28} {r['step_s'] * 1e3:>12.2f} {model_s * 1e3:>9.2f} {errors[-1] * 100:>6.1f}%")
    summary = {
        "median_abs_error": statistics.median(abs(e) for e in errors),
        "max_abs_error": max(abs(e) for e in errors),
    }
    names = ("base_s", "per_prefill_token_s", "per_prefill_pair_s", "per_decode_seq_s", "per_context_token_s")
    print("\nStepCost(" + ", ".join(f"{n}={c:.4g}" for n, c in zip(names, cost.coefficients())) + ")")
    print(f"relative error: median {summary['median_abs_error'] * 100:.1f}%, max {summary['max_abs_error'] * 100:.1f}%")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5, help="steps per point and pass")
    parser.add_argument("--passes", type=int, default=2, help="passes over the grid")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU time is fitted: keep 1)")
    parser.add_argument("--out", help="write the measurements and the fit here (JSON)")
    parser.add_argument("--refit", help="fit the measurements of this JSON file instead of measuring")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.refit:
        with open(args.refit) as f:
            data = json.load(f)
    else:
        from executor_svc.loading.model_cache import resolve_model

        model = resolve_model(args.model or "default")
        data = {"model": str(model), "dtype": args.dtype, "threads": args.threads}
        data |= {"repeats": args.repeats, "passes": args.passes}
        data["rows"] = measure(model, args.dtype, args.repeats, args.passes)
    cost = fit(data["rows"])
    data["fit"] = {"coefficients": list(cost.coefficients()), **report(data["rows"], cost)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
