"""Scheduler: exact plans for chunking, preemption, priorities, overlap, stops and abort."""

from scheduler.scheduler_fakes import Engine, FakeExecutor, check_invariants, reference_output

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import FinishReason, NewSequence, ScheduledSequence, SeqError, SeqOutput, StepPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence, SequenceStatus


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_sched(num_blocks=10, block_size=4, clock=None, **kwargs) -> Scheduler:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kwargs)
    return Scheduler(config, clock=clock or Clock())


def make_seq(seq_id, prompt, max_tokens=8, priority=0, arrival_s=0.0, **stopping) -> SchedulerSequence:
    return SchedulerSequence(
        seq_id,
        f"req-{seq_id}",
        list(prompt),
        SamplingParams(),
        StoppingCriteria(max_tokens=max_tokens, **stopping),
        priority=priority,
        arrival_time_s=arrival_s,
    )


def result(plan: StepPlan, tokens: dict[int, int] | None = None, errors=()) -> StepResult:
    outputs = tuple(SeqOutput(seq_id, (token,)) for seq_id, token in (tokens or {}).items())
    return StepResult(step_id=plan.step_id, incarnation_id="inc", outputs=outputs, errors=tuple(errors))


def scheduled(plan: StepPlan) -> list[tuple[int, int]]:
    """(seq_id, num_scheduled_tokens) of every sequence in the plan."""
    return [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs + plan.scheduled_seqs]


def test_long_prompt_is_chunked_by_the_token_budget():
    s = make_sched(max_num_batched_tokens=8)
    s.add(make_seq(1, range(20), max_tokens=3))
    plan = s.schedule()
    assert plan.new_seqs == (NewSequence(1, "req-1", tuple(range(20)), 20, SamplingParams(), (0, 1), 0, 8),)
    assert s.update(result(plan)) == []
    plan = s.schedule()
    assert plan.scheduled_seqs == (ScheduledSequence(1, 8, (2, 3)),)
    s.update(result(plan))
    plan = s.schedule()
    assert plan.scheduled_seqs == (ScheduledSequence(1, 4, (4,)),)
    (upd,) = s.update(result(plan, {1: 30}))
    assert upd.new_token_ids == (30,) and not upd.finished
    plan = s.schedule()
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (5,)),)  # position 20 opens block 5
    assert plan.step_id == 3


def test_running_decodes_first_then_a_waiting_prompt_takes_the_rest():
    s = make_sched(num_blocks=20, max_num_batched_tokens=8)
    s.add(make_seq(1, [1, 2, 3]))
    s.update(result(s.schedule(), {1: 9}))
    s.add(make_seq(2, range(20)))
    plan = s.schedule()
    assert scheduled(plan) == [(2, 7), (1, 1)]
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, ()),)
    assert plan.new_seqs[0].num_scheduled_tokens == 7 and plan.new_seqs[0].block_ids == (1, 2)


def test_a_running_prefill_leaves_one_token_for_each_later_decoder():
    s = make_sched(num_blocks=30, max_num_batched_tokens=8)
    s.add(make_seq(2, [1, 2]))
    s.add(make_seq(3, [3, 4]))
    s.update(result(s.schedule(), {2: 5, 3: 6}))
    s.add(make_seq(1, range(30), priority=-1))  # ranks before 2 and 3 once running
    plan = s.schedule()
    assert scheduled(plan) == [(1, 6), (2, 1), (3, 1)]
    s.update(result(plan, {2: 7, 3: 8}))
    assert [seq.seq_id for seq in s.running] == [1, 2, 3]
    plan = s.schedule()
    assert scheduled(plan) == [(1, 6), (2, 1), (3, 1)]  # 6, not 8: never stalls 2 and 3
    check_invariants(s)


def test_max_num_seqs_bounds_the_running_set():
    s = make_sched(num_blocks=30, max_num_seqs=2)
    for i in range(3):
        s.add(make_seq(i, [i, i]))
    plan = s.schedule()
    assert [n.seq_id for n in plan.new_seqs] == [0, 1]
    assert (s.num_running, s.num_waiting) == (2, 1)


