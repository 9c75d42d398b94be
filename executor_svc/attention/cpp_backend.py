"""CPU paged attention with our C++ kernels.

Decode tokens read K/V in place from the paged cache (no gather copy; one
pass with an online softmax, see cpu_kernel.cpp). bf16 prefill chunks run the
flash-attention kernel (cpu_prefill.cpp) on AMX tiles, or on AVX512-BF16 dot
products where the CPU has no AMX, also reading K/V from the cache; other
prefill chunks (fp32, head dims other than 64, 128 and 256, neither) of a
context of up to ``TOKEN_ROWS_MAX_CONTEXT`` tokens run the decode kernel, each
query token a row of its own over its keys (1.4-2.4x SDPA's time at 128-512
tokens on AVX2, where no prefill kernel runs; SDPA gathers and, for an int8
cache, dequantizes the whole context first); longer ones take the SDPA path
shared with the torch backend (``sdpa_prefill``), which re-reads K/V less
(0.75-0.9x the row-wise time at 1,024 tokens). Both kernels take the layer's sliding window and
attention soft-cap (Gemma 2), as the SDPA path does. The step's K/V rows are
stored by the kernel too (one small C++ loop instead of two index_copy_ of
transposed views per layer). An int8 cache is quantized by that store and
read as int8 by both kernels, which apply the per-(token, head) scales
themselves; SDPA prefill dequantizes what it gathers.

Batch-invariant (``batch_invariant=True``, docs/durability.md): every query row,
decode or prefill or a speculative verify row, runs the decode kernel as a row
of its own, over keys 0..its position in one pass (the KV axis never split),
so a row's bits depend on its sequence's tokens alone: not on the batch, the
chunk size, or whether its prefix came from the cache. Prefill rows then read
their keys once per row instead of once per 16-row tile (about twice the
prefill kernel's attention time; bench/bench_batch_invariant.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from executor_svc.attention import cpu_kernel
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.sdpa_prefill import SdpaPrefill
from executor_svc.kv.cache import LayerKV

# Prefill chunks without the prefill kernel whose context (cached + new tokens) is at most this run as decode
# rows (bench/roofline.py and the module docstring: faster than SDPA up to 512 on AVX2, slower from 1,024).
TOKEN_ROWS_MAX_CONTEXT = 512


def load_kernels(dtype: torch.dtype) -> tuple[Any, Any | None]:
    """The decode kernels, and for bf16 models the prefill kernel when the loaded variant has it and this
    process may run it: AMX tiles, or AVX512-BF16 dot products without AMX (else None: SDPA).

    Raises:
        KernelsUnavailable: the kernels are not installed or do not load here (the message says why).
    """
    ops = cpu_kernel.load()
    if dtype != torch.bfloat16 or not ops.bf16_kernels_ready():
        return ops, None
    return ops, ops


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this backend cannot run here, or None."""
    if device.type != "cpu":
        return "needs the CPU device"
    if not cpu_kernel.is_built():
        return "needs the pagoda-kernels library (make install builds it; the log says why it did not load)"
    return None


@dataclasses.dataclass
class CppStepState:
    """Per-step tensors shared by all layers."""

    meta: AttentionMetadata
    sdpa: SdpaPrefill  # the prefill fallback
    block_tables: torch.Tensor  # [D, max_blocks] int64, contiguous
    context_lens: torch.Tensor  # [D] int64
    prefill_spans: torch.Tensor | None  # [P, 4] int64 for the prefill kernel (bf16 models), else None
    # Batch-invariant: every token is a decode row (block_tables and context_lens are then per token, [T]).
    rows_per_token: bool = False
    # Without a prefill kernel: the decode rows then every short prefill chunk's tokens (their indices in q),
    # each a decode row of block_tables / context_lens; the long chunks go to ``sdpa``. None: not used.
    token_rows: torch.Tensor | None = None
    # Whether decode may split a row's keys over threads (not when batch-invariant; cpu_kernel.cpp).
    split_kv: bool = True


