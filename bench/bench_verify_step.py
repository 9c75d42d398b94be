"""What a speculative step costs in the executor: a plain decode step vs one verifying K drafts, and the draft model.

Usage:
    python bench/bench_verify_step.py [--model DIR] [--draft-model DIR] [--dtype bfloat16]
        [--batches 1,8] [--context 640] [--ks 1,2,4,8] [--steps 20]

For each batch size, sequences of ``context`` tokens (all but the last already
cached, as the plan says; no long prefill) decode ``--steps`` steps of each
kind, the kinds interleaved step by step so that drift hits all alike:
- ``plain``: one token per sequence;
- ``verify K``: one token and K plan drafts per sequence (random, so rejected:
  the step computes 1 + K decode rows and rolls back, as a step that accepts
  them costs the same);
- ``draft K`` (with ``--draft-model``): the draft model proposes K tokens
  (K passes), then the target verifies them; its passes are timed apart.
Prints the median step time of each kind and its ratio to plain. A step of
1 + K rows that costs r times a plain one pays when it gains more than r - 1
tokens beyond the plain step's one. Runs in this process (no server): warm-up
first, a bounded number of steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from executor_svc.loading.model_cache import resolve_model
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from pagoda.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class Decoder:
    """Sequences held by the runner, each with its own blocks, decoding one kind of step at a time."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, room: int, first_seq_id: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        blocks_per_seq = -(-(context + room) // self.block_size)
        self.seq_ids = list(range(first_seq_id, first_seq_id + batch))
        rng = random.Random(first_seq_id)
        vocab = runner.config.vocab_size
        new = []
        for i, seq_id in enumerate(self.seq_ids):
            tokens = tuple(rng.randrange(10, vocab) for _ in range(context))
            blocks = tuple(range((first_seq_id + i) * blocks_per_seq, (first_seq_id + i + 1) * blocks_per_seq))
            new.append(t.NewSequence(seq_id, "bench", tokens, context, GREEDY, blocks, context - 1, 1))
        self.blocks = {seq_id: list(new[i].block_ids) for i, seq_id in enumerate(self.seq_ids)}
        self._step_id = first_seq_id * 100_000
        self._run(t.StepPlan(self._next_step(), new_seqs=tuple(new)))

    def _next_step(self) -> int:
        self._step_id += 1
        return self._step_id

    def _run(self, plan: t.StepPlan) -> t.StepResult:
        result = self.runner.execute(plan)
        assert not result.errors, result.errors
        return result

    def step(self, num_plan_drafts: int, num_model_drafts: int) -> tuple[float, float]:
        """(step seconds, draft-model seconds) of one step of the kind given."""
        rng, vocab = random.Random(self._step_id), self.runner.config.vocab_size
        entries = []
        for seq_id in self.seq_ids:
            state = self.runner._seqs[seq_id]
            # The blocks a rollback cut come back (the scheduler's rule), enough for the drafts.
            num_blocks = -(-(len(state.token_ids) + num_plan_drafts + num_model_drafts) // self.block_size)
            new_block_ids = tuple(self.blocks[seq_id][len(state.block_table) : num_blocks])
            drafts = tuple(rng.randrange(10, vocab) for _ in range(num_plan_drafts))
            entries.append(t.ScheduledSequence(seq_id, 1, new_block_ids, drafts, num_model_drafts))
        start = time.perf_counter()
        result = self._run(t.StepPlan(self._next_step(), scheduled_seqs=tuple(entries)))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, result.timings.draft_ns / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    kinds = [("plain", 0, 0)] + [(f"verify {k}", k, 0) for k in ks]
    if args.draft_model:
        kinds += [(f"draft {k}", 0, k) for k in ks]
    from pagoda.runtime.flags import parse_size

    runner = ModelRunner(
        resolve_model(args.model),
        dtype=args.dtype,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory),
        draft_model_path=resolve_model(args.draft_model) if args.draft_model else None,
    )
    runner.warmup()
    room = 2 * args.steps * (1 + max(ks)) + 2 * max(ks) + 4
    print(
        f"model {runner.info.model_name} {args.dtype}, draft {runner.info.draft_model or 'none'}, "
        f"context {args.context}, {args.steps} steps of each kind"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        decoders = {
            name: Decoder(runner, batch, args.context, room, 1 + i * batch) for i, (name, _, _) in enumerate(kinds)
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in kinds}
        for step in range(args.steps + 2):
            for name, num_plan, num_model in kinds:
                measured = decoders[name].step(num_plan, num_model)
                if step >= 2:  # warm: the draft model's first pass catches up on the context
                    times[name].append(measured)
        plain_s = statistics.median(s for s, _ in times["plain"])
        print(f"batch {batch}:")
        for name, _, _ in kinds:
            step_s = statistics.median(s for s, _ in times[name])
            draft_s = statistics.median(d for _, d in times[name])
            extra = f", draft model {draft_s * 1e3:.1f} ms" if draft_s else ""
            print(f"  {name:>9}: {step_s * 1e3:7.2f} ms  {step_s / plain_s:5.2f}x plain{extra}")
        runner.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
