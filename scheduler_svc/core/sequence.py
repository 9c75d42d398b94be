"""The scheduler's mutable state of one request."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pagoda.constraint import Constraint
from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.step import FinishReason, LogprobEntry


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SchedulerSequence:
    """One request as the scheduler tracks it (the executor holds its own copy).

    Known tokens are the prompt plus the outputs received so far. Because plans
    overlap with results, a sequence may also have pending tokens: sampled by a
    step that was planned but whose result has not arrived yet. They count in
    its length for scheduling (the executor already holds them) but are not in
    token_ids until update() fills them in.

    What observes or assists it keeps its own state by seq_id: its spans the
    request tracer (scheduler_svc.obs.request_trace), its n-gram index and
    drafting record the drafter (scheduler_svc.spec.speculation). So this
    module imports neither, and neither outlives the sequence there.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        stopping: StoppingCriteria,
        *,
        priority: int = 0,
        arrival_time_s: float | None = None,
        cache_salt: str = "",
        output_token_ids: Sequence[int] = (),
        structured: Constraint | None = None,
        lora_name: str = "",
    ) -> None:
        """``output_token_ids``: outputs it starts with (a resumed request's delivered tokens);
        ``structured``: the output constraint the executor enforces; ``lora_name``: its LoRA adapter."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids)
        # Prompt then outputs: the text blocks are hashed over.
        self.token_ids = self.prompt_token_ids + self.output_token_ids
        self.sampling = sampling
        self.stopping = stopping
        self.structured = structured
        # SamplingParams.prompt_logprobs: the entries of prompt tokens 1, 2, ... received so far.
        self.prompt_logprobs: list[LogprobEntry] = []
        self.priority = priority
        # None: set from the scheduler's clock by add().
        self.arrival_time_s = arrival_time_s
        self.cache_salt = cache_salt
        # Its LoRA adapter ("": the base model), and the fingerprint of the adapter's weights on the executors
        # it is placed on (set at placement: part of its blocks' hashes, so no adapter reads another's KV).
        self.lora_name = lora_name
        self.lora_fingerprint = ""
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # The stop token id that ended the sequence (stop_token_ids only).
        self.stop_reason: int | None = None
        self.error_message: str = ""
        # Tokens whose KV is computed, or scheduled in a plan already sent.
        self.num_computed_tokens = 0
        # Sampled in a planned step whose result has not arrived (0..2). Known
        # plus pending tokens is the length the executor sees (the scheduler's
        # hot loops add them inline).
        self.num_pending_tokens = 0
        # Prompt tokens served by the prefix cache at the first admission, and how many of them the executor's
        # offload tier gave (loads); recounted at the next admission after loads that failed.
        self.num_cached_tokens = 0
        self.num_offloaded_tokens = 0
        self.recount_cached_tokens = False
        self.block_ids: list[int] = []
        # Its KV is rotated with LongRoPE's long factors: chosen at each admission by its length
        # (SchedulerConfig.rope_switch_len), sent with it (NewSequence.long_rope), part of its blocks' hashes.
        self.long_rope = False
        # Chained hashes of the full blocks of token_ids (under its salt and factor set), computed once each.
        self.block_hashes: list[int] = []
        # Leading blocks of block_ids already offered to the prefix cache.
        self.num_registered_blocks = 0
        self.num_preemptions = 0
        self.num_admissions = 0
        # Whether the executor holds this sequence's state (sent in new_seqs).
        self.executor_holds = False
        # (effective priority, admission order): the running order; the
        # largest is preempted first.
        self.rank: tuple[float, int] = (float(priority), 0)
        # A step verifying drafts of it is in flight: how many tokens it adds is unknown until its result.
        self.drafts_in_flight = False

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs received."""
        return len(self.token_ids)

    def add_prompt_logprobs(self, start: int, entries: Sequence[LogprobEntry]) -> None:
        """Entries of prompt tokens start, start + 1, ...: those not received yet (a recompute after a
        preemption scores the prompt again) are appended."""
        have = len(self.prompt_logprobs) + 1  # the next prompt token without an entry
        if start <= have < start + len(entries):
            self.prompt_logprobs.extend(entries[have - start :])

    def append_token(self, token_id: int) -> None:
        """Adds one generated token (a pending one that arrived)."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def drop_last_outputs(self, num_tokens: int) -> None:
        """Forgets the last num_tokens outputs (accepted drafts after a stop string: never delivered)."""
        if num_tokens > 0:
            del self.output_token_ids[-num_tokens:]
            del self.token_ids[-num_tokens:]

    def check_stop(self, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> bool:
        """After appending token_id: sets finish_reason if it ends the sequence."""
        stopping = self.stopping
        if token_id in stopping.stop_token_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, token_id
        elif not stopping.ignore_eos and token_id in eos_token_ids:
            self.finish_reason = FinishReason.STOP
        elif len(self.output_token_ids) >= stopping.max_tokens or len(self.token_ids) >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
        else:
            return False
        return True

    def reset_for_recompute(self) -> None:
        """Forgets KV state: the sequence will be recomputed from its tokens."""
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_registered_blocks = 0
        self.executor_holds = False
        self.drafts_in_flight = False

    def __repr__(self) -> str:
        return (
            f"SchedulerSequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}"
            f"+{self.num_pending_tokens}, computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
