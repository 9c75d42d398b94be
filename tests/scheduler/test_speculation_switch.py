"""The draft model switched off for every sequence where it cannot pay, and tried again on a doubling interval."""

import dataclasses

import pytest
from scheduler.scheduler_fakes import Engine, FakeExecutor, check_invariants, copy_model, reference_output
from scheduler.test_scheduler_properties import MAX_DRAIN_STEPS
from support.executor_info import executor_info

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import StepPlan, StepResult, StepTimings
from scheduler_svc.config import load_config
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.engine import Engine as ServiceEngine
from scheduler_svc.spec import draft_switch
from scheduler_svc.spec.draft_switch import FIRST_OFF_STEPS

PLAIN = StepTimings(prepare_ns=1, forward_ns=8, sample_ns=1)


def wrong_draft(token_ids: list[int], digest: int) -> int:
    """A draft model that is never right (copy_model's tokens are below 7)."""
    return 9


class TimedExecutor(FakeExecutor):
    """The strict fake executor, its steps timed: a plain step costs 10, the draft model's passes draft_ns."""

    def __init__(self, num_blocks: int, block_size: int, draft_ns: int, draft=copy_model) -> None:
        super().__init__(num_blocks, block_size, copy_model)
        self.draft_model = draft
        self.draft_ns = draft_ns
        # Per step: how many sequences the draft model drafted for.
        self.model_drafts: list[int] = []

    def execute(self, plan: StepPlan) -> StepResult:
        num_model = sum(1 for s in plan.scheduled_seqs if s.num_model_draft_tokens)
        if plan.has_work:
            self.model_drafts.append(num_model)
        timings = dataclasses.replace(PLAIN, draft_ns=self.draft_ns) if num_model else PLAIN
        return dataclasses.replace(super().execute(plan), timings=timings)


def setup(
    draft_ns: int, draft=copy_model, num_blocks: int = 300, block_size: int = 16
) -> tuple[Scheduler, Engine, TimedExecutor]:
    config = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=4096, speculative="draft")
    scheduler = Scheduler(config, clock=lambda: 0.0)
    executor = TimedExecutor(num_blocks, block_size, draft_ns, draft)
    return scheduler, Engine(scheduler, executor), executor


def add(scheduler: Scheduler, seq_id: int, max_tokens: int) -> None:
    prompt = [seq_id % 7, 1, 2]
    scheduler.add(SchedulerSequence(seq_id, f"r{seq_id}", prompt, SamplingParams(), StoppingCriteria(max_tokens)))


def bursts(model_drafts: list[int]) -> list[tuple[int, int]]:
    """(first step, steps) of each run of steps in which the draft model drafted."""
    runs: list[tuple[int, int]] = []
    for index, num in enumerate(model_drafts):
        if not num:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


def test_a_draft_model_that_cannot_pay_even_with_every_draft_accepted_is_off_for_everyone():
    # Its passes cost 50 against a plain step's 10: even 4 accepted drafts per attempt (5 tokens for 60) lose.
    scheduler, engine, executor = setup(draft_ns=50)
    add(scheduler, 1, 1500)
    for _ in range(20):
        engine.step()
    drafter = scheduler.drafter
    # Two attempts, every draft accepted: the first also catches up on the prompt, the second measures it.
    assert bursts(executor.model_drafts) == [(2, 2)]
    assert drafter.model_cost == 5.0 and not drafter.switch.on and scheduler.may_plan_ahead
    add(scheduler, 2, 1500)  # a new sequence does not try it while it is off
    while drafter.num_steps < FIRST_OFF_STEPS:
        engine.step()
        check_invariants(scheduler)
    assert bursts(executor.model_drafts) == [(2, 2)]
    while drafter.num_steps < FIRST_OFF_STEPS + 3 * FIRST_OFF_STEPS + 50:
        engine.step()
    # Tried again after 256 steps (measured afresh: two attempts), off again for twice as long.
    (first, second, third) = bursts(executor.model_drafts)
    assert second[0] - (first[0] + first[1]) >= FIRST_OFF_STEPS
    assert third[0] - (second[0] + second[1]) >= 2 * FIRST_OFF_STEPS
    assert drafter.switch.off_steps == 8 * FIRST_OFF_STEPS and not drafter.switch.on


def test_the_draft_model_is_off_for_everyone_once_the_sequence_trying_it_has_paused_it():
    scheduler, engine, executor = setup(draft_ns=1, draft=wrong_draft)
    add(scheduler, 1, 1500)
    add(scheduler, 2, 1500)
    for _ in range(40):
        engine.step()
    drafter = scheduler.drafter
    # Never accepted, cheap: one sequence tries it (the other waits for the verdict) and pauses it after five
    # attempts (its own policy's): then it is off.
    assert bursts(executor.model_drafts) == [(2, 5)] and max(executor.model_drafts) == 1 and not drafter.switch.on
    assert drafter.model_cost is not None and drafter.model_cost < 1
    add(scheduler, 3, 1500)
    num_before = len(executor.model_drafts)
    while drafter.num_steps < FIRST_OFF_STEPS - 10:
        engine.step()
    assert sum(executor.model_drafts[num_before:]) == 0  # the new sequence did not try it
    while drafter.num_steps < FIRST_OFF_STEPS + 40:
        engine.step()
    # Tried again by the shortest sequence (the new one: the least to catch up on), five attempts, off again.
    assert sum(executor.model_drafts[num_before:]) == 5 and not drafter.switch.on
    # Sequence 2 never tried it: its record is as it started.
    assert drafter.speculation(3).model.resume_at > 0 and drafter.speculation(2).model.mean_accepted == 1
    assert drafter.switch.off_steps == 4 * FIRST_OFF_STEPS


