"""Paged attention as a Triton kernel, for CUDA (imported only when chosen).

One program per (query token, KV head) handles the GQA group of query heads of
that token: it walks the token's blocks from its block table with an online
softmax, reading K/V straight from the paged cache (no gather). Decode tokens
and prefill chunks (with or without cached prefix) take the same path, since
each token carries its own position. Sliding windows and soft-capped scores
(Gemma 2) are compile-time switches of the kernel. K/V of the step are written first, with
the same slot-mapping write as the torch backend. An int8 cache is a third switch: the kernel
loads int8 rows and multiplies each by its (token, head) scale as it loads it (no separate
dequantize pass); the write quantizes as the C++ store does (``kv_cache.quantize_rows``).

It is batch-invariant as written: each (token, KV head) is one program that walks
its keys block by block from position 0 in one order, never split across
programs, so a row's bits do not depend on the rest of the step
(``batch_invariant`` only records that it was asked for).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import write_kv
from executor_svc.kv.cache import LayerKV


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    block_tables_ptr,
    seq_of_token_ptr,
    positions_ptr,
    scale,
    window,
    softcap,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_h,
    stride_c_b,
    stride_c_s,
    stride_s_h,
    stride_s_b,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_of_token_ptr + token)
    pos = tl.load(positions_ptr + token)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token * stride_q_t + heads[:, None] * stride_q_h + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * scale  # [GROUP_PAD, DIM_PAD]
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    first_pos = 0
    if USE_WINDOW:
        first_pos = tl.maximum(pos - window + 1, 0)
    offs = tl.arange(0, BLOCK_PAD)
    for block in range(first_pos // BLOCK_SIZE, pos // BLOCK_SIZE + 1):
        block_id = tl.load(block_tables_ptr + seq * stride_bt + block).to(tl.int64)
        key_pos = block * BLOCK_SIZE + offs
        valid = (offs < BLOCK_SIZE) & (key_pos <= pos) & (key_pos >= first_pos)  # [BLOCK_PAD]
        kv_offsets = kv_head * stride_c_h + block_id * stride_c_b + offs[:, None] * stride_c_s + d[None, :]
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0).to(tl.float32)  # [BLOCK_PAD, DIM_PAD]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0).to(tl.float32)
        if QUANTIZED:  # int8 rows times their scales [BLOCK_PAD]
            scale_offsets = kv_head * stride_s_h + block_id * stride_s_b + offs
            k = k * tl.load(k_scale_ptr + scale_offsets, mask=valid, other=0.0)[:, None]
            v = v * tl.load(v_scale_ptr + scale_offsets, mask=valid, other=0.0)[:, None]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_PAD]
        if USE_SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 2 * sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


@dataclasses.dataclass
class TritonStepState:
    """Per-step tensors shared by all layers."""

    meta: AttentionMetadata
    seq_of_token: torch.Tensor  # [T] int32, row of block_tables
    positions: torch.Tensor  # [T] int32, position of each query token
    block_tables: torch.Tensor  # [S, max_blocks] int32


class TritonAttentionBackend:
    """Paged attention with a Triton kernel reading the cache in place."""

    name = "triton"

    def __init__(self, dtype: torch.dtype, batch_invariant: bool = False):
        self.dtype = dtype
        self.batch_invariant = batch_invariant

    def prepare(self, meta: AttentionMetadata) -> TritonStepState:
        """Token -> sequence and token -> position maps, once per step."""
        counts = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [S]
        seq_of_token = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
        token_index = torch.arange(meta.num_tokens, device=counts.device)
        # A token's position: its sequence's context length minus tokens after it.
        positions = meta.context_lens[seq_of_token] - (meta.query_start_loc[1:][seq_of_token] - token_index)
        return TritonStepState(meta, seq_of_token.int(), positions.int(), meta.block_tables.int().contiguous())

    def forward(self, q, k, v, cache: LayerKV, state: TritonStepState, scale: float) -> torch.Tensor:
        """Writes the step's K/V, then runs the kernel; returns [T, H * Dh]."""
        write_kv(k, v, cache, state.meta.slot_mapping)
        k_cache, v_cache = cache.k, cache.v
        # Without scales the kernel's scale pointers are never read (QUANTIZED is off): pass the cache.
        k_scale = cache.k_scale if cache.k_scale is not None else k_cache
        v_scale = cache.v_scale if cache.v_scale is not None else v_cache
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, _, block_size, _ = k_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        window, softcap = state.meta.sliding_window, state.meta.logit_softcap
        _paged_attention_kernel[(num_tokens, num_kv_heads)](
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            out,
            state.block_tables,
            state.seq_of_token,
            state.positions,
            scale,
            window or 0,
            softcap or 0.0,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_scale.stride(0),
            k_scale.stride(1),
            state.block_tables.stride(0),
            GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group),
            HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_PAD=triton.next_power_of_2(block_size),
            USE_WINDOW=window is not None,
            USE_SOFTCAP=softcap is not None,
            QUANTIZED=cache.quantized,
        )
        return out.view(num_tokens, num_heads * head_dim)
