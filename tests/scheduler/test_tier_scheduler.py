"""The scheduler and an executor's offload tier: saves, loads, deltas, failed loads, swaps, the cost model."""

from __future__ import annotations

import random

import pytest
from scheduler.scheduler_fakes import Engine, FakeExecutor, FakeTier, check_invariants, reference_output

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import BlockLoad, BlockSave, SeqError, SeqOutput, StepPlan, StepResult, StepTimings
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence, SequenceStatus
from scheduler_svc.kv.kv_cache_manager import hash_block_tokens
from scheduler_svc.kv.tier_index import TierCostModel, TierIndex

BS = 4


def make_sched(num_blocks=16, tier_hashes=(), **kwargs) -> Scheduler:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BS, kv_offload=True, **kwargs)
    return Scheduler(config, clock=lambda: 0.0, tier_hashes=tier_hashes)


def make_seq(seq_id, prompt, max_tokens=4) -> SchedulerSequence:
    return SchedulerSequence(
        seq_id, f"req-{seq_id}", list(prompt), SamplingParams(), StoppingCriteria(max_tokens=max_tokens)
    )


def block_hashes(tokens, num_blocks) -> list[int]:
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tuple(tokens[i * BS : (i + 1) * BS]), "")
        hashes.append(parent)
    return hashes


def result(plan: StepPlan, tokens=None, errors=(), **fields) -> StepResult:
    outputs = tuple(SeqOutput(seq_id, (token,)) for seq_id, token in (tokens or {}).items())
    return StepResult(plan.step_id, "inc", outputs, tuple(errors), **fields)


PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens


def test_blocks_the_tier_holds_are_loaded_into_fresh_blocks_after_the_device_hits():
    hashes = block_hashes(PROMPT, 4)
    s = make_sched(tier_hashes=hashes[1:3])  # blocks 1 and 2 only: block 0 is not there, so nothing loads
    s.add(make_seq(1, PROMPT))
    (new,) = s.schedule().new_seqs
    assert new.loads == () and new.num_computed_tokens == 0

    s = make_sched(tier_hashes=hashes)
    s.add(make_seq(1, PROMPT))
    (new,) = s.schedule().new_seqs
    assert new.loads == tuple(BlockLoad(h, b) for h, b in zip(hashes, new.block_ids))
    assert new.num_computed_tokens == 16 and new.num_scheduled_tokens == 2 and len(new.block_ids) == 5
    assert s.counters.num_offload_hit_tokens == 16 and s.kv.prefix_cache_hits == 16 and s.counters.num_swaps == 0
    assert s.get(1).num_cached_tokens == 16 and s.get(1).num_offloaded_tokens == 16


def test_a_prompt_of_whole_blocks_still_computes_its_last_token():
    prompt = list(range(16))
    s = make_sched(tier_hashes=block_hashes(prompt, 4))
    s.add(make_seq(1, prompt))
    (new,) = s.schedule().new_seqs
    assert len(new.loads) == 3 and new.num_computed_tokens == 12 and new.num_scheduled_tokens == 4


def test_device_hits_come_first_then_the_tier_continues_the_prefix():
    hashes = block_hashes(PROMPT, 4)
    s = make_sched()
    s.add(make_seq(1, PROMPT[:9], max_tokens=1))  # computes blocks 0 and 1 on the device
    plan = s.schedule()
    (update,) = s.update(result(plan, {1: 5}))
    assert update.finished
    s.tier._hashes.update(hashes[2:])  # as if another sequence's blocks 2, 3 were in the tier
    s.add(make_seq(2, PROMPT))
    (new,) = s.schedule().new_seqs
    assert new.block_ids[:2] == plan.new_seqs[0].block_ids[:2]  # device hits
    assert new.loads == (BlockLoad(hashes[2], new.block_ids[2]), BlockLoad(hashes[3], new.block_ids[3]))
    assert s.get(2).num_cached_tokens == 16 and s.get(2).num_offloaded_tokens == 8


def test_full_computed_blocks_are_saved_in_the_next_plan_and_count_as_held():
    s = make_sched()
    s.add(make_seq(1, PROMPT))
    plan = s.schedule()
    assert plan.saves == ()
    s.update(result(plan, {1: 7}))
    hashes = block_hashes(PROMPT, 4)
    block_ids = plan.new_seqs[0].block_ids
    expected = tuple(BlockSave(block_ids[i], hashes[i], tuple(PROMPT[i * BS : (i + 1) * BS])) for i in range(4))
    assert s.schedule().saves == expected
    assert all(h in s.tier for h in hashes) and s.schedule().saves == ()


