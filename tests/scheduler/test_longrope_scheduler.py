"""LongRoPE: the factor set of each sequence, chosen by the scheduler, in its plans and its block hashes.

A sequence within rope_switch_len tokens runs on the short factors, a longer
one on the long factors, and one that grows past the switch is recomputed on
the long factors (transformers' rule). Blocks of the two sets never meet: not
in the prefix cache, not in the offload tier. The fake executor's "KV" and
tokens depend on the set, so a block of the wrong set fails its slot check
and the outputs would differ from the reference.
"""

from __future__ import annotations

import random

import pytest
from scheduler.scheduler_fakes import Engine, FakeExecutor, FakeTier, check_invariants, copy_model, reference_output

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import NewSequence, ScheduledSequence, SeqOutput, StepPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.kv.kv_cache_manager import hash_block_tokens

BS = 4
SWITCH = 12


def make_sched(num_blocks=32, rope_switch_len=SWITCH, **kwargs) -> Scheduler:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BS, rope_switch_len=rope_switch_len, **kwargs)
    return Scheduler(config, clock=lambda: 0.0)


def make_seq(seq_id, prompt, max_tokens=4) -> SchedulerSequence:
    stopping = StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
    return SchedulerSequence(seq_id, f"req-{seq_id}", list(prompt), SamplingParams(), stopping)


def result(plan: StepPlan, tokens: dict[int, int] | None = None) -> StepResult:
    outputs = tuple(SeqOutput(seq_id, (token,)) for seq_id, token in (tokens or {}).items())
    return StepResult(plan.step_id, "inc", outputs)


def test_the_set_follows_the_length_at_admission():
    s = make_sched()
    s.add(make_seq(1, range(SWITCH)))  # exactly the switch: transformers still uses the short factors
    s.add(make_seq(2, range(100, 100 + SWITCH + 1)))
    first, second = s.schedule().new_seqs
    assert (first.long_rope, second.long_rope) == (False, True)
    # Without a switch (a model with one set, or served within its original length): never long.
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=BS), clock=lambda: 0.0)
    s.add(make_seq(1, range(40)))
    assert not s.schedule().new_seqs[0].long_rope


def test_a_sequence_crossing_the_switch_is_recomputed_on_the_long_factors():
    """10 prompt tokens: positions 10 and 11 decode on the short factors; position 12 (the 13th token) would
    be past the switch, so the sequence is dropped and sent again whole on the long factors, with no hit on
    its own short blocks."""
    s = make_sched()
    s.add(make_seq(1, range(10), max_tokens=6))
    plan = s.schedule()
    assert plan.new_seqs[0].num_scheduled_tokens == 10 and not plan.new_seqs[0].long_rope
    s.update(result(plan, {1: 50}))
    for token in (51, 52):  # positions 10 and 11
        plan = s.schedule()
        assert plan.scheduled_seqs == (ScheduledSequence(1, 1),)
        s.update(result(plan, {1: token}))
    plan = s.schedule()
    assert plan.dropped_seq_ids == (1,) and plan.scheduled_seqs == ()
    (new,) = plan.new_seqs
    tokens = (*range(10), 50, 51, 52)
    assert new == NewSequence(
        1, "req-1", tokens, 10, SamplingParams(), new.block_ids, 0, 13, long_rope=True
    )  # fmt: skip
    assert len(new.block_ids) == 4 and s.counters.num_rope_restarts == 1 and s.counters.num_preemptions == 0
    # Its short blocks stayed cached for short sequences (of 12 tokens: the last one is computed, not a hit).
    assert s.peek_prefix_hit_tokens(tokens[:12]) == 8
    assert s.peek_prefix_hit_tokens(tokens) == 0  # 13 tokens: long, and no long block of them yet
    s.update(result(plan, {1: 53}))
    assert s.peek_prefix_hit_tokens(tokens) == 12  # now the long ones are cached
    plan = s.schedule()
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1),) and not plan.new_seqs  # and on, long


def test_blocks_of_the_two_sets_are_never_shared():
    """Equal tokens, other sets: no prefix hit; the same set: hits. The hashes differ from the first block."""
    s = make_sched()
    long_prompt = list(range(16))
    s.add(make_seq(1, long_prompt))
    s.update(result(s.schedule(), {1: 3}))
    assert s.peek_prefix_hit_tokens(long_prompt + [3]) == 16  # long, as seq 1
    assert s.peek_prefix_hit_tokens(long_prompt[:9]) == 0  # short
    s.add(make_seq(2, long_prompt[:9]))
    (new,) = s.schedule().new_seqs
    assert (new.long_rope, new.num_computed_tokens) == (False, 0)
    for salt in ("", "tenant"):  # a first block's hash names its set (its children's chain from it)
        assert hash_block_tokens(None, (1, 2, 3, 4), salt, True) != hash_block_tokens(None, (1, 2, 3, 4), salt)


