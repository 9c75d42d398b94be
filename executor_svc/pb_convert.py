"""Proto <-> executor dataclasses, used only by the servicer (the edge)."""

from __future__ import annotations

from executor_svc import types
from pagoda.v1 import common_pb2, executor_pb2


def sampling_from_pb(msg: common_pb2.SamplingParams) -> types.SamplingParams:
    """Every field is set by the scheduler; unset ones take the dataclass default."""
    defaults = types.SamplingParams()
    get = lambda name: getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)  # noqa: E731
    return types.SamplingParams(
        temperature=get("temperature"),
        top_p=get("top_p"),
        top_k=get("top_k"),
        min_p=get("min_p"),
        repetition_penalty=get("repetition_penalty"),
        presence_penalty=get("presence_penalty"),
        frequency_penalty=get("frequency_penalty"),
        seed=get("seed"),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def step_from_pb(msg: executor_pb2.StepPlan) -> types.StepInput:
    """Convert a StepPlan message."""
    new_seqs = tuple(
        types.NewSequence(
            seq_id=s.seq_id,
            request_id=s.request_id,
            token_ids=tuple(s.token_ids),
            num_prompt_tokens=s.num_prompt_tokens,
            sampling=sampling_from_pb(s.sampling),
            block_ids=tuple(s.block_ids),
            num_computed_tokens=s.num_computed_tokens,
            num_scheduled_tokens=s.num_scheduled_tokens,
        )
        for s in msg.new_seqs
    )
    scheduled = tuple(
        types.ScheduledSequence(s.seq_id, s.num_scheduled_tokens, tuple(s.new_block_ids)) for s in msg.scheduled_seqs
    )
    return types.StepInput(msg.step_id, new_seqs, scheduled, tuple(msg.dropped_seq_ids))


def _logprob_to_pb(entry: types.LogprobEntry) -> common_pb2.LogprobEntry:
    return common_pb2.LogprobEntry(
        sampled=common_pb2.TokenLogprob(token_id=entry.sampled.token_id, logprob=entry.sampled.logprob),
        top=[common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in entry.top],
    )


def result_to_pb(
    out: types.StepOutput, incarnation_id: str, step_ns: int, idle_ns: int, draining: bool
) -> executor_pb2.StepResult:
    """Convert a StepOutput plus the server's own timings."""
    return executor_pb2.StepResult(
        step_id=out.step_id,
        incarnation_id=incarnation_id,
        outputs=[
            executor_pb2.SequenceOutput(
                seq_id=o.seq_id, token_ids=o.token_ids, logprobs=[_logprob_to_pb(e) for e in o.logprobs]
            )
            for o in out.outputs
        ],
        errors=[executor_pb2.SequenceError(seq_id=e.seq_id, message=e.message) for e in out.errors],
        timings=executor_pb2.StepTimings(
            prepare_ns=out.prepare_ns,
            forward_ns=out.forward_ns,
            sample_ns=out.sample_ns,
            step_ns=step_ns,
            idle_ns=idle_ns,
        ),
        num_scheduled_tokens=out.num_scheduled_tokens,
        draining=draining,
    )
