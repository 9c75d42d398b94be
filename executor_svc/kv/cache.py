"""The paged KV cache: preallocated once, indexed by block id, written in place.

Per layer, K and V are ``[num_kv_heads, num_blocks, block_size, head_dim]``
views of one tensor ``[num_layers, 2, num_kv_heads, num_blocks, block_size,
head_dim]``. Slot ``s = block_id * block_size + offset`` addresses one token.
The scheduler owns which block holds what; this module only stores.

An int8 cache (``--kv-cache-dtype int8``) stores each (token, kv head) row of
K and V as int8 with one fp32 scale beside it, ``row ~ q * scale`` with
``scale = max|row| / 127``: the scales are a second tensor ``[num_layers, 2,
num_kv_heads, num_blocks, block_size]`` indexed like the first. The KV write
path quantizes (``quantize_rows``, or the C++ ``store_kv``); the attention
kernels read the int8 rows and apply the scales themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

# The KV cache budget on the CPU when none is given (--kv-cache-memory).
CPU_DEFAULT_KV_BYTES = 2**30
# KV cache dtypes that store quantized rows plus per-(token, head) scales.
QUANTIZED_KV_DTYPES = (torch.int8,)
SCALE_DTYPE = torch.float32
INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one token's KV over all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        """Whether rows are stored quantized, with a scale per (token, kv head)."""
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers (with their scales when quantized)."""
        row_bytes = self.head_dim * _element_size(self.dtype)
        if self.quantized:
            row_bytes += _element_size(SCALE_DTYPE)
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * row_bytes


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's paged K and V (views of the cache) and, for a quantized cache, their scales."""

    k: torch.Tensor  # [KVH, NB, BS, Dh], the cache dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [KVH, NB, BS] fp32: row = k * k_scale (quantized caches only)
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        """Whether the rows are int8 with scales."""
        return self.k_scale is not None

    def rows(self, block_ids: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` positions of a block table, each [KVH, length, Dh] in ``dtype``."""
        keys = self.k.index_select(1, block_ids).flatten(1, 2)[:, :length]
        values = self.v.index_select(1, block_ids).flatten(1, 2)[:, :length]
        if self.k_scale is None or self.v_scale is None:
            return keys.to(dtype), values.to(dtype)
        k_scale = self.k_scale.index_select(1, block_ids).flatten(1, 2)[:, :length]
        v_scale = self.v_scale.index_select(1, block_ids).flatten(1, 2)[:, :length]
        return dequantize_rows(keys, k_scale, dtype), dequantize_rows(values, v_scale, dtype)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., Dh] -> int8 [..., Dh] and fp32 scales [...], ``rows ~ q * scale``, ``|q| <= 127``.

    The C++ ``store_kv`` computes the same bits: scale = max|row| * (1 / 127),
    q = round-half-even(row * (1 / scale)) (0 for a row of zeros).
    """
    rows = rows.float()
    scale = rows.abs().amax(dim=-1) * (1.0 / INT8_MAX)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    quantized = torch.round(rows * inverse.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scale


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., Dh] times their scales [...] (in fp32), in ``dtype``."""
    return (rows.float() * scale.unsqueeze(-1)).to(dtype)


class KVCache:
    """Preallocated paged K/V storage for every layer."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"KV cache budget leaves {num_blocks} blocks; need at least 1")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
        # Zeroed, so padded block-table entries read finite values (masked out).
        self.storage = torch.zeros(shape, dtype=spec.dtype, device=device)
        # [L, 2, KVH, NB, BS]: the scale of each stored row (quantized caches only).
        self.scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if spec.quantized else None

    @property
    def num_bytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_blocks * self.spec.bytes_per_block

    def layer(self, index: int) -> LayerKV:
        """K and V of one layer, each [KVH, NB, BS, Dh], with their scales [KVH, NB, BS] when quantized."""
        if self.scales is None:
            return LayerKV(self.storage[index, 0], self.storage[index, 1])
        return LayerKV(self.storage[index, 0], self.storage[index, 1], self.scales[index, 0], self.scales[index, 1])

    def block_tensors(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """Every tensor holding per-block state, each with the dim its block ids index: the rows
        [L, 2, KVH, NB, BS, Dh], then for an int8 cache their scales [L, 2, KVH, NB, BS].

        This is everything one block id owns (the offload tier stores and loads exactly these bytes).
        """
        if self.scales is None:
            return ((self.storage, 3),)
        return ((self.storage, 3), (self.scales, 3))

    @property
    def block_nbytes(self) -> int:
        """Bytes one block id owns over all its tensors."""
        return sum(t.select(dim, 0).numel() * t.element_size() for t, dim in self.block_tensors())

    def block_layout(self) -> str:
        """What a block's bytes are, in the order read_blocks lays them out: block size, each tensor's dtype and
        per-block shape (the offload tier's header names it, so a block of another layout is never used)."""
        parts = [f"{dtype_text(t.dtype)}{list(t.select(dim, 0).shape)}" for t, dim in self.block_tensors()]
        return f"block_size={self.spec.block_size};" + ";".join(parts).replace(" ", "")

    def read_blocks(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copies blocks out, one contiguous row of bytes each: out [n, block_nbytes] uint8 (any device)."""
        offset = 0
        for tensor, dim in self.block_tensors():
            per_block = tensor.select(dim, 0)
            nbytes = per_block.numel() * tensor.element_size()
            rows = out[:, offset : offset + nbytes].view(tensor.dtype).view(len(block_ids), *per_block.shape)
            for row, block_id in zip(rows, block_ids):
                row.copy_(tensor.select(dim, block_id), non_blocking=True)
            offset += nbytes

    def write_blocks(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Fills blocks from rows laid out as read_blocks writes them: block_ids [n] int64, data [n, block_nbytes]
        uint8, both on the cache's device (one copy per tensor)."""
        offset = 0
        for tensor, dim in self.block_tensors():
            per_block = tensor.select(dim, 0)
            nbytes = per_block.numel() * tensor.element_size()
            rows = data[:, offset : offset + nbytes].view(tensor.dtype).view(len(block_ids), *per_block.shape)
            tensor.index_copy_(dim, block_ids, rows.movedim(0, dim))
            offset += nbytes

    def token_kv(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [KVH, Dh] stored at one slot, dequantized to fp32 for a quantized cache (tests, debugging)."""
        block_id, offset = divmod(slot, self.spec.block_size)
        cache = self.layer(layer)
        k, v = cache.k[:, block_id, offset], cache.v[:, block_id, offset]
        if cache.k_scale is None or cache.v_scale is None:
            return k, v
        k_scale, v_scale = cache.k_scale[:, block_id, offset], cache.v_scale[:, block_id, offset]
        return dequantize_rows(k, k_scale, torch.float32), dequantize_rows(v, v_scale, torch.float32)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_text(dtype: torch.dtype) -> str:
    """``bfloat16`` for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


# On the CPU a block holds this many bytes of K (and of V) per kv head: a
# page, which the memory system streams best (decode attention reads a block
# per kv head at a time; at 2 KiB per block bf16 SmolLM2 attention ran
# 8-20% slower than at 4 KiB, and 8 KiB gained nothing more).
CPU_BLOCK_BYTES = 4096
DEFAULT_BLOCK_SIZE = 16  # CUDA, and the floor on the CPU


def default_block_size(device: torch.device, head_dim: int, dtype: torch.dtype) -> int:
    """Tokens per KV block when none is asked for: 16 on CUDA; on the CPU, one
    4 KiB page of K per kv head (16 for fp32 with head_dim 64, 32 for bf16, 64 for int8)."""
    if device.type != "cpu":
        return DEFAULT_BLOCK_SIZE
    per_token = head_dim * _element_size(dtype)
    return max(DEFAULT_BLOCK_SIZE, min(128, CPU_BLOCK_BYTES // per_token))


def num_blocks_for_budget(
    spec: KVCacheSpec,
    device: torch.device,
    memory_bytes: int | None,
    memory_fraction: float,
    shared_with: Sequence[KVCacheSpec] = (),
) -> int:
    """Blocks that fit a byte budget; without one, CPU_DEFAULT_KV_BYTES on the CPU, or a
    fraction of the free memory of a CUDA device (after the weights are loaded).

    ``shared_with``: the other caches indexed by the same block ids (a draft model's): a block takes their
    bytes too.
    """
    if memory_bytes is None and device.type == "cpu":
        memory_bytes = CPU_DEFAULT_KV_BYTES
    elif memory_bytes is None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        memory_bytes = int(free * memory_fraction)
    elif memory_bytes is None:
        raise ValueError(f"no default KV cache budget on {device}; give one (--kv-cache-memory)")
    return int(memory_bytes // (spec.bytes_per_block + sum(other.bytes_per_block for other in shared_with)))