class CppAttentionBackend:
    """CPU paged attention: C++ decode kernel, C++ prefill kernel (AMX or AVX512-BF16) or the shared SDPA prefill."""

    name = "cpp"

    def __init__(self, dtype: torch.dtype, batch_invariant: bool = False):
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.kernel, self.prefill_kernel = load_kernels(dtype)

    def prepare(self, meta: AttentionMetadata) -> CppStepState:
        """Decode block tables and lengths once for the step."""
        num_decode = meta.num_decode_seqs
        if self.batch_invariant and meta.prefills:
            tables, lens = _token_rows(meta, meta.prefills)
            assert len(lens) == len(meta.slot_mapping), "prefill rows follow the decode rows in order"
            return CppStepState(meta, SdpaPrefill((), [], []), tables, lens, None, rows_per_token=True, split_kv=False)
        if meta.prefills and self.prefill_kernel is None:
            short = [s for s in meta.prefills if s.context_len <= TOKEN_ROWS_MAX_CONTEXT]
            if short:
                long = tuple(s for s in meta.prefills if s.context_len > TOKEN_ROWS_MAX_CONTEXT)
                tables, lens = _token_rows(meta, short)
                rows = torch.cat(
                    [torch.arange(num_decode)]
                    + [torch.arange(s.query_start, s.query_start + s.num_query_tokens) for s in short]
                )
                if not long and torch.equal(rows, torch.arange(len(meta.slot_mapping))):
                    return CppStepState(meta, SdpaPrefill((), [], []), tables, lens, None, rows_per_token=True)
                return CppStepState(meta, SdpaPrefill.prepare(meta, long), tables, lens, None, token_rows=rows)
        spans = None
        if meta.prefills and self.prefill_kernel is not None:
            spans = torch.tensor(
                [(s.query_start, s.num_query_tokens, s.num_cached_tokens, s.seq_index) for s in meta.prefills],
                dtype=torch.int64,
            )
        return CppStepState(
            meta=meta,
            sdpa=SdpaPrefill.prepare(meta),
            block_tables=meta.block_tables[:num_decode].contiguous(),
            context_lens=meta.context_lens[:num_decode].contiguous(),
            prefill_spans=spans,
            split_kv=not self.batch_invariant,
        )

    def forward(self, q, k, v, cache: LayerKV, state: CppStepState, scale: float) -> torch.Tensor:
        """Writes this step's K/V, then attends; returns [T, H * Dh]."""
        meta = state.meta
        scales = (cache.k_scale, cache.v_scale)  # None, None unless the cache is int8
        self.kernel.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, *scales)
        num_tokens, num_heads, head_dim = q.shape
        num_decode = meta.num_decode_seqs
        window, softcap = meta.sliding_window or 0, meta.logit_softcap or 0.0
        decode_args = (cache.k, cache.v, state.block_tables, state.context_lens, scale, window, softcap, *scales)
        if not meta.prefills or state.rows_per_token:
            out = self.kernel.paged_decode(q, *decode_args, split_kv=state.split_kv)
            return out.view(num_tokens, num_heads * head_dim)
        if state.token_rows is not None:  # some of the rows: the others are long chunks' (SDPA)
            rows = state.token_rows
            out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
            decoded = self.kernel.paged_decode(q.index_select(0, rows), *decode_args, split_kv=state.split_kv)
            out.index_copy_(0, rows, decoded)
            state.sdpa.run(q, k, v, cache, scale, out)
            return out.view(num_tokens, num_heads * head_dim)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if num_decode:
            out[:num_decode] = self.kernel.paged_decode(q[:num_decode], *decode_args, split_kv=state.split_kv)
        if state.prefill_spans is not None and _prefill_fits(q, cache.k):
            spans = state.prefill_spans
            self.prefill_kernel.paged_prefill(
                q, cache.k, cache.v, meta.block_tables, spans, scale, out, window, softcap, *scales
            )
        else:
            state.sdpa.run(q, k, v, cache, scale, out)
        return out.view(num_tokens, num_heads * head_dim)


def _token_rows(meta: AttentionMetadata, spans) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table [R, max_blocks], context length [R]) of the decode rows, then every token of ``spans`` (in
    order) as a decode row of its own: a prefill row at position p sees keys 0..p through its sequence's table."""
    num_decode = meta.num_decode_seqs
    seq_rows = [torch.arange(num_decode, dtype=torch.int64)]
    lens = [meta.context_lens[:num_decode]]
    for span in spans:
        seq_rows.append(torch.full((span.num_query_tokens,), span.seq_index, dtype=torch.int64))
        first = span.num_cached_tokens + 1
        lens.append(torch.arange(first, first + span.num_query_tokens, dtype=torch.int64))
    rows = torch.cat(seq_rows)
    return meta.block_tables.index_select(0, rows).contiguous(), torch.cat(lens).to(torch.int64).contiguous()


def _prefill_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The prefill kernel's shapes: bf16 queries, a bf16 or int8 cache, head_dim 64, 128 or 256 (Gemma)."""
    cache_fits = k_cache.dtype in (torch.bfloat16, torch.int8)
    return q.dtype == torch.bfloat16 and cache_fits and q.shape[-1] in (64, 128, 256)
