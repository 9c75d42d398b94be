"""What a runner is to the servicer, and the plan bookkeeping every runner shares.

A runner turns a step plan into a step result. Two implement the `Runner`
protocol: the model runner (weights, KV cache, torch) and the simulated runner
(a cost model and deterministic tokens, no torch). Both follow the plan the
same way through `SequenceTable`: each keeps its own copy of every sequence
(token ids, block table, tokens computed), checks every entry, and a bad entry
fails only the sequence it concerns. Pure Python: no torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from pagoda.constraint import Constraint
from pagoda.params import SamplingParams, out_of_range
from pagoda.step import (
    MAX_DRAFT_TOKENS,
    BlockLoad,
    ExecutorInfo,
    NewSequence,
    ScheduledSequence,
    SeqError,
    StepPlan,
    StepResult,
)


class Runner(Protocol):
    """What the servicer calls on a runner (always from its one model thread)."""

    info: ExecutorInfo  # the model and KV cache part; the servicer adds itself and the tokenizer

    def execute(self, step: StepPlan) -> StepResult:
        """Runs one step plan; a failing sequence is reported in `errors`, never raised."""
        ...

    def reset(self) -> None:
        """Drops every sequence (a new scheduler stream starts from scratch)."""
        ...

    def num_sequences(self) -> int:
        """Sequences whose state the runner holds."""
        ...

    def add_lora(self, name: str, path: str) -> Any:
        """Registers a LoRA adapter (``executor_svc.lora.registry.LoraInfo``); raises LoraAdapterError or
        LoraRegistryError (docs/lora.md)."""
        ...

    def remove_lora(self, name: str) -> int:
        """Unregisters an adapter; returns the running sequences that finish with it first."""
        ...

    def lora_adapters(self) -> tuple[Any, ...]:
        """The adapters new sequences may name (LoraInfo)."""
        ...


class PlanError(ValueError):
    """A step plan entry this runner cannot follow (reported per sequence)."""


class TierMiss(PlanError):
    """Blocks a sequence should load that the offload tier cannot give: recoverable (the scheduler recomputes)."""

    def __init__(self, message: str, block_hashes: tuple[int, ...]) -> None:
        super().__init__(message)
        self.block_hashes = block_hashes


@dataclasses.dataclass
class SequenceState:
    """The executor's own copy of one sequence."""

    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt, then generated (sampled tokens appended here)
    num_prompt_tokens: int
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int  # tokens whose KV is in the cache
    # The output constraint, and the matcher derived from token_ids (built on first use:
    # executor_svc.sampling.constraints).
    structured: Constraint | None = None
    matcher: Any = None
    # This step's speculative tokens, verified after the scheduled ones (docs/speculative-decoding.md): the
    # plan's, or the draft model's once it has proposed them.
    draft_token_ids: tuple[int, ...] = ()
    # Tokens the draft model proposes this step (the plan's num_model_draft_tokens; 0: none).
    num_model_draft_tokens: int = 0
    # Leading tokens whose draft-model KV is in block_table (executor_svc.runner.draft_model); at most
    # num_computed_tokens between steps.
    num_draft_computed: int = 0
    # Its K and Q are rotated with LongRoPE's long factors (the plan's NewSequence.long_rope; models.rope).
    long_rope: bool = False
    # The LoRA adapter its rows run with (executor_svc.lora; docs/lora.md); None: the base model.
    lora_name: str | None = None

    @property
    def num_sample_rows(self) -> int:
        """Rows this step samples for the sequence, if it samples: its last token's and one per draft."""
        return 1 + len(self.draft_token_ids)

    def tokens_at_row(self, row: int) -> list[int]:
        """The tokens before the row-th sampled position (row 0: the known ones; row j: plus j drafts)."""
        return self.token_ids if row == 0 else self.token_ids + list(self.draft_token_ids[:row])

    def accept(self, sampled: Sequence[int], block_size: int) -> int:
        """After a step that verified drafts: appends the accepted ones and the sample after them.

        ``sampled`` holds one token per row. Draft j is accepted when row j sampled it (with the
        position-keyed random stream, that is plain decoding's token there, so greedy and seeded
        outputs are unchanged); the first disagreement, or the row after the last draft, gives the
        sequence's own token. The rejected drafts' KV is dropped: the computed count stops after the
        accepted ones and the block table is cut to the blocks of those computed tokens, the rule the
        scheduler applies too. Returns the number of tokens appended.
        """
        drafts = self.draft_token_ids
        num_accepted = 0
        while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        self.token_ids.extend(sampled[: num_accepted + 1])
        if drafts:
            self.num_computed_tokens += num_accepted
            del self.block_table[-(-self.num_computed_tokens // block_size) :]
            self.draft_token_ids = ()
        return num_accepted + 1


# (state, tokens to compute this step) for each sequence a step runs.
Scheduled = list[tuple[SequenceState, int]]
# A new sequence's state and the blocks it loads from the offload tier before the step's forward.
LoadRequest = tuple[SequenceState, tuple[BlockLoad, ...]]


class SequenceTable:
    """The sequences a runner holds, updated by each plan and checked against its limits."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        max_model_len: int,
        has_draft_model: bool = False,
        rope_switch_len: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # ExecutorInfo.rope_switch_len: a sequence on the short LongRoPE factors computes no position past it
        # (0: the model has one factor set, and no sequence may ask for the long one).
        self.rope_switch_len = rope_switch_len
        # Plans may ask for the draft model's proposals (num_model_draft_tokens).
        self.has_draft_model = has_draft_model
        self.seqs: dict[int, SequenceState] = {}
        self._can_load = False

    def apply(self, step: StepPlan, can_load: bool = False) -> tuple[Scheduled, list[SeqError]]:
        """Drops, registers and extends what `step` says; returns what to run and the entries refused.

        A new sequence with loads is refused recoverably unless ``can_load`` (the runner has an offload tier).
        """
        self._can_load = can_load
        for seq_id in step.dropped_seq_ids:
            self.seqs.pop(seq_id, None)
        errors: list[SeqError] = []
        scheduled: Scheduled = []
        seen: set[int] = set()
        entries = [(new.seq_id, new) for new in step.new_seqs] + [(s.seq_id, s) for s in step.scheduled_seqs]
        for seq_id, entry in entries:
            try:
                if seq_id in seen:
                    raise PlanError(f"sequence {seq_id} appears twice in step {step.step_id}")
                seen.add(seq_id)
                state, num_scheduled = self._admit(entry)
                if num_scheduled:
                    scheduled.append((state, num_scheduled))
            except PlanError as exc:
                self.seqs.pop(seq_id, None)
                errors.append(SeqError(seq_id, str(exc), exc.block_hashes if isinstance(exc, TierMiss) else ()))
        return scheduled, errors

    def loads_of(self, step: StepPlan) -> list[LoadRequest]:
        """The new sequences of `step` (as applied) that load blocks from the offload tier."""
        return [(self.seqs[new.seq_id], new.loads) for new in step.new_seqs if new.loads and new.seq_id in self.seqs]

    def drop_failed_loads(
        self, scheduled: Scheduled, errors: list[SeqError], failures: dict[int, tuple[tuple[int, ...], str]]
    ) -> Scheduled:
        """Drops the sequences whose loads failed (recoverable errors naming the hashes); returns the rest."""
        if not failures:
            return scheduled
        for seq_id, (block_hashes, reason) in failures.items():
            self.seqs.pop(seq_id, None)
            message = f"offload tier: {len(block_hashes)} block(s) could not be loaded ({reason}); recompute"
            errors.append(SeqError(seq_id, message, block_hashes))
        return [(state, n) for state, n in scheduled if state.seq_id not in failures]

    def _admit(self, entry: NewSequence | ScheduledSequence) -> tuple[SequenceState, int]:
        if isinstance(entry, NewSequence):
            state = self._new_state(entry)
            self.seqs[entry.seq_id] = state  # a known seq_id is replaced (preempted, resent)
        else:
            known = self.seqs.get(entry.seq_id)
            if known is None:
                raise PlanError(f"unknown sequence {entry.seq_id}")
            self._check_block_ids(entry.new_block_ids)
            known.block_table.extend(entry.new_block_ids)
            state = known
        state.draft_token_ids = ()
        state.num_model_draft_tokens = 0
        self._check_schedule(state, entry.num_scheduled_tokens)
        if isinstance(entry, ScheduledSequence) and (entry.draft_token_ids or entry.num_model_draft_tokens):
            self._set_drafts(state, entry)
        return state, entry.num_scheduled_tokens

    def _new_state(self, entry: NewSequence) -> SequenceState:
        self._check_block_ids(entry.block_ids)
        self._check_token_ids(entry.token_ids)
        if not 0 <= entry.num_computed_tokens <= len(entry.token_ids):
            raise PlanError(f"num_computed_tokens {entry.num_computed_tokens} outside [0, {len(entry.token_ids)}]")
        if entry.loads:
            self._check_loads(entry)
        reason = out_of_range(entry.sampling)
        if reason is not None:
            raise PlanError(f"sampling: {reason}")
        if entry.long_rope and not self.rope_switch_len:
            raise PlanError("long_rope, but this model has one RoPE factor set (rope_switch_len 0)")
        return SequenceState(
            entry.seq_id,
            entry.request_id,
            list(entry.token_ids),
            entry.num_prompt_tokens,
            entry.sampling,
            list(entry.block_ids),
            entry.num_computed_tokens,
            entry.structured,
            long_rope=entry.long_rope,
            lora_name=entry.lora_name or None,
        )

    def _check_loads(self, entry: NewSequence) -> None:
        """Loads fill the last blocks of the computed prefix, each the table's block at its position."""
        loads, bs = entry.loads, self.block_size
        first = entry.num_computed_tokens // bs - len(loads)
        if entry.num_computed_tokens % bs or first < 0 or first + len(loads) > len(entry.block_ids):
            raise PlanError(f"{len(loads)} loads do not end a prefix of {entry.num_computed_tokens} computed tokens")
        for j, load in enumerate(loads):
            if entry.block_ids[first + j] != load.block_id:
                raise PlanError(f"load into block {load.block_id}, but block {first + j} of the table is another")
        if not self._can_load:
            raise TierMiss("this executor has no offload tier", tuple(load.block_hash for load in loads))

    def _check_block_ids(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise PlanError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _check_token_ids(self, token_ids: tuple[int, ...]) -> None:
        """An id outside the embedding table would fail the whole step's forward."""
        vocab_size = self.vocab_size
        if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab_size):
            bad = next(i for i in token_ids if not 0 <= i < vocab_size)
            raise PlanError(f"token id {bad} outside the vocabulary [0, {vocab_size})")

    def _set_drafts(self, state: SequenceState, entry: ScheduledSequence) -> None:
        """The step's drafts: given by the plan, or a number of them for the draft model to propose."""
        drafts, num_model = entry.draft_token_ids, entry.num_model_draft_tokens
        if drafts and num_model:
            raise PlanError("both draft_token_ids and num_model_draft_tokens (a step has one kind of drafts)")
        if num_model and not self.has_draft_model:
            raise PlanError("num_model_draft_tokens, but this executor has no draft model (--draft-model)")
        num_drafts = len(drafts) or num_model
        if not 0 < num_drafts <= MAX_DRAFT_TOKENS:
            raise PlanError(f"{num_drafts} draft tokens, outside [1, {MAX_DRAFT_TOKENS}]")
        self._check_drafts(state, entry.num_scheduled_tokens, num_drafts)
        self._check_token_ids(drafts)
        state.draft_token_ids = drafts
        state.num_model_draft_tokens = num_model

    def _check_drafts(self, state: SequenceState, num_scheduled: int, num_drafts: int) -> None:
        """Drafts follow a sequence's last known token, fit its blocks and the context, and are unconstrained."""
        if state.num_computed_tokens + num_scheduled != len(state.token_ids):
            raise PlanError("draft tokens for a step that does not reach the sequence's last token")
        if state.structured is not None:
            raise PlanError("draft tokens for a constrained sequence (its drafts are not checked against masks)")
        end = len(state.token_ids) + num_drafts
        if end > self.max_model_len:
            raise PlanError(f"drafts reach token {end}, beyond max_model_len {self.max_model_len}")
        self._check_rope(state, end)
        if end > len(state.block_table) * self.block_size:
            raise PlanError(
                f"{len(state.block_table)} blocks of {self.block_size} cannot hold {end} tokens with drafts"
            )

    def _check_schedule(self, state: SequenceState, num_scheduled: int) -> None:
        end = state.num_computed_tokens + num_scheduled
        if num_scheduled < 0:
            raise PlanError(f"num_scheduled_tokens {num_scheduled} is negative")
        if end > len(state.token_ids):
            raise PlanError(f"scheduled up to token {end} but the sequence has {len(state.token_ids)} tokens")
        if end > self.max_model_len:
            raise PlanError(f"scheduled up to token {end}, beyond max_model_len {self.max_model_len}")
        if end > len(state.block_table) * self.block_size:
            raise PlanError(f"{len(state.block_table)} blocks of {self.block_size} cannot hold {end} tokens")
        self._check_rope(state, end)

    def _check_rope(self, state: SequenceState, end: int) -> None:
        """A sequence on the short LongRoPE factors computes tokens within the switch length only: past it, its
        logits are the long factors' (as transformers computes them), so it must come back on them."""
        if 0 < self.rope_switch_len < end and not state.long_rope:
            raise PlanError(
                f"computes up to token {end} on the short RoPE factors, past their {self.rope_switch_len} tokens "
                "(resend it with long_rope)"
            )
