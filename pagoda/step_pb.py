"""The step protocol messages (executor.proto) <-> ``pagoda.step`` dataclasses, both ways.

The one conversion of the executor hop: the scheduler's executor-stream edge
writes plans and reads results with it, the executor's servicer the opposite.
Per-step messages (``ScheduledSequence``, ``SequenceOutput``, timings) are
converted field by field, as that runs for every sequence of every step. Messages
sent once per sequence or per connection (``NewSequence``, ``ExecutorInfo``) are
copied by field name (``pagoda.by_name``), since the dataclasses and the messages share their names.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.by_name import copy_by_name
from pagoda.constraint_pb import constraint_from_pb, constraint_to_pb
from pagoda.params import SamplingParams
from pagoda.params_pb import params_from_pb, params_to_pb
from pagoda.step import (
    BlockLoad,
    BlockSave,
    ExecutorInfo,
    GroupRank,
    LogprobEntry,
    LoraAdapter,
    NewSequence,
    ScheduledSequence,
    SeqError,
    SeqOutput,
    StepPlan,
    StepResult,
    StepTimings,
    TokenLogprob,
)
from pagoda.v1 import common_pb2, executor_pb2


def plan_to_pb(plan: StepPlan, compact: bool = False) -> executor_pb2.StepPlan:
    """A delta plan: new sequences whole, the others as diffs; `compact` (the executor reads it: its
    ExecutorInfo.compact_steps) sends the diffs as columns, whole entries only for those with blocks or drafts.
    Every plan says that its sender reads compact results."""
    scheduled = plan.scheduled_seqs
    if compact:
        scheduled = tuple(s for s in scheduled if s.new_block_ids or s.draft_token_ids or s.num_model_draft_tokens)
    return executor_pb2.StepPlan(
        step_id=plan.step_id,
        new_seqs=[
            copy_by_name(
                executor_pb2.NewSequence,
                s,
                sampling=params_to_pb(s.sampling),
                structured=constraint_to_pb(s.structured),
                loads=[executor_pb2.BlockLoad(block_hash=b.block_hash, block_id=b.block_id) for b in s.loads],
            )
            for s in plan.new_seqs
        ],
        scheduled_seqs=[
            executor_pb2.ScheduledSequence(
                seq_id=s.seq_id,
                num_scheduled_tokens=s.num_scheduled_tokens,
                new_block_ids=s.new_block_ids,
                draft_token_ids=s.draft_token_ids,
                num_model_draft_tokens=s.num_model_draft_tokens,
            )
            for s in scheduled
        ],
        dropped_seq_ids=plan.dropped_seq_ids,
        epoch=plan.epoch,
        saves=[
            executor_pb2.BlockSave(block_id=b.block_id, block_hash=b.block_hash, token_ids=b.token_ids)
            for b in plan.saves
        ],
        compact_seq_ids=[s.seq_id for s in plan.scheduled_seqs] if compact else (),
        compact_num_tokens=[s.num_scheduled_tokens for s in plan.scheduled_seqs] if compact else (),
        compact_results=True,
    )


def plan_from_pb(msg: executor_pb2.StepPlan) -> StepPlan:
    """The plan of a StepPlan message."""
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=tuple(
            copy_by_name(
                NewSequence,
                s,
                sampling=params_from_pb(s.sampling, SamplingParams),
                structured=constraint_from_pb(s.structured),
                loads=tuple(BlockLoad(b.block_hash, b.block_id) for b in s.loads),
            )
            for s in msg.new_seqs
        ),
        scheduled_seqs=_scheduled_from_pb(msg),
        dropped_seq_ids=tuple(msg.dropped_seq_ids),
        epoch=msg.epoch,
        saves=tuple(BlockSave(b.block_id, b.block_hash, tuple(b.token_ids)) for b in msg.saves),
    )


def _scheduled_from_pb(msg: executor_pb2.StepPlan) -> tuple[ScheduledSequence, ...]:
    """The plan's scheduled sequences, from whole entries or from the compact columns and the whole entries
    of those with blocks or drafts."""
    whole = tuple(
        ScheduledSequence(
            s.seq_id,
            s.num_scheduled_tokens,
            # Most steps append no block to most sequences: skip the copy of an empty list.
            tuple(s.new_block_ids) if s.new_block_ids else (),
            tuple(s.draft_token_ids) if s.draft_token_ids else (),
            s.num_model_draft_tokens,
        )
        for s in msg.scheduled_seqs
    )
    if not msg.compact_seq_ids:
        return whole
    if len(msg.compact_num_tokens) != len(msg.compact_seq_ids):
        raise ValueError("a compact plan's columns differ in length")
    by_id: dict[int, ScheduledSequence | None] = {s.seq_id: s for s in whole}
    scheduled = tuple(
        by_id.pop(seq_id, None) or ScheduledSequence(seq_id, num_tokens)
        for seq_id, num_tokens in zip(msg.compact_seq_ids, msg.compact_num_tokens)
    )
    if by_id:
        raise ValueError(f"a compact plan's whole entries for sequences {sorted(by_id)} are not in its columns")
    return scheduled


def result_to_pb(result: StepResult, compact: bool = False) -> executor_pb2.StepResult:
    """The StepResult message of one step; `compact` (the plan said its scheduler reads them) sends the outputs
    as columns, whole entries only for those with logprobs."""
    outputs = result.outputs
    columns: dict[str, list[int]] = {}
    if compact:
        outputs = tuple(o for o in outputs if o.logprobs or o.prompt_logprobs)
        columns = {
            "compact_seq_ids": [o.seq_id for o in result.outputs],
            "compact_num_tokens": [len(o.token_ids) for o in result.outputs],
            "compact_token_ids": [t for o in result.outputs for t in o.token_ids],
        }
    return executor_pb2.StepResult(
        step_id=result.step_id,
        incarnation_id=result.incarnation_id,
        # Logprobs are rare: skip the call for the outputs without them (every output, every step).
        outputs=[_output_to_pb(o) for o in outputs],
        errors=[
            executor_pb2.SequenceError(seq_id=e.seq_id, message=e.message, missing_block_hashes=e.missing_block_hashes)
            for e in result.errors
        ],
        timings=executor_pb2.StepTimings(**vars(result.timings)),
        num_scheduled_tokens=result.num_scheduled_tokens,
        draining=result.draining,
        tier_added=result.tier_added,
        tier_removed=result.tier_removed,
        tier_reset=result.tier_reset,
        **columns,
    )


def result_from_pb(msg: executor_pb2.StepResult) -> StepResult:
    """The result of a StepResult message."""
    t = msg.timings
    return StepResult(
        step_id=msg.step_id,
        incarnation_id=msg.incarnation_id,
        outputs=_outputs_from_pb(msg),
        errors=tuple(SeqError(e.seq_id, e.message, tuple(e.missing_block_hashes)) for e in msg.errors),
        timings=StepTimings(
            t.prepare_ns, t.forward_ns, t.sample_ns, t.step_ns, t.idle_ns, t.load_ns, t.save_ns, t.draft_ns
        ),
        num_scheduled_tokens=msg.num_scheduled_tokens,
        draining=msg.draining,
        # Most results carry no tier change: skip the copies of empty lists.
        tier_added=tuple(msg.tier_added) if msg.tier_added else (),
        tier_removed=tuple(msg.tier_removed) if msg.tier_removed else (),
        tier_reset=msg.tier_reset,
    )


def _outputs_from_pb(msg: executor_pb2.StepResult) -> tuple[SeqOutput, ...]:
    """The step's outputs, from whole entries or from the compact columns and the whole entries of those with
    logprobs."""
    whole = tuple(_output_from_pb(o) for o in msg.outputs)
    if not msg.compact_seq_ids:
        return whole
    counts = msg.compact_num_tokens
    tokens = list(msg.compact_token_ids)
    if len(counts) != len(msg.compact_seq_ids) or sum(counts) != len(tokens):
        raise ValueError("a compact result's columns do not add up")
    by_id: dict[int, SeqOutput | None] = {o.seq_id: o for o in whole}
    outputs = []
    start = 0
    for seq_id, count in zip(msg.compact_seq_ids, counts):
        end = start + count
        outputs.append(by_id.pop(seq_id, None) or SeqOutput(seq_id, tuple(tokens[start:end])))
        start = end
    if by_id:
        raise ValueError(f"a compact result's whole entries for sequences {sorted(by_id)} are not in its columns")
    return tuple(outputs)


def info_to_pb(info: ExecutorInfo) -> executor_pb2.ExecutorInfo:
    """Describe's answer."""
    return copy_by_name(
        executor_pb2.ExecutorInfo,
        info,
        kernels=dict(info.kernels),
        loras=[lora_to_pb(a) for a in info.loras],
        group_ranks=[copy_by_name(executor_pb2.GroupRank, r) for r in info.group_ranks],
    )


