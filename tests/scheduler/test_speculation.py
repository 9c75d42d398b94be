"""Speculative decoding in the scheduler: exact plans with drafts, rollback of rejected ones, stops, policy."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler.scheduler_fakes import Engine, FakeExecutor, check_invariants, copy_model, reference_output
from scheduler.test_scheduler_properties import MAX_DRAIN_STEPS, OP_KINDS, Harness, configs, op_args
from support.executor_info import executor_info

from pagoda.constraint import Constraint
from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import ScheduledSequence, SeqOutput, StepPlan, StepResult, StepTimings
from scheduler_svc.config import SchedulerServiceConfig, load_config
from scheduler_svc.core.config import DraftSource
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.engine import Engine as ServiceEngine
from scheduler_svc.spec.speculation import MIN_ACCEPTED_PER_ATTEMPT, AcceptanceRecord

EOS = 3


def make_sched(**kwargs) -> Scheduler:
    fields = {"num_blocks": 10, "block_size": 4, "speculative": "ngram", "eos_token_ids": (99,), **kwargs}
    return Scheduler(SchedulerConfig(**fields), clock=lambda: 0.0)


def make_seq(seq_id, prompt, max_tokens=8, structured=None) -> SchedulerSequence:
    stopping = StoppingCriteria(max_tokens=max_tokens)
    return SchedulerSequence(seq_id, f"r{seq_id}", list(prompt), SamplingParams(), stopping, structured=structured)


def result(plan: StepPlan, tokens: dict[int, tuple[int, ...]], timings: StepTimings | None = None) -> StepResult:
    outputs = tuple(SeqOutput(seq_id, token_ids) for seq_id, token_ids in tokens.items())
    return StepResult(step_id=plan.step_id, incarnation_id="inc", outputs=outputs, timings=timings or StepTimings())


def started(scheduler: Scheduler, prompt, token: int, **kwargs) -> SchedulerSequence:
    """A sequence admitted, prefilled and given its first token."""
    seq = make_seq(1, prompt, **kwargs)
    scheduler.add(seq)
    scheduler.update(result(scheduler.schedule(), {1: (token,)}))
    return seq


def test_drafts_are_planned_and_rejected_ones_rolled_back():
    s = make_sched()
    seq = started(s, [1, 2, 3, 1, 2], 3)
    assert seq.block_ids == [0, 1] and s.may_plan_ahead is False
    plan = s.schedule()
    # (1, 2, 3) occurred at the start, followed by 1, 2, 3: positions 5..8 need a third block.
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (2,), (1, 2, 3)),)
    assert plan.num_scheduled_tokens == 4 and plan.num_draft_tokens == 3
    assert s.schedule().has_work is False  # nothing more for it until the result
    # Drafts 1, 2 accepted, 3 rejected: the executor's own token there is 7.
    (update,) = s.update(result(plan, {1: (1, 2, 7)}))
    assert update.new_token_ids == (1, 2, 7) and not update.finished
    assert seq.output_token_ids == [3, 1, 2, 7]
    # KV of positions 0..7 stays; the block made for the rejected draft alone goes back.
    assert seq.num_computed_tokens == 8 and seq.block_ids == [0, 1]
    assert s.kv.num_free_blocks == 8 and s.drafter.stats[DraftSource.NGRAM].num_accepted_tokens == 2
    assert [b.block_id for b in s.kv.pool.cached.values()] == [0, 1]
    # No n-gram ends in (2, 7): one token, into the block freed just now.
    assert s.schedule().scheduled_seqs == (ScheduledSequence(1, 1, (2,), ()),)


def test_a_block_with_rejected_kv_is_never_cached():
    s = make_sched(block_size=2)
    seq = started(s, [5, 6, 5, 6, 5], 6)
    plan = s.schedule()
    # Position 5 and drafts at 6, 7: a fourth block, which holds rejected drafts only.
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (3,), (5, 6)),)
    s.update(result(plan, {1: (9,)}))  # the first draft is rejected
    assert seq.num_computed_tokens == 6 and seq.block_ids == [0, 1, 2]
    cached = {b.block_id for b in s.kv.pool.cached.values()}
    assert cached == {0, 1, 2} and s.kv.num_free_blocks == 7


def test_eos_inside_an_accepted_run_ends_the_sequence_there():
    s = make_sched(eos_token_ids=(EOS,))
    seq = started(s, [1, 2, EOS, 5, 1], 2)
    plan = s.schedule()
    assert plan.scheduled_seqs[0].draft_token_ids == (EOS, 5, 1, 2)
    # All accepted: the tokens after EOS are dropped, as plain decoding never made them.
    (update,) = s.update(result(plan, {1: (EOS, 5, 1, 2, 9)}))
    assert update.finished and update.new_token_ids == (EOS,)
    assert seq.output_token_ids == [2, EOS] and s.kv.num_free_blocks == 10


def test_drafts_leave_room_for_max_tokens():
    s = make_sched()
    started(s, [1, 2, 3, 1, 2], 3, max_tokens=3)
    # One output so far, three at most: one draft plus the executor's own token.
    assert s.schedule().scheduled_seqs[0].draft_token_ids == (1,)


def test_constrained_sequences_and_large_batches_do_not_draft():
    s = make_sched()
    started(s, [1, 2, 3, 1, 2], 3, structured=Constraint("regex", "[0-9]+"))
    assert s.may_plan_ahead and s.schedule().scheduled_seqs[0].draft_token_ids == ()
    s = make_sched(speculative_max_batch=1)
    for seq_id in (1, 2):
        s.add(make_seq(seq_id, [1, 2, 3, 1, 2]))
    s.update(result(s.schedule(), {1: (3,), 2: (3,)}))
    assert s.may_plan_ahead
    assert [x.draft_token_ids for x in s.schedule().scheduled_seqs] == [(), ()]


def test_too_many_tokens_for_the_drafts_fail_the_sequence():
    s = make_sched()
    seq = started(s, [1, 2, 3, 1, 2], 3)
    plan = s.schedule()
    (update,) = s.update(result(plan, {1: (1, 2, 3, 4, 5)}))
    assert update.finished and "5 tokens for a step with 3 drafts" in seq.error_message
    assert s.kv.num_free_blocks == 10


def test_fruitless_attempts_pause_a_sequence_then_it_tries_again():
    spec = AcceptanceRecord()
    for num_output_tokens in range(5):
        assert spec.active(num_output_tokens)
        spec.record(0, num_output_tokens)
    # Five attempts without an accepted draft: paused for 16 generated tokens.
    assert not spec.active(19) and spec.active(20)
    # Right after a pause one fruitless attempt pauses it again, twice as long.
    spec.record(0, 20)
    assert not spec.active(51) and spec.active(52)
    spec.record(1, 52)  # an accepted draft keeps it going
    assert spec.active(53) and spec.mean_accepted > MIN_ACCEPTED_PER_ATTEMPT


def test_greedy_outputs_with_speculation_equal_those_without():
    prompts = [[1, 2, 3, 4] * 3, [5, 6, 0, 1, 5, 6], [2], [4, 4, 4, 4, 4, 4, 4]]

    def run(speculative: str) -> tuple[dict[int, list[int]], int]:
        """(outputs, steps) of the prompts (the fake draft model's drafts are right at 2 positions of 3)."""
        config = SchedulerConfig(
            num_blocks=24, block_size=2, max_num_batched_tokens=16, max_model_len=48, speculative=speculative
        )
        scheduler = Scheduler(config, clock=lambda: 0.0)
        engine = Engine(scheduler, FakeExecutor(24, 2, copy_model))
        for i, prompt in enumerate(prompts):
            scheduler.add(SchedulerSequence(i, f"r{i}", prompt, SamplingParams(), StoppingCriteria(30)))
        num_steps = engine.run(max_steps=MAX_DRAIN_STEPS)
        assert scheduler.kv.num_free_blocks == 24
        return dict(engine.outputs), num_steps

    plain, plain_steps = run("off")
    assert plain == {i: reference_output(p, 30, model=copy_model) for i, p in enumerate(prompts)}
    for method in ("ngram", "draft", "ngram+draft"):
        drafted, drafted_steps = run(method)
        assert drafted == plain, method
        # Four sequences of up to 42 tokens in 48 slots: preempted and recomputed on the way.
        assert drafted_steps < plain_steps, method


class SpeculationHarness(Harness):
    model = staticmethod(copy_model)


spec_configs = configs.flatmap(
    lambda c: st.fixed_dictionaries(
        {
            "speculative": st.sampled_from(["ngram", "draft", "ngram+draft"]),
            "num_speculative_tokens": st.integers(1, 5),
            "speculative_max_batch": st.integers(1, 6),
        }
    ).map(lambda extra: {**c, **extra})
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=spec_configs, kinds=st.lists(st.sampled_from(OP_KINDS), min_size=10, max_size=60), data=st.data())
def test_random_programs_with_speculation_keep_block_accounting_exact(config, kinds, data):
    harness = SpeculationHarness(config, max_inflight=2)
    for kind in kinds:
        harness.apply(kind, data.draw(op_args[kind], label=kind))
        check_invariants(harness.scheduler)
    engine, scheduler = harness.engine, harness.scheduler
    for _ in range(MAX_DRAIN_STEPS):
        if not (scheduler.has_unfinished() or engine.inflight):
            break
        engine.step()
        check_invariants(scheduler)
    else:
        raise AssertionError("livelock: requests did not finish")
    engine.step()  # the last dropped ids
    assert scheduler.kv.num_free_blocks == harness.config.num_blocks
    assert all(block.ref_cnt == 0 for block in scheduler.kv.pool.blocks)
    assert engine.executor.seqs == {}
    harness.check_outputs()


def test_flags_configure_speculation_and_refuse_what_is_not_there(capsys):
    config = load_config(["--speculative", "ngram", "--num-speculative-tokens", "6", "--speculative-max-batch", "2"])
    assert (config.speculative, config.num_speculative_tokens, config.speculative_max_batch) == ("ngram", 6, 2)
    assert (load_config([]).speculative, load_config([]).num_speculative_tokens) == ("off", None)
    assert load_config(["--speculative", "ngram+draft"]).speculative == "ngram+draft"
    for argv, message in (
        (["--speculative", "eagle"], "--speculative must be one of off, ngram, draft, ngram+draft"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 16]"),
    ):
        with pytest.raises(SystemExit):
            load_config(argv)
        assert message in capsys.readouterr().err


def test_each_source_has_its_own_default_number_of_drafts_and_the_flag_sets_both():
    long_repeat = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    for method, k, drafts, num_model in (
        ("ngram", None, (3, 4, 5, 6, 7, 8, 9, 10), 0),  # the n-gram default: 8
        ("ngram", 3, (3, 4, 5), 0),
        ("draft", None, (), 4),  # the draft model's default: 4
        ("draft", 6, (), 6),
        ("ngram+draft", None, (3, 4, 5, 6, 7, 8, 9, 10), 0),
    ):
        s = make_sched(speculative=method, num_speculative_tokens=k, num_blocks=20, block_size=4)
        started(s, long_repeat[:-1], long_repeat[-1], max_tokens=50)
        (entry,) = s.schedule().scheduled_seqs
        assert (entry.draft_token_ids, entry.num_model_draft_tokens) == (drafts, num_model), (method, k)
    s = make_sched(speculative="ngram+draft", num_blocks=20, block_size=4)
    started(s, [20, 21, 22, 23, 24], 25, max_tokens=50)
    assert s.schedule().scheduled_seqs[0].num_model_draft_tokens == 4  # no n-gram: the draft model's 4
    assert SchedulerConfig(num_blocks=1, block_size=1).max_draft_tokens == 8
    engine = ServiceEngine(SchedulerServiceConfig(speculative="ngram"))
    assert engine._scheduler_config(executor_info()).num_speculative_tokens is None
    engine = ServiceEngine(SchedulerServiceConfig(speculative="ngram", num_speculative_tokens=5))
    assert engine._scheduler_config(executor_info()).draft_tokens(DraftSource.NGRAM) == 5


def test_model_drafts_are_planned_as_a_count_and_rolled_back():
    s = make_sched(speculative="draft")
    seq = started(s, [1, 2, 3, 4, 5], 6, max_tokens=20)
    plan = s.schedule()
    # Positions 5..9 (the last token and 4 drafts) need a third block; the executor's draft model proposes.
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (2,), (), 4),)
    assert plan.num_scheduled_tokens == 5 and plan.num_draft_tokens == 4 and not s.may_plan_ahead
    timings = StepTimings(prepare_ns=1, forward_ns=8, sample_ns=1, draft_ns=5)
    (update,) = s.update(result(plan, {1: (7, 8, 9)}, timings))  # 2 drafts accepted, then its own token
    assert update.new_token_ids == (7, 8, 9) and seq.output_token_ids == [6, 7, 8, 9]
    assert seq.num_computed_tokens == 8 and seq.block_ids == [0, 1] and s.kv.num_free_blocks == 8
    stats = s.drafter.stats
    assert (stats[DraftSource.MODEL].num_draft_tokens, stats[DraftSource.MODEL].num_accepted_tokens) == (4, 2)
    assert stats[DraftSource.NGRAM].num_drafts == 0
    # Its first draft also caught the draft model's KV up on the prompt: that step's time is no measure.
    assert s.drafter.model_cost is None
    plan = s.schedule()
    assert plan.scheduled_seqs[0].num_model_draft_tokens == 4
    s.update(result(plan, {1: (10,)}, timings))
    # Continuing from its last draft, its passes took half the rest of the step: the draft model must gain
    # more than 0.5 tokens per attempt.
    assert s.drafter.model_cost == 0.5 and s.drafter.break_even(DraftSource.MODEL) == 0.5


