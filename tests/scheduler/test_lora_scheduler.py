"""LoRA in one scheduler core: the prefix cache keyed by adapter, and at most max_loras adapters running."""

from __future__ import annotations

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import FinishReason, SeqOutput, StepPlan, StepResult
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.kv.kv_cache_manager import hash_block_tokens

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _seq(seq_id: int, prompt, lora: str = "", fingerprint: str = "", max_tokens: int = 4) -> SchedulerSequence:
    seq = SchedulerSequence(
        seq_id,
        f"r{seq_id}",
        list(prompt),
        SamplingParams(),
        StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        arrival_time_s=0.0,
        lora_name=lora,
    )
    seq.lora_fingerprint = fingerprint or (f"fp-{lora}" if lora else "")
    return seq


def _result(plan: StepPlan, token: int = 7) -> StepResult:
    outputs = tuple(SeqOutput(s.seq_id, (token,)) for s in (*plan.new_seqs, *plan.scheduled_seqs))
    return StepResult(step_id=plan.step_id, incarnation_id="inc", outputs=outputs)


def test_a_first_blocks_hash_carries_the_adapter_and_the_base_models_is_unchanged():
    tokens = (1, 2, 3, 4)
    base = hash_block_tokens(None, tokens, "salt")
    assert hash_block_tokens(None, tokens, "salt", False, "") == base
    with_a = hash_block_tokens(None, tokens, "salt", False, "fp-a")
    assert len({base, with_a, hash_block_tokens(None, tokens, "salt", False, "fp-b")}) == 3
    assert hash_block_tokens(None, tokens, "salt", True, "fp-a") not in (with_a, base)
    # The salt and the adapter are two fields, not one string.
    assert hash_block_tokens(None, tokens, "saltfp-a", False, "") != hash_block_tokens(
        None, tokens, "salt", False, "fp-a"
    )


def test_the_prefix_cache_serves_a_prefix_only_to_its_own_adapter():
    core = Scheduler(SchedulerConfig(num_blocks=64, block_size=BS), clock=Clock())
    prompt = list(range(10, 27))  # 4 full blocks and one token
    first = _seq(1, prompt, "a")
    core.add(first)
    plan = core.schedule()
    core.update(_result(plan))
    core.finish(1, FinishReason.STOP)
    assert core.peek_prefix_hit_tokens(prompt, "", "fp-a") == 16
    assert core.peek_prefix_hit_tokens(prompt, "", "fp-b") == 0
    assert core.peek_prefix_hit_tokens(prompt) == 0  # nor to the base model
    for seq_id, lora, hits in ((2, "b", 0), (3, "", 0), (4, "a", 16)):
        core.add(_seq(seq_id, prompt, lora))
        plan = core.schedule()
        (new,) = plan.new_seqs
        assert (new.lora_name, new.num_computed_tokens) == (lora, hits)
        core.update(_result(plan))
        core.finish(seq_id, FinishReason.STOP)


def test_at_most_max_loras_adapters_run_and_the_others_wait_their_turn():
    core = Scheduler(SchedulerConfig(num_blocks=64, block_size=BS, max_loras=2), clock=Clock())
    for seq_id, lora in enumerate(["x", "y", "z", "x", "", "z"], start=1):
        core.add(_seq(seq_id, [5, 6, 7], lora))
    plan = core.schedule()
    # z waits at the head; those behind it whose adapter runs (x) and the base model go ahead.
    assert [(s.seq_id, s.lora_name) for s in plan.new_seqs] == [(1, "x"), (2, "y"), (4, "x"), (5, "")]
    core.update(_result(plan))
    core.finish(2, FinishReason.STOP)  # y's last sequence: a slot frees
    plan = core.schedule()
    assert [(s.seq_id, s.lora_name) for s in plan.new_seqs] == [(3, "z"), (6, "z")]
    running = {s.lora_name for s in core.roster.running if s.lora_name}
    assert running == {"x", "z"}


def test_an_aged_head_holds_the_queue_until_a_slot_frees():
    clock = Clock()
    core = Scheduler(SchedulerConfig(num_blocks=64, block_size=BS, max_loras=1, max_priority_wait_s=5.0), clock=clock)
    core.add(_seq(1, [5, 6, 7], "x", max_tokens=50))
    core.update(_result(core.schedule()))
    core.add(_seq(2, [5, 6, 8], "y"))
    core.add(_seq(3, [5, 6, 9], "x"))
    plan = core.schedule()
    assert [s.seq_id for s in plan.new_seqs] == [3]  # y waits; x's goes ahead
    core.update(_result(plan))
    core.add(_seq(4, [5, 6, 10], "x"))
    clock.now_s = 10.0  # y has waited past the limit: nothing passes it any more
    plan = core.schedule()
    assert plan.new_seqs == ()
    core.update(_result(plan))
    for seq_id in (1, 3):
        core.finish(seq_id, FinishReason.STOP)
    plan = core.schedule()
    assert [s.seq_id for s in plan.new_seqs] == [2]