def info_from_pb(msg: executor_pb2.ExecutorInfo) -> ExecutorInfo:
    """The executor described by Describe's answer (kernels sorted by name; group sizes of 0, from an executor
    older than groups, read as 1)."""
    return copy_by_name(
        ExecutorInfo,
        msg,
        kernels=tuple(sorted(msg.kernels.items())),
        loras=tuple(lora_from_pb(a) for a in msg.loras),
        tensor_parallel_size=msg.tensor_parallel_size or 1,
        pipeline_parallel_size=msg.pipeline_parallel_size or 1,
        group_ranks=group_ranks_from_pb(msg.group_ranks),
    )


def group_ranks_from_pb(ranks: Iterable[executor_pb2.GroupRank]) -> tuple[GroupRank, ...]:
    """An executor group's ranks, as Describe lists them (the scheduler's heartbeat reads them too)."""
    return tuple(copy_by_name(GroupRank, r) for r in ranks)


def lora_to_pb(adapter: LoraAdapter) -> common_pb2.LoraAdapter:
    """A registered LoRA adapter, as Describe, LoadLora and the client API carry it."""
    return copy_by_name(common_pb2.LoraAdapter, adapter)


def lora_from_pb(msg: common_pb2.LoraAdapter) -> LoraAdapter:
    """The adapter of a LoraAdapter message."""
    return copy_by_name(LoraAdapter, msg)


