"""The host-memory tier: blocks in one preallocated slab of host memory (pinned on CUDA), LRU by bytes.

In front of the disk tier on a GPU: a hit is a copy from pinned memory instead
of a file read. Every block has the same size (one layout per tier), so the
slab is ``[num_slots, block_nbytes]`` and LRU by bytes is LRU by slots. Not
thread-safe on its own: the store calls it under its lock.
"""

from __future__ import annotations

import collections

import torch


class MemoryTier:
    """At most ``capacity_bytes`` of blocks of ``block_nbytes`` each in host memory."""

    def __init__(self, capacity_bytes: int, block_nbytes: int, pin: bool) -> None:
        num_slots = capacity_bytes // block_nbytes
        if num_slots < 1:
            raise ValueError(f"--kv-offload-memory {capacity_bytes} B holds no block (one is {block_nbytes} B)")
        self.block_nbytes = block_nbytes
        # [num_slots, block_nbytes] uint8
        self._slab = torch.empty((num_slots, block_nbytes), dtype=torch.uint8, pin_memory=pin)
        # block hash -> slot, least recently used first.
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return int(self._slab.shape[0])

    @property
    def num_bytes(self) -> int:
        return len(self._slots) * self.block_nbytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def hashes(self) -> list[int]:
        return list(self._slots)

    def put(self, block_hash: int, row: torch.Tensor) -> int | None:
        """Stores a block's bytes (row [block_nbytes] uint8, host); returns the hash it evicted, if any."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        evicted = None
        if not self._free:
            evicted, slot = self._slots.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._slab[slot].copy_(row)
        self._slots[block_hash] = slot
        return evicted

    def copy_to(self, block_hash: int, out: torch.Tensor) -> bool:
        """Copies a block into out [block_nbytes] uint8 and marks it recently used; False when not held."""
        slot = self._slots.get(block_hash)
        if slot is None:
            return False
        self._slots.move_to_end(block_hash)
        out.copy_(self._slab[slot])
        return True

    def remove(self, block_hash: int) -> bool:
        slot = self._slots.pop(block_hash, None)
        if slot is None:
            return False
        self._free.append(slot)
        return True
