"""What every attention layer of one step needs, built once per step.

The flattened batch holds the decode tokens first (one query token per
sequence), then the prefill chunks (several query tokens per sequence, possibly
starting after a cached prefix). Backends read the same description; each may
derive its own per-step tensors once in ``prepare``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class PrefillSpan:
    """One sequence's chunk of several query tokens inside the flattened batch."""

    seq_index: int  # row in AttentionMetadata.block_tables
    query_start: int  # first row in the flattened tokens
    num_query_tokens: int
    num_cached_tokens: int  # KV already in the cache before this chunk
    num_blocks: int  # blocks covering num_cached_tokens + num_query_tokens

    @property
    def context_len(self) -> int:
        """Tokens this chunk's last query attends to (cached + chunk)."""
        return self.num_cached_tokens + self.num_query_tokens


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """The step's layout of sequences over the flattened tokens.

    Sequences are ordered decode first: sequence ``i < num_decode_seqs`` owns
    flattened token ``i``.
    """

    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [S] int64, cached + scheduled tokens
    query_start_loc: torch.Tensor  # [S + 1] int64, cumulative query tokens
    num_decode_seqs: int
    prefills: tuple[PrefillSpan, ...]
    block_size: int
    # What the layers this copy serves differ in (the runner makes one copy per distinct pair).
    sliding_window: int | None = None  # keys older than this many positions are not seen
    logit_softcap: float | None = None  # scores become cap * tanh(score / cap) before the softmax

    def for_layers(self, sliding_window: int | None, logit_softcap: float | None) -> AttentionMetadata:
        """This step's metadata for layers with this window and soft-cap (itself when both are None)."""
        if sliding_window is None and logit_softcap is None:
            return self
        return dataclasses.replace(self, sliding_window=sliding_window, logit_softcap=logit_softcap)

    @property
    def num_tokens(self) -> int:
        """Number of flattened query tokens."""
        return int(self.slot_mapping.shape[0])