def logprobs_to_pb(entries: Iterable[LogprobEntry]) -> list[common_pb2.LogprobEntry]:
    """LogprobEntry messages (both hops carry them)."""
    return [
        common_pb2.LogprobEntry(sampled=_token_logprob_to_pb(e.sampled), top=[_token_logprob_to_pb(t) for t in e.top])
        for e in entries
    ]


def logprobs_from_pb(entries: Iterable[common_pb2.LogprobEntry]) -> tuple[LogprobEntry, ...]:
    """The entries of LogprobEntry messages."""
    return tuple(
        LogprobEntry(
            TokenLogprob(e.sampled.token_id, e.sampled.logprob),
            tuple(TokenLogprob(t.token_id, t.logprob) for t in e.top),
        )
        for e in entries
    )


def _token_logprob_to_pb(t: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob)


def _output_to_pb(o: SeqOutput) -> executor_pb2.SequenceOutput:
    msg = executor_pb2.SequenceOutput(
        seq_id=o.seq_id, token_ids=o.token_ids, logprobs=logprobs_to_pb(o.logprobs) if o.logprobs else ()
    )
    if o.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_pb(o.prompt_logprobs))
        msg.prompt_logprobs_start = o.prompt_logprobs_start
    return msg


def _output_from_pb(o: executor_pb2.SequenceOutput) -> SeqOutput:
    logprobs = logprobs_from_pb(o.logprobs) if o.logprobs else ()
    if not o.prompt_logprobs:
        return SeqOutput(o.seq_id, tuple(o.token_ids), logprobs)
    return SeqOutput(
        o.seq_id, tuple(o.token_ids), logprobs, logprobs_from_pb(o.prompt_logprobs), o.prompt_logprobs_start
    )