def test_a_plan_with_only_saves_is_sent_and_uses_a_step_id():
    s = make_sched()
    s.add(make_seq(1, PROMPT, max_tokens=1))
    plan = s.schedule()
    s.update(result(plan, {1: 7}))  # finished: its blocks are saved in a plan with no work
    plan = s.schedule()
    assert not plan.has_work and len(plan.saves) == 4 and plan.dropped_seq_ids == (1,)
    empty = s.schedule()
    assert not empty.has_work and not empty.saves and empty.step_id == plan.step_id + 1


def test_blocks_loaded_from_the_tier_are_not_saved_again():
    hashes = block_hashes(PROMPT, 4)
    s = make_sched(tier_hashes=hashes)
    s.add(make_seq(1, PROMPT))
    plan = s.schedule()
    s.update(result(plan, {1: 7}))
    assert s.schedule().saves == ()


def test_an_evicted_block_the_tier_lacks_is_saved_before_it_is_reused():
    s = make_sched(num_blocks=6)
    s.add(make_seq(1, PROMPT, max_tokens=1))
    plan = s.schedule()
    s.update(result(plan, {1: 7}))
    saves = s.schedule().saves
    # The tier dropped every write (a full queue): it reports them as not held.
    s.update(result(plan, tier_removed=tuple(save.block_hash for save in saves)))
    assert not any(save.block_hash in s.tier for save in saves)
    s.add(make_seq(2, range(200, 218), max_tokens=1))  # 5 blocks: the 2 never cached, then 3 cached ones
    plan = s.schedule()
    reused = set(plan.new_seqs[0].block_ids)
    assert plan.saves == tuple(save for save in reversed(saves) if save.block_id in reused)
    assert len(plan.saves) == 3 and all(save.block_hash in s.tier for save in plan.saves)


def test_deltas_and_a_reset_update_what_the_scheduler_believes():
    s = make_sched(tier_hashes=(1, 2, 3))
    s.update(StepResult(0, tier_added=(4,), tier_removed=(1,)))
    assert {h for h in (1, 2, 3, 4) if h in s.tier} == {2, 3, 4}
    s.update(StepResult(1, tier_added=(9,), tier_reset=True))
    assert {h for h in (1, 2, 3, 4, 9) if h in s.tier} == {9}


def test_a_failed_load_forgets_the_hashes_and_recomputes_the_sequence():
    hashes = block_hashes(PROMPT, 4)
    s = make_sched(tier_hashes=hashes)
    s.add(make_seq(1, PROMPT))
    plan = s.schedule()
    seq = s.get(1)
    second = s.schedule()  # planned before the result: seq 1's next token
    assert [sched.seq_id for sched in second.scheduled_seqs] == [1]
    errors = (SeqError(1, "tier miss", (hashes[2], hashes[3])),)
    assert s.update(result(plan, errors=errors)) == []
    assert seq.status is SequenceStatus.WAITING and seq.num_pending_tokens == 1
    assert hashes[2] not in s.tier and hashes[0] in s.tier and s.kv.num_free_blocks == 16
    assert s.schedule().new_seqs == ()  # it waits for the plan in flight, which cannot give it a token
    # That plan's error is about the failed admission: void, it does not finish the sequence.
    assert s.update(result(second, errors=(SeqError(1, "unknown sequence 1"),))) == []
    assert seq.num_pending_tokens == 0 and seq.status is SequenceStatus.WAITING
    again = s.schedule()
    (new,) = again.new_seqs
    assert new.loads == (BlockLoad(hashes[0], new.block_ids[0]), BlockLoad(hashes[1], new.block_ids[1]))
    assert seq.num_cached_tokens == 8 and seq.num_offloaded_tokens == 8  # usage counts what was really loaded
    check_invariants(s)
    (update,) = s.update(result(again, {1: 3}))
    assert update.new_token_ids == (3,) and seq.status is SequenceStatus.RUNNING


def test_loads_stop_when_the_measured_cost_says_recompute_is_cheaper():
    cost = TierCostModel(block_size=16)
    assert cost.loads_pay  # nothing measured yet
    cost.observe(4, StepResult(0, timings=StepTimings(load_ns=4_000_000), num_scheduled_tokens=1))
    cost.observe(0, StepResult(1, timings=StepTimings(forward_ns=512_000_000), num_scheduled_tokens=512))
    assert cost.load_s_per_block == pytest.approx(0.001) and cost.compute_s_per_token == pytest.approx(0.001)
    assert cost.loads_pay  # 1 ms to load a block vs 16 ms to compute it
    for _ in range(30):  # the disk got slow: 40 ms per block
        cost.observe(1, StepResult(2, timings=StepTimings(load_ns=40_000_000)))
    assert not cost.loads_pay
    s = make_sched(tier_hashes=block_hashes(PROMPT, 4))
    s.tier.cost = cost
    s.add(make_seq(1, PROMPT))
    assert s.schedule().new_seqs[0].loads == ()