def _three_running_in_six_blocks():
    s = make_sched(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for i in (1, 2, 3):
        s.add(make_seq(i, [10 * i + k for k in range(7)]))
    plan = s.schedule()
    assert [n.block_ids for n in plan.new_seqs] == [(0, 1), (2, 3), (4, 5)]
    s.update(result(plan, {1: 1, 2: 2, 3: 3}))
    plan = s.schedule()  # position 7 still fits the second block of each
    assert scheduled(plan) == [(1, 1), (2, 1), (3, 1)] and s.kv.num_free_blocks == 0
    s.update(result(plan, {1: 1, 2: 2, 3: 3}))
    return s


def test_preemption_takes_the_most_recently_admitted_and_resumes_it_later():
    s = _three_running_in_six_blocks()
    plan = s.schedule()  # every sequence needs a block for position 8
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (5,)), ScheduledSequence(2, 1, (4,)))
    assert plan.dropped_seq_ids == (3,) and plan.new_seqs == ()
    victim = s.get(3)
    assert victim.status is SequenceStatus.WAITING and victim.block_ids == []
    assert victim.num_computed_tokens == 0 and (victim.num_preemptions, s.counters.num_preemptions) == (1, 1)
    check_invariants(s)
    s.update(result(plan, {1: 1, 2: 2}))
    s.finish(1, FinishReason.STOP)
    plan = s.schedule()
    assert plan.dropped_seq_ids == (1,)
    (resumed,) = plan.new_seqs
    # Resumed with prompt + outputs so far; its cached prefix blocks were evicted by 1 and 2.
    assert resumed.token_ids == (30, 31, 32, 33, 34, 35, 36, 3, 3) and resumed.num_prompt_tokens == 7
    assert resumed.num_computed_tokens == 0 and resumed.num_scheduled_tokens == 9
    assert victim.num_cached_tokens == 0  # usage reports the first admission's hits
    check_invariants(s)


def test_a_lower_priority_sequence_is_preempted_before_a_more_recent_one():
    s = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add(make_seq(1, range(7), priority=5))
    s.update(result(s.schedule(), {1: 1}))
    s.add(make_seq(2, range(10, 17), priority=0))
    plan = s.schedule()
    assert scheduled(plan) == [(2, 7), (1, 1)]
    s.update(result(plan, {1: 1, 2: 2}))
    assert [seq.seq_id for seq in s.running] == [2, 1]
    plan = s.schedule()
    assert scheduled(plan) == [(2, 1)] and plan.dropped_seq_ids == (1,)


def test_a_sequence_that_is_the_tail_preempts_itself():
    s = make_sched(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    s.add(make_seq(1, range(7)))
    s.add(make_seq(2, range(10, 17)))
    s.update(result(s.schedule(), {1: 1, 2: 2}))
    s.update(result(s.schedule(), {1: 1, 2: 2}))
    plan = s.schedule()  # one free block, both need one: 1 gets it, 2 yields
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (4,)),) and plan.dropped_seq_ids == (2,)
    assert s.get(2).status is SequenceStatus.WAITING
    # The step that preempted admits nothing, so 2 does not bounce straight back.
    assert plan.new_seqs == ()


