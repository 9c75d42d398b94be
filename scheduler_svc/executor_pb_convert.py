"""Proto <-> scheduler dataclasses for the executor hop (the edge only)."""

from __future__ import annotations

from pagoda.v1 import common_pb2, executor_pb2
from scheduler_svc import types


def sampling_to_pb(s: types.SamplingParams) -> common_pb2.SamplingParams:
    """Every field explicit on this hop."""
    msg = common_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
    )
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def plan_to_pb(plan: types.StepPlan) -> executor_pb2.StepPlan:
    """A delta plan: new sequences whole, the others as diffs."""
    return executor_pb2.StepPlan(
        step_id=plan.step_id,
        new_seqs=[
            executor_pb2.NewSequence(
                seq_id=s.seq_id,
                request_id=s.request_id,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
                sampling=sampling_to_pb(s.sampling),
                block_ids=s.block_ids,
                num_computed_tokens=s.num_computed_tokens,
                num_scheduled_tokens=s.num_scheduled_tokens,
            )
            for s in plan.new_seqs
        ],
        scheduled_seqs=[
            executor_pb2.ScheduledSequence(
                seq_id=s.seq_id, num_scheduled_tokens=s.num_scheduled_tokens, new_block_ids=s.new_block_ids
            )
            for s in plan.scheduled_seqs
        ],
        dropped_seq_ids=plan.dropped_seq_ids,
    )


def _logprob_from_pb(e: common_pb2.LogprobEntry) -> types.LogprobEntry:
    return types.LogprobEntry(
        types.TokenLogprob(e.sampled.token_id, e.sampled.logprob),
        tuple(types.TokenLogprob(t.token_id, t.logprob) for t in e.top),
    )


def result_from_pb(msg: executor_pb2.StepResult) -> types.StepResult:
    """Convert a StepResult message."""
    t = msg.timings
    return types.StepResult(
        step_id=msg.step_id,
        incarnation_id=msg.incarnation_id,
        outputs=tuple(
            types.SeqOutput(o.seq_id, tuple(o.token_ids), tuple(_logprob_from_pb(e) for e in o.logprobs))
            for o in msg.outputs
        ),
        errors=tuple(types.SeqError(e.seq_id, e.message) for e in msg.errors),
        timings=types.StepTimings(t.prepare_ns, t.forward_ns, t.sample_ns, t.step_ns, t.idle_ns),
        num_scheduled_tokens=msg.num_scheduled_tokens,
        draining=msg.draining,
    )


def info_from_pb(msg: executor_pb2.ExecutorInfo) -> types.ExecutorInfo:
    """Convert Describe's answer."""
    return types.ExecutorInfo(
        incarnation_id=msg.incarnation_id,
        model_name=msg.model_name,
        architecture=msg.architecture,
        dtype=msg.dtype,
        kv_cache_dtype=msg.kv_cache_dtype,
        device=msg.device,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        tokenizer_json=msg.tokenizer_json,
        chat_template=msg.chat_template,
        bos_token=msg.bos_token,
        eos_token=msg.eos_token,
        draining=msg.draining,
    )
