"""The executor's view of a step: what the plan asks, what the step returns.

Plain frozen dataclasses; executor_svc/server.py converts them from and to
protos. Model code never sees a proto.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Effective per-sequence sampling parameters (the scheduler fills defaults)."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or negative disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    logprobs: int | None = None  # None: none; 0: sampled only; n: plus top n


@dataclasses.dataclass(frozen=True)
class NewSequence:
    """A sequence the executor has not seen, or must recompute after preemption."""

    seq_id: int
    request_id: str
    token_ids: tuple[int, ...]  # prompt then generated so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: tuple[int, ...]  # whole block table so far
    num_computed_tokens: int  # KV already in block_ids (prefix-cache hits)
    num_scheduled_tokens: int  # tokens to compute this step


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """A sequence the executor holds, scheduled again."""

    seq_id: int
    num_scheduled_tokens: int
    new_block_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step plan."""

    step_id: int
    new_seqs: tuple[NewSequence, ...] = ()
    scheduled_seqs: tuple[ScheduledSequence, ...] = ()
    dropped_seq_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclasses.dataclass(frozen=True)
class LogprobEntry:
    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class SeqOutput:
    """The token(s) one sequence sampled this step."""

    seq_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] = ()


@dataclasses.dataclass(frozen=True)
class SeqError:
    """A sequence that failed alone this step; its state was dropped."""

    seq_id: int
    message: str


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step produced, with its timings in nanoseconds."""

    step_id: int
    outputs: tuple[SeqOutput, ...] = ()
    errors: tuple[SeqError, ...] = ()
    num_scheduled_tokens: int = 0
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
