"""The draft model: a smaller model of the same vocabulary that proposes speculative tokens.

A plan asks for it per sequence (``ScheduledSequence.num_model_draft_tokens``,
docs/speculative-decoding.md): before the step's forward, the draft model runs
K passes (K the count asked), each sampling one more draft, and the drafts
then go through the target's verification as plan-given drafts do. Nothing
else changes: the target's rule (draft j is accepted when row j sampled it)
keeps greedy and seeded outputs what plain decoding gives, whatever is drafted.

KV. The draft model has its own paged KV cache, indexed by the same block ids
as the target's and sized from the same block count: the scheduler's one pool
accounts for both (Describe reports the split), no allocation decision is new,
and rejected drafts roll back by the target's rule. The draft's KV is filled
lazily, only for sequences that draft: each sequence's ``num_draft_computed``
counts the leading tokens whose draft KV is in its blocks, and a drafting
sequence first catches up on the tokens after them (its prompt, the tokens
of steps it did not draft in) in the first pass, as a prefill chunk. So a step
without model drafts costs nothing more (at large batch, where speculation is
off, the draft model never runs).

Blocks shared through the prefix cache: a block's draft KV is known valid
(``_full``) once a sequence's draft has computed all of the block's tokens
and the target confirmed them; a block given anew by a plan (a new block of a
sequence, a new sequence's blocks after its prefix-cache hits) is forgotten,
as the target is about to write other tokens there. A new sequence starts its
draft KV after the leading hit blocks known valid, and recomputes the rest
(writing the same tokens' KV into shared blocks, which is what they hold).
Blocks filled from the offload tier (a new sequence's ``loads``) hold the
model's KV only: they are forgotten too, and the draft recomputes them.
Preemption, executor loss and resumed streams bring sequences back as new
ones, so this one rule covers them. A wrong guess here could only cost
acceptance, never a token: the target verifies every draft.

Sampling. By default a draft is sampled as the target samples: the request's
own parameters and its (seed, position) random stream (Gumbel noise), so
where the draft model's distribution is close to the target's, both pick the
same token and the draft is accepted (greedy requests draft greedily).
``coupled=False`` drafts greedily for every request (bench/bench_draft_sampling.py
compares the two).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from executor_svc.attention.layer_states import LayerStates
from executor_svc.kv.cache import KVCache
from executor_svc.loading.model_config import ModelConfig
from executor_svc.loading.weights import load_checkpoint, validate_tensors
from executor_svc.models import DecoderModel, get_model_family
from executor_svc.models.layer_ops import LayerOps
from executor_svc.models.registry import parse_model_config
from executor_svc.models.rope import rope_switch_len
from executor_svc.runner.step_batch import build_step_batch
from executor_svc.sampling.sampler import SampleRequest, sample
from executor_svc.serving.sequence_table import SequenceState
from pagoda.params import SamplingParams
from pagoda.step import StepPlan


@dataclasses.dataclass
class DraftCheckpoint:
    """A draft model's weights on the device, before its KV cache is sized."""

    name: str
    config: ModelConfig
    model: DecoderModel
    # Rows of one factor set in its RoPE tables when it has a LongRoPE switch (else 0): a sequence the target
    # runs on the long factors drafts on the draft model's long ones, so a block's draft KV has one set too.
    rope_offset: int = 0


def load_draft_checkpoint(
    path: str, dtype: torch.dtype, device: torch.device, max_model_len: int, ops: LayerOps
) -> DraftCheckpoint:
    """Reads and builds the draft model of ``path`` (any supported family), for contexts up to max_model_len."""
    checkpoint = load_checkpoint(path)
    config = parse_model_config(checkpoint.config)
    family = get_model_family(config.architecture)
    tensors = validate_tensors(config, checkpoint.tensors)
    model = family.build(config, tensors, dtype, device, max_model_len, ops)
    rope_offset = max_model_len if rope_switch_len(config, max_model_len) else 0
    return DraftCheckpoint(checkpoint.name, config, model, rope_offset)