def test_the_offload_tier_serves_blocks_of_the_same_set_only():
    """Blocks a short sequence saved: a short one with that prefix loads them, a long one recomputes."""
    s = Scheduler(
        SchedulerConfig(num_blocks=32, block_size=BS, rope_switch_len=SWITCH, kv_offload=True), clock=lambda: 0.0
    )
    prompt = list(range(200, 211))  # 11 tokens: short, two full blocks
    s.add(make_seq(1, prompt, max_tokens=1))
    s.update(result(s.schedule(), {1: 5}))
    saved = [save.block_hash for save in s.schedule().saves]
    assert len(saved) == 2

    def admit(tokens):
        fresh = Scheduler(s.config, clock=lambda: 0.0, tier_hashes=saved)
        fresh.add(make_seq(9, tokens))
        return fresh.schedule().new_seqs[0]

    short = admit(prompt + [5])
    assert not short.long_rope and [load.block_hash for load in short.loads] == saved
    long = admit(prompt + [5, 6, 7])
    assert long.long_rope and long.loads == () and long.num_computed_tokens == 0


def test_drafts_of_a_short_sequence_stop_at_the_switch():
    """n-gram drafts (8 at most, 9 found: the prompt repeats 9 tokens) of a short sequence verify positions
    within the switch (24) only: 19 known tokens draft 5, 23 draft 1, 24 none; 25 restart on the long factors,
    where 8 are drafted again."""
    pattern = list(range(1, 10))
    for num_known, num_drafts in ((19, 5), (23, 1), (24, 0), (25, None), (30, 8)):
        s = make_sched(rope_switch_len=24, speculative="ngram", num_speculative_tokens=8)
        known = (pattern * 4)[:num_known]
        s.add(make_seq(1, known[:-1], max_tokens=40))
        plan = s.schedule()
        s.update(result(plan, {1: known[-1]}))  # the prompt computed, its first token known
        plan = s.schedule()
        if num_drafts is None:
            assert plan.new_seqs[0].long_rope and plan.dropped_seq_ids == (1,)
            continue
        (entry,) = plan.scheduled_seqs
        assert (entry.num_scheduled_tokens, len(entry.draft_token_ids)) == (1, num_drafts), num_known


def _workload(seed: int, num_seqs: int = 14) -> list[tuple[list[int], int]]:
    """Prompts below, at and past the switch, some sharing prefixes; max tokens that cross it or not."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 7) for _ in range(10)]
    work = []
    for _ in range(num_seqs):
        length = rng.randrange(1, 20)
        prefix = shared[: rng.randrange(0, 10)]
        prompt = (prefix + [rng.randrange(1, 7) for _ in range(length)])[: max(length, 1)]
        work.append((prompt, rng.randrange(1, 16)))
    return work


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("variant", ["plain", "ngram", "draft", "tier"])
def test_random_workloads_give_transformers_tokens(seed, variant):
    """Overlapped plans, chunked prefills, preemption in a small pool, prefix sharing, drafts or an offload
    tier: every sequence's tokens are the reference's (each on the set of its prefix's length), every slot
    read holds its own set's KV, and the block accounting stays exact."""
    speculative = {"ngram": "ngram", "draft": "draft"}.get(variant, "off")
    tier = FakeTier(capacity=24) if variant == "tier" else None
    config = SchedulerConfig(
        num_blocks=14,
        block_size=BS,
        max_num_batched_tokens=10,
        max_num_seqs=6,
        rope_switch_len=SWITCH,
        speculative=speculative,
        speculative_adaptive=False,
        kv_offload=tier is not None,
    )
    scheduler = Scheduler(config, clock=lambda: 0.0)
    executor = FakeExecutor(config.num_blocks, BS, model=copy_model, tier=tier, rope_switch_len=SWITCH)
    engine = Engine(scheduler, executor)
    work = _workload(seed)
    for seq_id, (prompt, max_tokens) in enumerate(work):
        scheduler.add(make_seq(seq_id, prompt, max_tokens))
    for _ in range(5000):
        if not scheduler.has_unfinished() and not engine.inflight:
            break
        engine.step()
        check_invariants(scheduler)
    for seq_id, (prompt, max_tokens) in enumerate(work):
        expected = reference_output(prompt, max_tokens, model=copy_model, rope_switch_len=SWITCH)
        assert engine.outputs[seq_id] == expected, seq_id
    crossing = sum(1 for prompt, max_tokens in work if len(prompt) <= SWITCH < len(prompt) + max_tokens - 1)
    assert scheduler.counters.num_rope_restarts >= crossing > 0
