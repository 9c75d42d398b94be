"""The step protocol between scheduler and executor, as plain data.

One definition for both services: the scheduler builds ``StepPlan``s and reads
``StepResult``s, the executor does the opposite; each converts to and from the
``pagoda.v1.executor`` protos at its server edge only. Frozen dataclasses of
ints, strings and tuples; no torch, numpy or protobuf here.

The plan is a *delta*: a sequence is sent whole once (``NewSequence``), then
only as what changed (``ScheduledSequence``), plus the ids to drop.
"""

from __future__ import annotations

import dataclasses
import enum

from pagoda.constraint import Constraint
from pagoda.params import SamplingParams

# Most speculative tokens of one sequence in one step (n-gram drafts or the draft model's).
MAX_DRAFT_TOKENS = 16


class FinishReason(enum.Enum):
    """Why a sequence stopped."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class BlockLoad:
    """Fill a block from the executor's offload tier (docs/kv-offload.md) before the step's forward."""

    # The block's chained prefix hash (the tier's key).
    block_hash: int
    block_id: int


@dataclasses.dataclass(frozen=True)
class BlockSave:
    """Write a full, computed block to the executor's offload tier (asynchronously; it may drop it)."""

    block_id: int
    block_hash: int
    # The block's tokens: stored with it, checked when it is loaded into a sequence.
    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class NewSequence:
    """A sequence the executor has not seen, or must recompute (preempted or moved)."""

    seq_id: int
    request_id: str
    # Prompt then tokens generated so far.
    token_ids: tuple[int, ...]
    # How many of token_ids are prompt (penalties treat output differently).
    num_prompt_tokens: int
    sampling: SamplingParams
    # The whole block table so far.
    block_ids: tuple[int, ...]
    # Tokens whose KV is already in block_ids (prefix-cache hits).
    num_computed_tokens: int
    # Tokens to compute this step, starting at num_computed_tokens.
    num_scheduled_tokens: int
    # The output constraint; the executor derives its matcher from token_ids[num_prompt_tokens:].
    structured: Constraint | None = None
    # W3C trace context of the request span, for sampled requests only (docs/tracing.md); empty: not traced.
    traceparent: str = ""
    # Blocks to fill from the offload tier first: the last len(loads) blocks of the num_computed_tokens
    # prefix, in table order (the blocks before them are device prefix-cache hits).
    loads: tuple[BlockLoad, ...] = ()
    # Rotate its K and Q with LongRoPE's long factors (ExecutorInfo.rope_switch_len; the scheduler decides, by
    # its length at admission); False: the short ones, or the model's only RoPE.
    long_rope: bool = False
    # The LoRA adapter it runs with (ExecutorInfo.loras); "": the base model.
    lora_name: str = ""


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """A sequence the executor holds, scheduled again: only the diff."""

    seq_id: int
    num_scheduled_tokens: int
    # Blocks appended to the block table for this step (they cover the drafts too).
    new_block_ids: tuple[int, ...] = ()
    # Speculative tokens to verify after the scheduled ones (docs/speculative-decoding.md): extra query
    # tokens of this step. The executor returns the accepted ones plus one token of its own, keeps the KV of
    # the accepted ones only and cuts its block table to the blocks of its computed tokens, as the scheduler does.
    draft_token_ids: tuple[int, ...] = ()
    # Speculative tokens the executor's draft model proposes after the scheduled ones, verified in this step
    # like draft_token_ids (which must then be empty); the blocks cover them too.
    num_model_draft_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step for one executor."""

    step_id: int
    new_seqs: tuple[NewSequence, ...] = ()
    scheduled_seqs: tuple[ScheduledSequence, ...] = ()
    # Finished, aborted or preempted: the executor drops their state.
    dropped_seq_ids: tuple[int, ...] = ()
    # The lease (executor_svc.serving.lease) of the stream it travels on; the executor refuses any other.
    epoch: int = 0
    # Blocks to copy out to the offload tier before anything in this step writes KV (a block freed and
    # reused by this step still holds what was computed).
    saves: tuple[BlockSave, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens this step computes across all sequences (draft tokens included)."""
        return (
            sum(s.num_scheduled_tokens for s in self.new_seqs)
            + sum(s.num_scheduled_tokens for s in self.scheduled_seqs)
            + self.num_draft_tokens
        )

    @property
    def num_draft_tokens(self) -> int:
        """Speculative tokens this step verifies (given by the plan or proposed by the draft model)."""
        return sum(len(s.draft_token_ids) + s.num_model_draft_tokens for s in self.scheduled_seqs)

    @property
    def has_work(self) -> bool:
        """Whether the executor has anything to compute."""
        return bool(self.new_seqs or self.scheduled_seqs)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """Log probability of one token."""

    token_id: int
    logprob: float