def test_ngram_drafts_first_then_the_draft_model_where_none_matches():
    s = make_sched(speculative="ngram+draft")
    # The longer one: the other (the shortest) is the one to try the draft model first.
    repeating = make_seq(1, [1, 2, 3, 1, 2, 3, 1, 2])
    other = make_seq(2, [5, 6, 7, 8, 9])
    for seq in (repeating, other):
        s.add(seq)
    s.update(result(s.schedule(), {1: (3,), 2: (4,)}))
    plan = s.schedule()
    assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (4,), (1, 2, 3)), ScheduledSequence(2, 1, (5,), (), 4))


def test_the_draft_model_pauses_where_it_gains_less_than_it_costs():
    s = make_sched(speculative="draft", num_blocks=40, block_size=16)
    seq = started(s, [1, 2, 3, 4, 5], 6, max_tokens=200)
    # Its passes cost twice the rest of the step: one accepted draft per step loses time.
    timings = StepTimings(prepare_ns=1, forward_ns=8, sample_ns=1, draft_ns=20)
    num_attempts = 0
    while (plan := s.schedule()).scheduled_seqs[0].num_model_draft_tokens:
        token = seq.token_ids[-1] + 1
        s.update(result(plan, {1: (token, token + 1)}, timings))
        num_attempts += 1
        assert num_attempts < 10
    assert s.drafter.model_cost == 2.0 and s.drafter.speculation(seq.seq_id).model.resume_at > len(seq.output_token_ids)
    assert s.may_plan_ahead  # nothing drafts: plans overlap again