def test_decode_steps_do_not_count_as_the_prefill_cost():
    cost = TierCostModel(block_size=16)
    cost.observe(0, StepResult(0, timings=StepTimings(forward_ns=100_000_000), num_scheduled_tokens=8))
    assert cost.compute_s_per_token is None


def test_tier_index_sends_each_save_once_and_keeps_unsent_ones_across_a_reset():
    index = TierIndex(BS, hashes=(1,))
    index.queue_save(0, 1, (1, 2, 3, 4))  # held already
    index.queue_save(1, 2, (5, 6, 7, 8))
    index.queue_save(1, 2, (5, 6, 7, 8))
    index.apply(StepResult(0, tier_added=(7,), tier_reset=True))
    assert 2 in index and 7 in index and 1 not in index
    assert index.take_saves() == (BlockSave(1, 2, (5, 6, 7, 8)),) and index.take_saves() == ()


def _run(num_blocks, tier, prompts, max_tokens, seed=0):
    config = SchedulerConfig(
        num_blocks=num_blocks, block_size=BS, kv_offload=tier is not None, max_num_batched_tokens=32, max_num_seqs=16
    )
    scheduler = Scheduler(config, clock=lambda: 0.0)
    engine = Engine(scheduler, FakeExecutor(num_blocks, BS, tier=tier))
    for i, prompt in enumerate(prompts):
        scheduler.add(make_seq(i, prompt, max_tokens))
    engine.run()
    check_invariants(scheduler)
    return engine, scheduler


def test_an_over_subscribed_run_swaps_instead_of_recomputing_and_changes_no_token():
    rng = random.Random(3)
    shared = [rng.randrange(50) for _ in range(12)]
    prompts = [shared + [rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(20)]
    expected = {i: reference_output(p, 12) for i, p in enumerate(prompts)}
    plain, _ = _run(200, None, prompts, 12)
    assert dict(plain.outputs) == expected
    tier = FakeTier()
    swapped, scheduler = _run(14, tier, prompts, 12)
    assert dict(swapped.outputs) == expected
    assert scheduler.counters.num_preemptions > 0 and scheduler.counters.num_swaps > 0 and tier.num_loads > 0
    recomputed, baseline = _run(14, None, prompts, 12)
    assert dict(recomputed.outputs) == expected
    assert sum(p.num_scheduled_tokens for p in swapped.plans) < sum(p.num_scheduled_tokens for p in recomputed.plans)


@pytest.mark.parametrize("drop_every", [2, 3])
def test_dropped_writes_and_bad_blocks_never_change_a_token(drop_every):
    rng = random.Random(drop_every)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(5, 30))] for _ in range(16)]
    expected = {i: reference_output(p, 10) for i, p in enumerate(prompts)}

    class LossyTier(FakeTier):
        def take_deltas(self):  # and every fifth stored block rots without the scheduler knowing
            for block_hash in list(self.blocks)[::5]:
                self.remove(block_hash)
            return super().take_deltas()

    tier = LossyTier(capacity=20, drop_every=drop_every)
    engine, scheduler = _run(12, tier, prompts, 10)
    assert dict(engine.outputs) == expected
    assert scheduler.tier.num_failed_loads > 0 and scheduler.counters.num_preemptions > 0


def _ready_handle(address: str, scheduler: Scheduler):
    from scheduler_svc.fleet.executor_handle import ExecutorHandle, ExecutorState

    handle = ExecutorHandle(address, listener=None, make_config=None, step_timeout_s=1.0)
    handle.state, handle.scheduler = ExecutorState.READY, scheduler
    return handle


def test_the_router_prefers_the_executor_whose_tier_holds_the_longest_prefix():
    from scheduler_svc.fleet.router import choose_executor

    hashes = block_hashes(PROMPT, 4)
    handles = [
        _ready_handle("a", make_sched()),
        _ready_handle("b", make_sched(tier_hashes=hashes[:2])),
        _ready_handle("c", make_sched(tier_hashes=hashes)),
    ]
    assert choose_executor(handles, PROMPT) == (handles[2], 16)
    assert choose_executor(handles[:2], PROMPT) == (handles[1], 8)
    assert choose_executor(handles, list(range(500, 520)))[1] == 0