def test_priority_then_fcfs_and_aging_bounds_the_wait():
    clock = Clock()
    s = make_sched(num_blocks=30, max_num_seqs=1, clock=clock, max_priority_wait_s=10.0)
    s.add(make_seq(1, [1], max_tokens=1, priority=5, arrival_s=0.0))
    s.add(make_seq(2, [2], max_tokens=1, priority=0, arrival_s=1.0))
    s.add(make_seq(3, [3], max_tokens=1, priority=0, arrival_s=2.0))
    order = []
    for now_s in (3.0, 4.0):
        clock.now_s = now_s
        plan = s.schedule()
        order += [n.seq_id for n in plan.new_seqs]
        s.update(result(plan, {order[-1]: 0}))
    assert order == [2, 3]
    s.add(make_seq(4, [4], max_tokens=1, priority=0, arrival_s=10.5))
    clock.now_s = 10.5  # 1 has waited 10.5 s > 10 s: served first despite its priority
    plan = s.schedule()
    assert [n.seq_id for n in plan.new_seqs] == [1]
    assert s.get(1).rank[0] == float("-inf")
    s.update(result(plan, {1: 0}))
    assert [n.seq_id for n in s.schedule().new_seqs] == [4]


def test_overlap_plans_a_decode_before_the_previous_result_arrives():
    s = make_sched(num_blocks=10)
    s.add(make_seq(1, [5, 6, 7, 8], max_tokens=10))
    plan0 = s.schedule()
    assert scheduled(plan0) == [(1, 4)] and s.get(1).num_pending_tokens == 1
    plan1 = s.schedule()  # the executor appends its own token 4: compute it now
    assert plan1.scheduled_seqs == (ScheduledSequence(1, 1, (1,)),)
    assert (s.get(1).num_pending_tokens, s.get(1).num_computed_tokens) == (2, 5)
    empty = s.schedule()  # two tokens ahead of the results: wait
    assert not empty.has_work and empty.step_id == 2 and len(s.inflight) == 2
    (upd,) = s.update(result(plan0, {1: 40}))
    assert upd.new_token_ids == (40,) and s.get(1).token_ids == [5, 6, 7, 8, 40]
    plan2 = s.schedule()
    assert plan2.step_id == 2 and plan2.scheduled_seqs == (ScheduledSequence(1, 1, ()),)
    (upd,) = s.update(result(plan1, {1: 41}))
    assert s.get(1).output_token_ids == [40, 41] and s.get(1).num_pending_tokens == 1


def test_a_stop_found_during_overlap_ignores_the_extra_step_and_drops_once():
    s = make_sched(num_blocks=10, eos_token_ids=(2,))
    s.add(make_seq(1, [5, 6, 7, 8], max_tokens=10))
    s.add(make_seq(9, [1, 1, 1], max_tokens=10))
    plan0 = s.schedule()
    plan1 = s.schedule()
    assert scheduled(plan1) == [(1, 1), (9, 1)]
    updates = s.update(result(plan0, {1: 2, 9: 3}))
    assert [(u.seq.seq_id, u.new_token_ids, u.finished) for u in updates] == [(1, (2,), True), (9, (3,), False)]
    seq = updates[0].seq
    assert (seq.finish_reason, seq.stop_reason, seq.status) == (FinishReason.STOP, None, SequenceStatus.FINISHED)
    assert s.get(1) is None and seq.block_ids == []
    # The extra token computed in plan 1 never reaches the client.
    assert [u.seq.seq_id for u in s.update(result(plan1, {1: 77, 9: 4}))] == [9]
    assert seq.output_token_ids == [2]
    plan2 = s.schedule()
    assert plan2.dropped_seq_ids == (1,) and scheduled(plan2) == [(9, 1)]
    assert s.schedule().dropped_seq_ids == ()
    # Seq 1's full prompt block stays cached after it finished.
    assert s.peek_prefix_hit_tokens([5, 6, 7, 8, 2]) == 4


def test_stop_token_ids_ignore_eos_and_max_tokens():
    s = make_sched(num_blocks=20, eos_token_ids=(2,))
    s.add(make_seq(1, [1], stop_token_ids=(7,)))
    s.add(make_seq(2, [1], ignore_eos=True, max_tokens=2))
    s.add(make_seq(3, [1], max_tokens=1))
    plan = s.schedule()
    updates = s.update(result(plan, {1: 7, 2: 2, 3: 2}))
    assert [(u.seq.seq_id, u.finished) for u in updates] == [(1, True), (2, False), (3, True)]
    assert s.get(2).output_token_ids == [2]  # EOS ignored
    assert (updates[0].seq.finish_reason, updates[0].seq.stop_reason) == (FinishReason.STOP, 7)
    assert updates[2].seq.finish_reason is FinishReason.STOP  # EOS beats max_tokens
    (upd,) = s.update(result(s.schedule(), {2: 2}))
    assert upd.finished and upd.seq.finish_reason is FinishReason.LENGTH


