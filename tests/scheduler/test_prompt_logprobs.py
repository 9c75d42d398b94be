"""``prompt_logprobs``: the scheduler collects each prompt token's entry once, and computes scored prompts."""

from scheduler.test_scheduler import make_sched, scheduled

from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import LogprobEntry, SeqOutput, StepResult, TokenLogprob
from scheduler_svc.core.sequence import SchedulerSequence


def _entries(start: int, count: int) -> tuple[LogprobEntry, ...]:
    """Entries whose token id is the prompt position they score (so the order shows)."""
    return tuple(LogprobEntry(TokenLogprob(p, -0.5 * p)) for p in range(start, start + count))


def _scored_seq(seq_id: int, prompt, **sampling) -> SchedulerSequence:
    params = SamplingParams(prompt_logprobs=0, **sampling)
    return SchedulerSequence(seq_id, f"r{seq_id}", list(prompt), params, StoppingCriteria(max_tokens=4))


def test_entries_are_appended_once_in_prompt_order():
    seq = _scored_seq(1, range(10))
    seq.add_prompt_logprobs(1, _entries(1, 4))
    seq.add_prompt_logprobs(1, _entries(1, 6))  # a recompute scores the first tokens again
    seq.add_prompt_logprobs(9, _entries(9, 1))  # not contiguous: a gap would misplace it
    seq.add_prompt_logprobs(7, _entries(7, 3))
    assert [e.sampled.token_id for e in seq.prompt_logprobs] == list(range(1, 10))


def test_chunked_prompt_entries_reach_the_sequence_and_the_prompt_is_computed():
    s = make_sched(num_blocks=20, max_num_batched_tokens=8)
    warm = SchedulerSequence(9, "warm", list(range(12)), SamplingParams(), StoppingCriteria(max_tokens=1))
    s.add(warm)
    plan = s.schedule()
    s.update(StepResult(plan.step_id, "inc", outputs=()))
    plan = s.schedule()
    s.update(StepResult(plan.step_id, "inc", outputs=(SeqOutput(9, (50,)),)))
    s.schedule()  # drops it; its full blocks stay cached
    scored = _scored_seq(1, range(12))
    assert s.peek_prefix_hit_tokens(list(range(12))) == 8
    s.add(scored)
    plan = s.schedule()
    assert plan.new_seqs[0].num_computed_tokens == 0 and scheduled(plan) == [(1, 8)]  # no prefix hit
    s.update(StepResult(plan.step_id, "inc", outputs=(SeqOutput(1, (), (), _entries(1, 8), 1),)))
    plan = s.schedule()
    assert scheduled(plan) == [(1, 4)]
    (update,) = s.update(StepResult(plan.step_id, "inc", outputs=(SeqOutput(1, (7,), (), _entries(9, 3), 9),)))
    assert update.new_token_ids == (7,)
    assert [e.sampled.token_id for e in scored.prompt_logprobs] == list(range(1, 12))
