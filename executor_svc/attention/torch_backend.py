"""Paged attention in plain torch, for CPU (and CUDA without Triton).

KV cache layout per layer: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
Gathering a block table along dim 1 then gives ``[kv_heads, B, L, head_dim]``
contiguous, so decode runs as one batched matmul over (kv head, sequence) with
the GQA group as the query dimension, with no transpose copy.

Decode tokens of all sequences: one gather + masked matmul/softmax/matmul per
layer. Prefill chunks: the SDPA path shared with the C++ backend
(``sdpa_prefill``).

An int8 cache is read by dequantizing what the gather copied (the documented
fallback for machines without the C++ kernels: correct, but it reads the
cache twice, so it is no faster than a bf16 cache).
"""

from __future__ import annotations

import dataclasses

import torch

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.sdpa_prefill import SdpaPrefill, soft_cap
from executor_svc.kv.cache import LayerKV, dequantize_rows, quantize_rows

# Decode sequences are split into at most this many groups of similar context
# length (each padded only to its own longest), when there are enough of them.
MAX_DECODE_GROUPS = 4
MIN_SEQS_PER_GROUP = 8


@dataclasses.dataclass
class DecodeGroup:
    """Decode sequences [start, end) of the batch, padded to a common length."""

    start: int
    end: int
    block_ids: torch.Tensor  # [n * max_blocks], flattened padded block tables
    length: int  # max_blocks * block_size
    mask: torch.Tensor  # [1, n, 1, length] additive, compute dtype


@dataclasses.dataclass
class TorchStepState:
    """Per-step tensors shared by all layers."""

    meta: AttentionMetadata
    decode_groups: list[DecodeGroup]
    gather_buffers: list[torch.Tensor]  # two flat buffers (four with scales), reused by every group and layer
    prefill: SdpaPrefill


class TorchAttentionBackend:
    """Flattened mixed-batch paged attention written with torch ops."""

    name = "torch"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def prepare(self, meta: AttentionMetadata) -> TorchStepState:
        """Builds block-table views and masks once for the step."""
        return TorchStepState(meta, self._decode_groups(meta), [], SdpaPrefill.prepare(meta))

    def _decode_groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        num_decode = meta.num_decode_seqs
        if not num_decode:
            return []
        context_lens = meta.context_lens[:num_decode].tolist()
        order_ok = all(a <= b for a, b in zip(context_lens, context_lens[1:]))
        num_groups = min(MAX_DECODE_GROUPS, max(1, num_decode // MIN_SEQS_PER_GROUP)) if order_ok else 1
        bounds = [round(i * num_decode / num_groups) for i in range(num_groups + 1)]
        groups = []
        for start, end in zip(bounds, bounds[1:]):
            max_blocks = -(-max(context_lens[start:end]) // meta.block_size)
            length = max_blocks * meta.block_size
            ids = meta.block_tables[start:end, :max_blocks].flatten()
            mask = _decode_mask(meta.context_lens[start:end], length, meta.sliding_window, self.dtype)
            groups.append(DecodeGroup(start, end, ids, length, mask))
        return groups

    def forward(
        self,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, KVH, Dh]
        v: torch.Tensor,  # [T, KVH, Dh]
        cache: LayerKV,  # K/V [KVH, NB, BS, Dh] (+ scales)
        state: TorchStepState,
        scale: float,
    ) -> torch.Tensor:  # [T, H * Dh]
        """Writes this step's K/V into the cache, then attends over the cache."""
        write_kv(k, v, cache, state.meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        for group in state.decode_groups:
            rows = slice(group.start, group.end)
            out[rows] = _decode(q[rows], cache, group, state, scale)
        state.prefill.run(q, k, v, cache, scale, out)
        return out.view(num_tokens, num_heads * head_dim)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Stores K/V rows [T, KVH, Dh] at their slots, in place (quantized, with their scales, for an int8 cache)."""
    for rows, dest, dest_scale in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        num_kv_heads, _, _, head_dim = dest.shape
        flat = dest.view(num_kv_heads, -1, head_dim)  # [KVH, NB * BS, Dh]
        rows = rows.transpose(0, 1)  # [KVH, T, Dh]
        if dest_scale is None:
            flat.index_copy_(1, slot_mapping, rows.to(dest.dtype))
            continue
        quantized, row_scale = quantize_rows(rows)
        flat.index_copy_(1, slot_mapping, quantized)
        dest_scale.view(num_kv_heads, -1).index_copy_(1, slot_mapping, row_scale)  # [KVH, NB * BS]


def _decode(q, cache: LayerKV, group: DecodeGroup, state: TorchStepState, scale: float) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[0]
    keys, values = _gather(cache, group, state, q.dtype)  # [KVH, n, L, Dh]
    queries = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [KVH, n, G, Dh]
    scores = torch.matmul(queries * scale, keys.transpose(-1, -2))  # [KVH, n, G, L]
    if state.meta.logit_softcap is not None:
        scores = soft_cap(scores, state.meta.logit_softcap)
    scores += group.mask
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [KVH, n, G, Dh]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _gather(cache: LayerKV, group: DecodeGroup, state: TorchStepState, dtype: torch.dtype):
    """Copies a group's blocks into the step's buffers (index_select is several
    times faster than advanced indexing here); K, V [KVH, n, L, Dh] in ``dtype``."""
    num_kv_heads = cache.k.shape[0]
    parts = (cache.k, cache.v) if cache.k_scale is None else (cache.k, cache.v, cache.k_scale, cache.v_scale)
    if not state.gather_buffers:
        largest = max(g.block_ids.shape[0] for g in state.decode_groups) * num_kv_heads  # (head, block) pairs
        state.gather_buffers = [torch.empty(largest * p[0, 0].numel(), dtype=p.dtype, device=p.device) for p in parts]
    num_seqs, num_ids = group.end - group.start, group.block_ids.shape[0]
    gathered = []
    for part, buffer in zip(parts, state.gather_buffers):
        per_block = part[0, 0].numel()  # BS * Dh rows, or BS scales
        out = buffer[: num_kv_heads * num_ids * per_block].view(num_kv_heads, num_ids, per_block)
        torch.index_select(part.view(num_kv_heads, part.shape[1], per_block), 1, group.block_ids, out=out)
        gathered.append(out.view(num_kv_heads, num_seqs, group.length, -1))  # [KVH, n, L, Dh or 1]
    if len(gathered) == 2:
        return gathered[0].to(dtype), gathered[1].to(dtype)
    keys, values, k_scale, v_scale = gathered
    return dequantize_rows(keys, k_scale[..., 0], dtype), dequantize_rows(values, v_scale[..., 0], dtype)


def _decode_mask(context_lens, length, sliding_window, dtype) -> torch.Tensor:
    """Additive mask [1, D, 1, L]: 0 where a key position is visible, -inf elsewhere."""
    key_pos = torch.arange(length, device=context_lens.device)
    visible = key_pos[None, :] < context_lens[:, None]  # [D, L]
    if sliding_window is not None:
        visible &= key_pos[None, :] >= (context_lens[:, None] - sliding_window)
    mask = torch.zeros(visible.shape, dtype=dtype, device=context_lens.device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[None, :, None, :]