def test_the_draft_model_probes_a_plain_step_now_and_then_and_n_gram_drafts_never_do():
    drafter = make_sched(speculative="draft").drafter
    one = [make_seq(1, [1, 2])]  # not started: no record that could pause the draft model
    decisions = [drafter.speculates(one) for _ in range(8 + 2 * 64)]
    assert [i for i, on in enumerate(decisions) if not on] == [7, 71, 135]
    ngram = make_sched(speculative="ngram").drafter
    assert all(ngram.speculates(one) for _ in range(200))
    assert not ngram.speculates(one * 100)  # the global rule still holds


def test_the_draft_model_pauses_where_its_step_costs_more_than_a_plain_one():
    s = make_sched(speculative="draft", num_blocks=40, block_size=16)
    seq = started(s, [1, 2, 3, 4, 5], 6, max_tokens=200)
    plain = StepTimings(prepare_ns=1, forward_ns=8, sample_ns=1)
    # Its passes cost half a plain step, but verifying its drafts doubles the step: one accepted draft per
    # step (2 tokens for 25 ns against 10 ns a token) loses. Measured against the verifying step alone
    # (5 / 20) it would look like a gain.
    verifying = StepTimings(prepare_ns=2, forward_ns=16, sample_ns=2, draft_ns=5)
    num_plain = num_drafting = 0
    while num_plain < 2:
        plan = s.schedule()
        (entry,) = plan.scheduled_seqs
        token = seq.token_ids[-1] + 1
        if entry.num_model_draft_tokens:
            s.update(result(plan, {1: (token, token + 1)}, verifying))
            num_drafting += 1
            assert num_drafting < 40
        else:  # the probe step, then the first step of the pause
            s.update(result(plan, {1: (token,)}, plain))
            num_plain += 1
    assert s.drafter.plain_step_ns == {1: 10}
    assert s.drafter.model_cost > 1.0 and s.drafter.speculation(seq.seq_id).model.resume_at > len(seq.output_token_ids)


