"""Prefill chunks with torch's scaled_dot_product_attention: the one fallback the CPU backends share.

One SDPA call per chunk. A chunk with no cached prefix (and no sliding window
narrower than itself) attends to its own fresh K/V with ``is_causal`` (no
gather, no mask); otherwise its context is gathered from the paged cache and
a boolean mask says which key each query sees. SDPA has no soft-cap, so
soft-capped layers (Gemma 2) run the same product, cap and softmax as
separate torch ops, rounded as transformers' eager attention rounds them.
With an int8 cache every chunk reads its context from the cache, dequantized
as it is gathered, so attention sees the same rows whatever the chunking (the
fallback where the AMX kernel cannot run: fp32 models, CPUs without AMX).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from executor_svc.attention.metadata import AttentionMetadata, PrefillSpan
from executor_svc.kv.cache import LayerKV


@dataclasses.dataclass
class SdpaPrefill:
    """The step's prefill chunks and what SDPA needs for each, built once per step."""

    spans: tuple[PrefillSpan, ...]
    masks: list[torch.Tensor | None]  # per span: [n, ctx] bool, None = plain causal over the chunk itself
    block_ids: list[torch.Tensor]  # per span: [num_blocks]
    logit_softcap: float | None = None

    @classmethod
    def prepare(cls, meta: AttentionMetadata, spans: tuple[PrefillSpan, ...] | None = None) -> SdpaPrefill:
        """Block-table views and masks of every prefill span (or of ``spans``, some of them)."""
        spans = meta.prefills if spans is None else spans
        masks: list[torch.Tensor | None] = []
        block_ids = []
        device = meta.slot_mapping.device
        for span in spans:
            block_ids.append(meta.block_tables[span.seq_index, : span.num_blocks])
            plain = span.num_cached_tokens == 0 and (
                meta.sliding_window is None or span.num_query_tokens <= meta.sliding_window
            )
            plain = plain and meta.logit_softcap is None  # the capped path always takes a mask
            masks.append(
                None if plain else _mask(span.num_cached_tokens, span.num_query_tokens, meta.sliding_window, device)
            )
        return cls(tuple(spans), masks, block_ids, meta.logit_softcap)

    def run(
        self,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, KVH, Dh], this step's keys (already in the cache too)
        v: torch.Tensor,  # [T, KVH, Dh]
        cache: LayerKV,  # [KVH, NB, BS, Dh] (+ scales)
        scale: float,
        out: torch.Tensor,  # [T, H, Dh], the prefill rows are written
    ) -> None:
        """Attends every prefill chunk over its cached prefix and itself."""
        for span, mask, block_ids in zip(self.spans, self.masks, self.block_ids):
            rows = slice(span.query_start, span.query_start + span.num_query_tokens)
            context = (cache, span.context_len, mask, block_ids)
            out[rows] = _attend(q[rows], k[rows], v[rows], *context, scale, self.logit_softcap)


def _attend(q, k, v, cache: LayerKV, context_len, mask, block_ids, scale, softcap) -> torch.Tensor:
    """Causal attention of one chunk q [n, H, Dh] over its context; returns [n, H, Dh]."""
    if mask is None and not cache.quantized:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, n, Dh]
    else:
        keys, values = cache.rows(block_ids, context_len, q.dtype)  # [KVH, ctx, Dh]
    if softcap is not None:
        return _attend_capped(q, keys, values, mask, scale, softcap)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, n, Dh]
    return out[0].transpose(0, 1)


def _attend_capped(q, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """q [n, H, Dh] over keys/values [KVH, ctx, Dh] with scores soft-capped; mask [n, ctx] bool. -> [n, H, Dh]."""
    group = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, ctx, Dh]
    scores = soft_cap(torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale, softcap)  # [H, n, ctx]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)  # [n, H, Dh]


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in transformers' order of operations."""
    return torch.tanh(scores / cap) * cap


def _mask(num_cached: int, num_query: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean mask [n, ctx]: query i (position num_cached + i) sees key j."""
    query_pos = torch.arange(num_cached, num_cached + num_query, device=device)[:, None]
    key_pos = torch.arange(num_cached + num_query, device=device)[None, :]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return visible
