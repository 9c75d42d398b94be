"""The paged KV cache: preallocated once, indexed by block id, written in place.

Per layer, K and V are ``[num_kv_heads, num_blocks, block_size, head_dim]``
views of one tensor ``[num_layers, 2, num_kv_heads, num_blocks, block_size,
head_dim]``. Slot ``s = block_id * block_size + offset`` addresses one token.
The scheduler owns which block holds what; this module only stores.
"""

from __future__ import annotations

import dataclasses

import torch

# The KV cache budget on the CPU when none is given (--kv-cache-memory).
CPU_DEFAULT_KV_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one token's KV over all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element_size


class KVCache:
    """Preallocated paged K/V storage for every layer."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        if num_blocks < 1:
            raise ValueError(f"KV cache budget leaves {num_blocks} blocks; need at least 1")
        self.spec = spec
        self.num_blocks = num_blocks
        # Zeroed, so padded block-table entries read finite values (masked out).
        self.storage = torch.zeros(
            spec.num_layers,
            2,
            spec.num_kv_heads,
            num_blocks,
            spec.block_size,
            spec.head_dim,
            dtype=spec.dtype,
            device=device,
        )

    @property
    def num_bytes(self) -> int:
        """Bytes of the whole cache."""
        return self.num_blocks * self.spec.bytes_per_block

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [KVH, NB, BS, Dh]."""
        return self.storage[index, 0], self.storage[index, 1]

    def block_tensors(self) -> tuple[tuple[torch.Tensor, int], ...]:
        """Every tensor holding per-block state, each with the dim its block ids index.

        This is everything one block id owns (the offload tier stores and loads exactly these bytes);
        a cache that keeps more per block (e.g. quantization scales) lists those tensors here too.
        """
        return ((self.storage, 3),)

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
        """K and V [KVH, Dh] stored at one slot (for tests and debugging)."""
        block_id, offset = divmod(slot, self.spec.block_size)
        k_cache, v_cache = self.layer(layer)
        return k_cache[:, block_id, offset], v_cache[:, block_id, offset]


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
    4 KiB page of K per kv head (16 for fp32 with head_dim 64, 32 for bf16)."""
    if device.type != "cpu":
        return DEFAULT_BLOCK_SIZE
    per_token = head_dim * torch.empty((), dtype=dtype).element_size()
    return max(DEFAULT_BLOCK_SIZE, min(128, CPU_BLOCK_BYTES // per_token))


def num_blocks_for_budget(
    bytes_per_block: int,
    device: torch.device,
    memory_bytes: int | None,
    memory_fraction: float,
) -> int:
    """Blocks of ``bytes_per_block`` (every cache indexed by the block ids) that fit a byte budget; without
    one, CPU_DEFAULT_KV_BYTES on the CPU, or a fraction of the free memory of a CUDA device (after the
    weights are loaded)."""
    if memory_bytes is None and device.type == "cpu":
        memory_bytes = CPU_DEFAULT_KV_BYTES
    elif memory_bytes is None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        memory_bytes = int(free * memory_fraction)
    elif memory_bytes is None:
        raise ValueError(f"no default KV cache budget on {device}; give one (--kv-cache-memory)")
    return int(memory_bytes // bytes_per_block)
