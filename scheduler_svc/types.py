"""Plain data that crosses the scheduler's boundaries: request parameters in,
step plans out to an executor, step results back.

Frozen dataclasses of ints, floats, strings and tuples only; the server edge
converts them to and from protos, nothing else here knows about gRPC.
"""

from __future__ import annotations

import dataclasses
import enum


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Effective sampling parameters of one request (defaults already applied)."""

    # 0 means greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The random stream depends only on (seed, token position).
    seed: int = 0
    # None: no logprobs; 0: the sampled token's only; n: plus the top n.
    logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class StoppingCriteria:
    """When a request stops (EOS is handled by the engine unless ignore_eos)."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


class FinishReason(enum.Enum):
    """Why a sequence stopped."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class NewSeqPlan:
    """A sequence sent to the executor whole: first time, or after preemption."""

    seq_id: int
    request_id: str
    # Prompt then tokens generated so far.
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    sampling: SamplingParams
    # The whole block table so far.
    block_ids: tuple[int, ...]
    # Tokens whose KV is already in block_ids (prefix-cache hits).
    num_computed_tokens: int
    # Tokens to compute this step, starting at num_computed_tokens.
    num_scheduled_tokens: int


@dataclasses.dataclass(frozen=True)
class ScheduledSeqPlan:
    """A sequence the executor holds, scheduled again: only the diff."""

    seq_id: int
    num_scheduled_tokens: int
    # Blocks appended to the block table for this step.
    new_block_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step for one executor."""

    step_id: int
    new_seqs: tuple[NewSeqPlan, ...] = ()
    scheduled_seqs: tuple[ScheduledSeqPlan, ...] = ()
    # Finished, aborted or preempted: the executor drops their state.
    dropped_seq_ids: tuple[int, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens this step computes across all sequences."""
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.scheduled_seqs
        )

    @property
    def has_work(self) -> bool:
        """Whether the executor has anything to compute."""
        return bool(self.new_seqs or self.scheduled_seqs)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclasses.dataclass(frozen=True)
class LogprobEntry:
    """The sampled token's logprob and the top alternatives if asked."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class SeqOutput:
    """Tokens one sequence sampled in one step."""

    seq_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] = ()


@dataclasses.dataclass(frozen=True)
class SeqError:
    """A sequence that failed alone inside the executor (it dropped it)."""

    seq_id: int
    message: str


@dataclasses.dataclass(frozen=True)
class StepTimings:
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    step_ns: int = 0
    idle_ns: int = 0


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the executor computed for one StepPlan."""

    step_id: int
    incarnation_id: str
    outputs: tuple[SeqOutput, ...] = ()
    errors: tuple[SeqError, ...] = ()
    timings: StepTimings = StepTimings()
    num_scheduled_tokens: int = 0
    draining: bool = False


@dataclasses.dataclass(frozen=True)
class ExecutorInfo:
    """What Describe returned: the model and the KV cache of one executor."""

    incarnation_id: str
    model_name: str
    architecture: str
    dtype: str
    kv_cache_dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    draining: bool = False