def test_a_sequence_at_max_tokens_is_not_computed_again():
    s = make_sched(num_blocks=10)
    s.add(make_seq(1, [1, 2, 3], max_tokens=1))
    plan0 = s.schedule()
    assert not s.schedule().has_work  # its only token is pending: nothing more to compute
    (upd,) = s.update(result(plan0, {1: 4}))
    assert upd.finished and upd.seq.finish_reason is FinishReason.LENGTH


def test_max_model_len_ends_a_sequence():
    s = make_sched(num_blocks=10, max_model_len=6)
    s.add(make_seq(1, [1, 2, 3, 4], max_tokens=2))
    s.update(result(s.schedule(), {1: 5}))
    (upd,) = s.update(result(s.schedule(), {1: 6}))
    assert upd.finished and upd.seq.finish_reason is FinishReason.LENGTH and upd.seq.num_tokens == 6


def test_a_preempted_sequence_waits_for_its_pending_token_before_resuming():
    s = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add(make_seq(1, range(8)))
    s.add(make_seq(2, range(10, 18)))
    plan0 = s.schedule()  # both sample a token, pending
    plan1 = s.schedule()  # 1 needs a block for position 8: 2 is preempted, token in flight
    assert plan1.scheduled_seqs == (ScheduledSequence(1, 1, (2,)),) and plan1.dropped_seq_ids == (2,)
    seq2 = s.get(2)
    assert seq2.status is SequenceStatus.WAITING and seq2.num_pending_tokens == 1
    s.abort(1)  # blocks free up, but 2 must not resume without its token
    plan2 = s.schedule()
    assert plan2.dropped_seq_ids == (1,) and not plan2.has_work
    assert s.kv.num_free_blocks == 4
    updates = s.update(result(plan0, {1: 50, 2: 51}))
    assert [(u.seq.seq_id, u.new_token_ids) for u in updates] == [(2, (51,))]
    assert s.update(result(plan1, {1: 52})) == []
    plan3 = s.schedule()
    (resumed,) = plan3.new_seqs
    assert resumed.token_ids == tuple(range(10, 18)) + (51,) and resumed.num_scheduled_tokens == 9
    assert resumed.num_computed_tokens == 0  # its blocks were never confirmed: not cached
    check_invariants(s)


def test_abort_frees_blocks_now_and_drops_on_the_next_plan():
    s = make_sched(num_blocks=10)
    s.add(make_seq(1, range(6)))
    s.add(make_seq(2, range(6)))
    s.update(result(s.schedule(), {1: 1, 2: 1}))
    s.add(make_seq(3, range(5)))
    s.abort(3)  # never reached the executor: nothing to drop
    s.abort(1)
    s.abort(1)
    s.abort(12345)
    assert s.num_running == 1 and s.num_waiting == 0 and s.kv.num_free_blocks == 8
    plan = s.schedule()
    assert plan.dropped_seq_ids == (1,) and scheduled(plan) == [(2, 1)]
    assert s.schedule().dropped_seq_ids == ()


def test_finish_by_the_engine_and_executor_errors():
    s = make_sched(num_blocks=10)
    s.add(make_seq(1, range(6)))
    s.add(make_seq(2, range(6)))
    plan = s.schedule()
    seq1 = s.get(1)
    s.finish(1, FinishReason.STOP)
    assert (seq1.finish_reason, seq1.status) == (FinishReason.STOP, SequenceStatus.FINISHED)
    updates = s.update(result(plan, {1: 3}, errors=[SeqError(2, "boom")]))
    assert [(u.seq.seq_id, u.new_token_ids, u.finished) for u in updates] == [(2, (), True)]
    assert updates[0].seq.finish_reason is FinishReason.ERROR and updates[0].seq.error_message == "boom"
    assert s.kv.num_free_blocks == 10 and not s.has_unfinished()
    assert s.schedule().dropped_seq_ids == (1, 2)


