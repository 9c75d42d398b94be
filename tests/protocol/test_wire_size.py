"""Bytes on the wire: a steady-decode plan costs a few bytes per sequence,
whatever the context length (delta plans, no per-token slot lists)."""

from __future__ import annotations

import pytest

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import SeqOutput, StepResult
from pagoda.step_pb import plan_to_pb
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence

NUM_SEQS = 64


def _steady_decode_plan_sizes(context_len: int, num_steps: int = 40, compact: bool = False) -> list[int]:
    """Plan sizes (bytes) of `num_steps` decode steps after every prompt is in."""
    block_size = 16
    blocks_per_seq = (context_len + num_steps + 8) // block_size + 2
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=NUM_SEQS * blocks_per_seq,
            block_size=block_size,
            max_num_seqs=NUM_SEQS,
            max_num_batched_tokens=NUM_SEQS * context_len,
            max_model_len=context_len + 1000,
        )
    )
    for i in range(NUM_SEQS):
        prompt = [(i * 7 + j) % 1000 + 3 for j in range(context_len)]
        sched.add(
            SchedulerSequence(
                i + 1,
                f"r{i}",
                prompt,
                SamplingParams(temperature=0.0),
                StoppingCriteria(max_tokens=500, ignore_eos=True),
            )
        )
    sizes = []
    for step in range(num_steps + 2):
        plan = sched.schedule()
        if step >= 2:  # the prompts went out whole in the first plan
            assert not plan.new_seqs
            sizes.append(plan_to_pb(plan, compact=compact).ByteSize())
        outputs = tuple(SeqOutput(s.seq_id, (5,)) for s in plan.new_seqs + plan.scheduled_seqs)
        sched.update(StepResult(plan.step_id, "inc", outputs))
    return sizes


@pytest.mark.parametrize("context_len", [16, 512, 2048])
def test_decode_plan_is_a_few_bytes_per_sequence(context_len):
    sizes = _steady_decode_plan_sizes(context_len)
    # Most steps append no block; every 16th token one block per sequence.
    assert max(sizes) <= 200 + 12 * NUM_SEQS
    assert sorted(sizes)[len(sizes) // 2] <= 100 + 8 * NUM_SEQS


def test_a_compact_decode_plan_is_two_columns():
    whole = _steady_decode_plan_sizes(512)
    compact = _steady_decode_plan_sizes(512, compact=True)
    # A decode entry is its id and token count, packed (~2-3 bytes), instead of a message (~6-8 bytes).
    assert sorted(compact)[len(compact) // 2] <= 20 + 3 * NUM_SEQS
    assert sum(compact) < 0.6 * sum(whole)


def test_plan_size_does_not_grow_with_context():
    short = _steady_decode_plan_sizes(16)
    long = _steady_decode_plan_sizes(2048)
    assert abs(sorted(long)[len(long) // 2] - sorted(short)[len(short) // 2]) <= NUM_SEQS