@dataclasses.dataclass(frozen=True)
class LogprobEntry:
    """The sampled token's logprob and the top alternatives if asked."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class SeqOutput:
    """Tokens one sequence sampled in one step (already appended by the executor), and prompt logprobs."""

    seq_id: int
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] = ()
    # SamplingParams.prompt_logprobs: entries for the prompt tokens at prompt_logprobs_start, ... (this step's
    # chunk predicted them; token_ids is empty when the chunk did not reach the prompt's end).
    prompt_logprobs: tuple[LogprobEntry, ...] = ()
    prompt_logprobs_start: int = 0


@dataclasses.dataclass(frozen=True)
class SeqError:
    """A sequence that failed alone inside the executor (it dropped it)."""

    seq_id: int
    message: str
    # Non-empty: the failure is tier misses (these hashes could not be loaded); the sequence can be
    # recomputed (the scheduler forgets the hashes and admits it again).
    missing_block_hashes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Where one step's time went inside the executor, in nanoseconds."""

    # Building inputs (slot mapping, positions) on the host.
    prepare_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    # Whole step, from plan received to result sent.
    step_ns: int = 0
    # Time the executor waited for this plan after finishing the previous step.
    idle_ns: int = 0
    # Filling the plan's loads from the offload tier, and copying out its saves.
    load_ns: int = 0
    save_ns: int = 0
    # The draft model's passes (proposing speculative tokens), before prepare.
    draft_ns: int = 0


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the executor computed for one StepPlan."""

    step_id: int
    incarnation_id: str = ""
    # One entry per sequence that sampled a token this step.
    outputs: tuple[SeqOutput, ...] = ()
    errors: tuple[SeqError, ...] = ()
    timings: StepTimings = StepTimings()
    num_scheduled_tokens: int = 0
    draining: bool = False
    # What the offload tier gained and lost since the previous result (tier_reset: tier_added is all it
    # holds, and replaces what the scheduler knew; the first result of each stream).
    tier_added: tuple[int, ...] = ()
    tier_removed: tuple[int, ...] = ()
    tier_reset: bool = False


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter registered on an executor (docs/lora.md)."""

    name: str
    # The PEFT folder it was read from, on the executor's file system.
    path: str
    # The largest rank of its modules, and the modules it adapts.
    rank: int
    target_modules: tuple[str, ...]
    # A digest of its weights: blocks computed with it are keyed by it in the prefix cache and the offload tier.
    fingerprint: str


# A group rank's health: its leader answers (and a lost rank ends the group at once), or it did not answer the
# scheduler's last heartbeat.
RANK_OK, RANK_UNKNOWN = "ok", "unknown"


@dataclasses.dataclass(frozen=True)
class GroupRank:
    """One rank of an executor group, as its leader reports it (docs/parallel.md)."""

    rank: int
    host: str
    pid: int
    # What it holds, e.g. "layers 0-1, q heads 0-1, kv heads 0-0, vocab 0-191".
    shard: str
    # Its resident memory and KV cache when the group formed.
    rss_bytes: int
    kv_cache_bytes: int
    health: str = RANK_OK


@dataclasses.dataclass(frozen=True)
class ExecutorInfo:
    """What Describe returns: the model and the KV cache of one executor."""

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
    # The code paths this executor runs, e.g. {"attention": "cpp", "gemm": "amx-panel"}.
    kernels: tuple[tuple[str, str], ...] = ()
    # The scheduler driving the executor (empty: free) and its lease's epoch.
    lease_holder: str = ""
    lease_epoch: int = 0
    # Non-draining schedulers seen in the last 3 s (their heartbeat is Describe), sorted.
    schedulers: tuple[str, ...] = ()
    # Schedulers whose Acquire was refused in the last 3 s, sorted.
    lease_claimants: tuple[str, ...] = ()
    # The offload tier (docs/kv-offload.md): what it is ("" = none), and every hash it holds (full Describe only).
    kv_offload: str = ""
    tier_hashes: tuple[int, ...] = ()
    # The linear weights' quantization in effect: none, int8, ... (docs/quantization.md).
    quantization: str = "none"
    # The draft model proposing speculative tokens (empty: none), and how the KV budget is split: the
    # num_kv_blocks blocks take kv_cache_bytes for the model and draft_kv_cache_bytes for the draft model.
    draft_model: str = ""
    kv_cache_bytes: int = 0
    draft_kv_cache_bytes: int = 0
    # LongRoPE (Phi-3 128k, Phi-3.5): the sequence length past which a sequence runs on the long factors
    # (original_max_position_embeddings); 0: the model has one factor set (or is served no longer than that).
    rope_switch_len: int = 0
    # Every token is the bits the same request gives alone, whatever else is in the step (docs/durability.md).
    batch_invariant: bool = False
    # The LoRA adapters registered, the most resident on the device at once (the scheduler runs at most that
    # many distinct adapters among the executor's sequences), and the largest rank it accepts.
    loras: tuple[LoraAdapter, ...] = ()
    max_loras: int = 0
    max_lora_rank: int = 0
    # An executor group (docs/parallel.md): ranks that split each layer, stages that split the layers, and every
    # rank in rank order; a plain executor is one rank and lists none.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    group_ranks: tuple[GroupRank, ...] = ()
    # Seconds since the group last completed a call with every rank (a step or the leader's ping), as of this
    # Describe; 0 for a plain executor.
    group_last_contact_s: float = 0.0
    # The executor reads compact step plans (a wire capability: set by the executor's servicer, read by the
    # scheduler's executor stream; pagoda/step_pb.py).
    compact_steps: bool = False