def test_an_executor_without_a_draft_model_gets_what_is_left_of_the_method():
    with_draft = executor_info(draft_model="tiny-draft")
    without = executor_info(draft_model="")
    for method, on_with, on_without in (
        ("draft", "draft", "off"),
        ("ngram+draft", "ngram+draft", "ngram"),
        ("ngram", "ngram", "ngram"),
    ):
        engine = ServiceEngine(SchedulerServiceConfig(speculative=method))
        assert engine._scheduler_config(with_draft).speculative == on_with
        assert engine._scheduler_config(without).speculative == on_without


def test_with_the_draft_model_paused_n_gram_misses_pause_drafting_and_plans_overlap_again():
    s = make_sched(speculative="ngram+draft", num_blocks=40, block_size=16)
    seq = started(s, [5, 6, 7, 8, 9], 10, max_tokens=300)
    # No n-gram: the draft model drafts. Nothing accepted, and its passes cost twice the rest of the step
    # (measured the second time, the first also catching up on the prompt): the draft model pauses.
    for token in (11, 12):
        plan = s.schedule()
        assert plan.scheduled_seqs[0].num_model_draft_tokens == 4
        s.update(result(plan, {1: (token,)}, StepTimings(prepare_ns=1, forward_ns=8, sample_ns=1, draft_ns=20)))
    assert s.drafter.model_cost == 2.0
    num_steps = 0
    while not s.may_plan_ahead:
        plan = s.schedule()
        assert plan.scheduled_seqs == (ScheduledSequence(1, 1, (), ()),)  # never repeating: no n-gram
        s.update(result(plan, {1: (seq.token_ids[-1] + 1,)}))
        num_steps += 1
        assert num_steps < 10, "n-gram misses never paused drafting"