class DraftModel:
    """The draft model, its KV cache (the target's block ids) and which blocks hold valid draft KV."""

    def __init__(
        self,
        checkpoint: DraftCheckpoint,
        kv_cache: KVCache,
        backend,
        target_vocab_size: int,
        coupled: bool = True,
    ) -> None:
        self.name = checkpoint.name
        self.config = checkpoint.config
        self.model = checkpoint.model
        self.rope_offset = checkpoint.rope_offset
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = kv_cache.spec.block_size
        self.device = kv_cache.storage.device
        # Drafts are target token ids: a larger draft vocabulary (padding) is cut; ids past a smaller one are
        # clamped on input (only a proposal can suffer).
        self.vocab_size = min(target_vocab_size, self.config.vocab_size)
        self._clamp_input_ids = self.config.vocab_size < target_vocab_size
        self.coupled = coupled
        self._layer_states = LayerStates(self.config.layers)
        # Per block id: 1 when the draft KV of all its tokens is valid for what the block holds.
        self._full = bytearray(kv_cache.num_blocks)
        # This step's drafting sequences, with their num_draft_computed before it.
        self._proposed: list[tuple[SequenceState, int]] = []

    # -- blocks ---------------------------------------------------------------

    def follow(self, step: StepPlan, seqs: dict[int, SequenceState]) -> None:
        """After the runner applied ``step``: forgets blocks given anew, starts new sequences' draft KV."""
        block_size = self.block_size
        for entry in step.scheduled_seqs:
            self._forget(entry.new_block_ids)
        for new in step.new_seqs:
            state = seqs.get(new.seq_id)
            if state is None:  # refused
                continue
            num_hit_blocks = new.num_computed_tokens // block_size
            self._forget(state.block_table[num_hit_blocks:])
            # Blocks filled from the offload tier hold the model's KV only.
            self._forget(load.block_id for load in new.loads)
            state.num_draft_computed = block_size * self._num_leading_full(state.block_table[:num_hit_blocks])

    def reset(self) -> None:
        """Forgets every block (a new scheduler stream starts from an empty cache)."""
        self._full = bytearray(self.kv_cache.num_blocks)
        self._proposed = []

    def _forget(self, block_ids: Iterable[int]) -> None:
        full, num_blocks = self._full, len(self._full)
        for block_id in block_ids:
            if 0 <= block_id < num_blocks:
                full[block_id] = 0

    def _num_leading_full(self, block_ids: list[int]) -> int:
        for i, block_id in enumerate(block_ids):
            if not self._full[block_id]:
                return i
        return len(block_ids)

    # -- proposing ------------------------------------------------------------

    def propose(self, states: list[SequenceState]) -> None:
        """Sets each state's draft_token_ids: num_model_draft_tokens tokens, one draft pass per token.

        The first pass computes each sequence's draft KV from num_draft_computed to its last known token and
        samples the first draft there; each later pass computes the previous draft and samples the next.
        """
        self._proposed = [(state, state.num_draft_computed) for state in states]
        drafts: dict[int, list[int]] = {state.seq_id: [] for state in states}
        rows = [
            (self._view(s, s.token_ids, s.num_draft_computed), len(s.token_ids) - s.num_draft_computed) for s in states
        ]
        while rows:
            for seq_id, token_id in self._run_pass(rows):
                drafts[seq_id].append(token_id)
            rows = []
            for state in states:
                proposed = drafts[state.seq_id]
                if len(proposed) < state.num_model_draft_tokens:
                    token_ids = state.token_ids + proposed
                    rows.append((self._view(state, token_ids, len(token_ids) - 1), 1))
        for state in states:
            state.draft_token_ids = tuple(drafts[state.seq_id])
            # The last draft's own KV is not computed (no pass after it).
            state.num_draft_computed = len(state.token_ids) + len(state.draft_token_ids) - 1

    def confirm(self) -> None:
        """After the target's verification: keeps the draft KV of accepted tokens only, marks full blocks valid."""
        block_size, full = self.block_size, self._full
        for state, num_before in self._proposed:
            state.num_draft_computed = min(state.num_draft_computed, state.num_computed_tokens)
            for index in range(num_before // block_size, state.num_draft_computed // block_size):
                full[state.block_table[index]] = 1
        self._proposed = []

    def abandon(self) -> None:
        """After a step that failed: its sequences are dropped, nothing to confirm."""
        self._proposed = []

    def _view(self, state: SequenceState, token_ids: list[int], num_computed: int) -> SequenceState:
        """The sequence as one draft pass sees it: ``token_ids`` known, ``num_computed`` in the draft KV."""
        return SequenceState(
            state.seq_id,
            state.request_id,
            token_ids,
            state.num_prompt_tokens,
            self._draft_sampling(state.sampling),
            state.block_table,
            num_computed,
            long_rope=state.long_rope,
        )

    def _draft_sampling(self, params: SamplingParams) -> SamplingParams:
        """How a draft is picked: the request's own sampling (coupled) or greedy; never with logprobs."""
        if not self.coupled:
            return dataclasses.replace(params, temperature=0.0, logprobs=None)
        return params if params.logprobs is None else dataclasses.replace(params, logprobs=None)

    def _run_pass(self, rows: list[tuple[SequenceState, int]]) -> list[tuple[int, int]]:
        """One forward of the draft model over ``rows``; (seq_id, sampled token) of each."""
        batch = build_step_batch(rows, self.block_size, self.device, rope_offset=self.rope_offset)
        if self._clamp_input_ids:
            batch.input_ids.clamp_(max=self.config.vocab_size - 1)
        layer_states = self._layer_states.prepare(self.backend, batch.attn_meta)
        hidden = self.model.forward(batch.input_ids, batch.rope_rows, self.kv_cache, self.backend, layer_states)
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [N, V_draft]
        if logits.shape[-1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        logits = logits.float().contiguous()  # [N, V]
        views = batch.sample_states
        requests = [SampleRequest(v.sampling, v.token_ids, v.num_prompt_tokens) for v in views]
        sampled = sample(logits, requests, self.model.ops.argmax)
        return [(view.seq_id, out.token_id) for view, out in zip(views, sampled)]

    # -- start-up ---------------------------------------------------------------

    def block_state(self) -> bytes:
        """Which blocks hold valid draft KV (the warm-up restores it with the cache's contents)."""
        return bytes(self._full)

    def restore_block_state(self, state: bytes) -> None:
        """Sets which blocks hold valid draft KV back to ``state`` (from block_state)."""
        self._full = bytearray(state)