def test_the_draft_model_that_pays_stays_on_and_its_time_off_starts_again_at_the_first():
    scheduler, engine, executor = setup(draft_ns=50)
    add(scheduler, 1, 2900)
    drafter = scheduler.drafter
    while drafter.num_steps < FIRST_OFF_STEPS + 20:
        engine.step()
    # Off twice (after its first attempts, and after it was tried again): the next time off is 4 x 256.
    assert drafter.switch.off_steps == 4 * FIRST_OFF_STEPS and not drafter.switch.on
    executor.draft_ns = 5  # cheaper now: 5 tokens for 15 against 10 a token
    while drafter.num_steps < 4 * FIRST_OFF_STEPS:
        engine.step()
    assert drafter.switch.on and drafter.switch.off_steps == FIRST_OFF_STEPS
    assert drafter.model_cost == pytest.approx(0.5) and sum(executor.model_drafts[-20:]) >= 18


def test_not_adaptive_the_draft_model_drafts_in_every_step_even_where_it_loses():
    config = SchedulerConfig(num_blocks=300, block_size=16, speculative="draft", speculative_adaptive=False)
    scheduler = Scheduler(config, clock=lambda: 0.0)
    executor = TimedExecutor(300, 16, draft_ns=50, draft=wrong_draft)
    engine = Engine(scheduler, executor)
    add(scheduler, 1, 400)
    engine.run(max_steps=MAX_DRAIN_STEPS)
    # The prefill, then 399 steps of one token each, with drafts but for the last (max_tokens leaves no room);
    # no probe step either.
    assert executor.model_drafts == [0] + [1] * 398 + [0] and scheduler.drafter.switch.on
    assert scheduler.kv.num_free_blocks == 300
    service = load_config(["--speculative", "draft", "--speculative-adaptive", "false"])
    assert not ServiceEngine(service)._scheduler_config(executor_info()).speculative_adaptive
    assert load_config([]).speculative_adaptive


@pytest.mark.parametrize("draft", [copy_model, wrong_draft], ids=["right", "wrong"])
@pytest.mark.parametrize("draft_ns", [1, 50], ids=["cheap", "costly"])
def test_outputs_and_blocks_stay_exact_while_the_draft_model_goes_off_and_on(monkeypatch, draft, draft_ns):
    monkeypatch.setattr(draft_switch, "FIRST_OFF_STEPS", 3)
    monkeypatch.setattr(draft_switch, "MAX_OFF_STEPS", 12)
    # 40 blocks of 4 for six sequences of up to 70 tokens: preempted and recomputed on the way.
    scheduler, engine, executor = setup(draft_ns, draft, num_blocks=40, block_size=4)
    prompts = {i: [i % 7, 1, 2] for i in range(6)}
    for i in prompts:
        add(scheduler, i, 60 + i)
    for _ in range(MAX_DRAIN_STEPS):
        if not (scheduler.has_unfinished() or engine.inflight):
            break
        engine.step()
        check_invariants(scheduler)
    else:
        raise AssertionError("livelock: requests did not finish")
    assert dict(engine.outputs) == {i: reference_output(p, 60 + i, model=copy_model) for i, p in prompts.items()}
    assert scheduler.kv.num_free_blocks == 40 and scheduler.counters.num_preemptions > 0
    if draft is wrong_draft or draft_ns == 50:  # it cannot pay: off, on again, off for longer
        assert scheduler.drafter.switch.off_steps > 3 and len(bursts(executor.model_drafts)) > 2


def test_one_sequence_tries_the_draft_model_and_the_others_wait_for_its_verdict():
    seq = {i: SchedulerSequence(i, f"r{i}", [1] * (2 + i), SamplingParams(), StoppingCriteria(10)) for i in range(4)}
    switch = draft_switch.DraftModelSwitch(True, paused=lambda seq: False)  # no record has paused it
    assert not switch.update([], 0, cannot_pay=False) and not switch.on  # nobody to try it
    switch.update([seq[1], seq[0]], 0, cannot_pay=False)
    assert switch.on and switch.allows(seq[0]) and not switch.allows(seq[1])  # the shortest tries it
    switch.attempted(pays=False)
    switch.update([seq[1]], 1, cannot_pay=False)  # it finished before paying: off, twice as long next time
    assert not switch.on and not switch.allows(seq[1]) and switch.off_steps == 2 * FIRST_OFF_STEPS
    assert not switch.update([seq[1]], FIRST_OFF_STEPS, cannot_pay=False)  # its time off is not over
    assert not switch.update([], FIRST_OFF_STEPS + 1, cannot_pay=False)  # nobody to try it: it waits
    assert switch.update([seq[2], seq[1]], FIRST_OFF_STEPS + 1, cannot_pay=False)  # on: the probe
    assert switch.allows(seq[1]) and not switch.allows(seq[2]) and not switch.allows(seq[0])
    switch.update([seq[1], seq[2]], FIRST_OFF_STEPS + 2, cannot_pay=True)  # too costly for anyone
    assert not switch.on and switch.off_steps == 2 * FIRST_OFF_STEPS  # nobody drafted: not doubled
    assert switch.update([seq[3]], 3 * FIRST_OFF_STEPS + 5, cannot_pay=False)
    switch.attempted(pays=True)  # it pays: every sequence may try it, and the time off starts at the first
    assert switch.allows(seq[0]) and switch.allows(seq[3]) and switch.off_steps == FIRST_OFF_STEPS
    switch.update([seq[0], seq[3]], 3 * FIRST_OFF_STEPS + 6, cannot_pay=False)
    assert switch.on
