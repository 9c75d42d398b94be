"""The torch backend with attention done by our C++ kernels.

Decode tokens read K/V in place from the paged cache (no gather copy; one
pass with an online softmax, see cpu_kernel.cpp). bf16 prefill chunks run the
AMX flash-attention kernel (cpu_prefill.cpp) where the CPU has AMX, also
reading K/V from the cache; otherwise, and with a sliding window, prefill
keeps the torch SDPA path. The step's K/V rows are stored by the kernel too
(one small C++ loop instead of two index_copy_ of transposed views per layer).
"""

from __future__ import annotations

import dataclasses

import torch

from executor_svc.attention import cpu_kernel
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import TorchAttentionBackend, TorchStepState, _prefill


@dataclasses.dataclass
class CppStepState:
    """Per-step tensors shared by all layers."""

    meta: AttentionMetadata
    torch_state: TorchStepState  # prefill spans only
    block_tables: torch.Tensor  # [D, max_blocks] int64, contiguous
    context_lens: torch.Tensor  # [D] int64
    prefill_spans: torch.Tensor | None  # [P, 4] int64 for the AMX prefill kernel (bf16 caches), else None


class CppAttentionBackend(TorchAttentionBackend):
    """CPU paged attention: C++ decode kernel, torch prefill."""

    name = "cpp"

    def __init__(self, dtype: torch.dtype):
        super().__init__(dtype)
        self.kernel = cpu_kernel.load()
        self.prefill_kernel = _amx_prefill() if dtype == torch.bfloat16 else None

    def prepare(self, meta: AttentionMetadata) -> CppStepState:
        """Decode block tables and lengths once for the step."""
        num_decode = meta.num_decode_seqs
        spans = None
        if meta.prefills and self.prefill_kernel is not None and meta.sliding_window is None:
            spans = torch.tensor(
                [(s.query_start, s.num_query_tokens, s.num_cached_tokens, s.seq_index) for s in meta.prefills],
                dtype=torch.int64,
            )
        return CppStepState(
            meta=meta,
            torch_state=super().prepare(dataclasses.replace(meta, num_decode_seqs=0)),
            block_tables=meta.block_tables[:num_decode].contiguous(),
            context_lens=meta.context_lens[:num_decode].contiguous(),
            prefill_spans=spans,
        )

    def forward(self, q, k, v, k_cache, v_cache, state: CppStepState, scale: float) -> torch.Tensor:
        """Writes this step's K/V, then attends; returns [T, H * Dh]."""
        meta = state.meta
        self.kernel.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_decode = meta.num_decode_seqs
        if not meta.prefills:
            out = self.kernel.paged_decode(
                q, k_cache, v_cache, state.block_tables, state.context_lens, scale, meta.sliding_window or 0
            )
            return out.view(num_tokens, num_heads * head_dim)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if num_decode:
            out[:num_decode] = self.kernel.paged_decode(
                q[:num_decode],
                k_cache,
                v_cache,
                state.block_tables,
                state.context_lens,
                scale,
                meta.sliding_window or 0,
            )
        if state.prefill_spans is not None and _prefill_fits(q, k_cache):
            self.prefill_kernel.paged_prefill(q, k_cache, v_cache, meta.block_tables, state.prefill_spans, scale, out)
            return out.view(num_tokens, num_heads * head_dim)
        torch_state = state.torch_state
        for span, mask, block_ids in zip(meta.prefills, torch_state.prefill_masks, torch_state.prefill_block_ids):
            rows = slice(span.query_start, span.query_start + span.num_query_tokens)
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span.context_len, mask, block_ids, scale)
        return out.view(num_tokens, num_heads * head_dim)


def _amx_prefill():
    """The kernels' AMX prefill when the loaded variant has it and this process may use AMX, else None."""
    kernel = cpu_kernel.load()
    return kernel if kernel.amx_ready() else None


def _prefill_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The AMX prefill kernel's shapes: bf16 queries and cache, head_dim 64 or 128."""
    return q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)