def test_take_all_empties_the_scheduler_and_another_resumes_them():
    s = make_sched(num_blocks=10, max_num_seqs=1)
    s.add(make_seq(1, range(6)))
    s.add(make_seq(2, range(3)))
    s.update(result(s.schedule(), {1: 40}))
    s.schedule()  # in flight when the executor dies
    seqs = s.take_all()
    assert [seq.seq_id for seq in seqs] == [1, 2]
    assert s.kv.num_free_blocks == 10 and not s.has_unfinished() and s.num_running == 0
    assert seqs[0].num_pending_tokens == 0 and seqs[0].block_ids == [] and seqs[0].num_computed_tokens == 0
    other = make_sched(num_blocks=10, max_num_seqs=1)
    other.add(make_seq(3, range(4)))
    for seq in seqs:
        other.add(seq)
    (new,) = other.schedule().new_seqs  # the moved running sequence goes first
    assert (new.seq_id, new.token_ids, new.num_prompt_tokens) == (1, (0, 1, 2, 3, 4, 5, 40), 6)


def test_can_fit_and_add_rejects_what_never_fits():
    s = make_sched(num_blocks=10, block_size=4, max_model_len=40)
    assert s.can_fit(30, 10) and not s.can_fit(30, 11)
    assert not s.can_fit(0, 5) and not s.can_fit(5, 0)
    small = make_sched(num_blocks=5, block_size=4, max_model_len=100)
    assert small.can_fit(15, 5) and not small.can_fit(15, 6)
    try:
        small.add(make_seq(1, range(15), max_tokens=6))
    except ValueError as exc:
        assert "cannot fit" in str(exc)
    else:
        raise AssertionError("accepted a request larger than the pool")
    assert not small.has_unfinished()


def test_cached_prompt_tokens_and_prefix_counters():
    s = make_sched(num_blocks=20, max_num_batched_tokens=64)
    engine = Engine(s, FakeExecutor(20, 4))
    first = make_seq(1, range(20), max_tokens=2)
    s.add(first)
    engine.run()
    assert first.num_cached_tokens == 0
    assert s.peek_prefix_hit_tokens(list(range(16)) + [99, 98, 97, 96]) == 16
    second = make_seq(2, list(range(16)) + [99, 98, 97, 96], max_tokens=2)
    s.add(second)
    engine.run()
    assert second.num_cached_tokens == 16
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (40, 16)
    assert engine.outputs[2] == reference_output(list(second.prompt_token_ids), 2)
    assert s.kv.num_free_blocks == 20 and s.kv.usage == 0.0


def test_preemption_keeps_outputs_identical_to_an_unconstrained_run():
    prompts = [[(7 * i + k) % 50 for k in range(5 + 3 * i)] for i in range(6)]

    def run(num_blocks):
        s = make_sched(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_model_len=64)
        engine = Engine(s, FakeExecutor(num_blocks, 4))
        for i, prompt in enumerate(prompts):
            s.add(make_seq(i, prompt, max_tokens=24))
        while s.has_unfinished() or engine.inflight:
            engine.step()
            check_invariants(s)
        engine.run()  # sends the last drops
        assert engine.executor.seqs == {} and s.kv.num_free_blocks == num_blocks
        return dict(engine.outputs), s.counters.num_preemptions

    small, num_preemptions = run(num_blocks=12)
    large, no_preemptions = run(num_blocks=200)
    assert num_preemptions > 0 and no_preemptions == 0
    assert small == large == {i: reference_output(p, 24) for i, p in enumerate(prompts)}
