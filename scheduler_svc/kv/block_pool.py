"""KV blocks as metadata, their free list, and the prefix-cache map.

A block is an id into the executor's KV tensors plus bookkeeping: a reference
count and, once it is full and computed, its cache identity. The free list is
doubly linked so that allocation, freeing and taking a cached block back out
of the free list are all O(1); its order is the LRU eviction order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple


class CacheRoot(NamedTuple):
    """What a sequence's first block hangs off: the request's cache salt, the RoPE factor set its KV is
    computed with (LongRoPE's long factors; False: the short ones, or the model's only RoPE), and its LoRA
    adapter (the fingerprint of its weights; "": the base model).

    Two sequences share a prefix's KV only under the same root: the same tokens rotated with the other
    factor set, or projected with another adapter, are other KV.
    """

    cache_salt: str
    long_rope: bool = False
    lora: str = ""


# What a cached block's parent is: the prefix_id of the block before it, or the root of a first block.
ParentKey = int | CacheRoot


class KVBlock:
    """One KV block's metadata (the KV itself lives in the executor)."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "token_ids",
        "parent_key",
        "prefix_id",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Key in the prefix-cache map; None while the block is not registered.
        self.block_hash: int | None = None
        # The block's own tokens, kept to confirm a hit against hash collisions.
        self.token_ids: tuple[int, ...] | None = None
        # prefix_id of the block before it, or the sequence's CacheRoot for a first block.
        self.parent_key: ParentKey | None = None
        # Names the exact token prefix ending with this block; never reused
        # for different content, so children can verify their parent.
        self.prefix_id: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def clear_identity(self) -> None:
        """Forgets the cached content (the block is about to be overwritten)."""
        self.block_hash = None
        self.token_ids = None
        self.parent_key = None
        self.prefix_id = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first."""

    def __init__(self, blocks: Sequence[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        """Removes and returns the block to evict next."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Adds a block at the tail (evicted last)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Adds a block at the head (reused first)."""
        self._link(block, self._head, self._head.next_free)

    def remove(self, block: KVBlock) -> None:
        """Unlinks a block from anywhere in the queue in O(1)."""
        before, after = block.prev_free, block.next_free
        assert before is not None and after is not None, f"{block} is not in the free queue"
        before.next_free = after
        after.prev_free = before
        block.prev_free = block.next_free = None
        self._len -= 1

    def _link(self, block: KVBlock, before: KVBlock | None, after: KVBlock | None) -> None:
        assert before is not None and after is not None  # the sentinels are always linked
        block.prev_free, block.next_free = before, after
        before.next_free = block
        after.prev_free = block
        self._len += 1


class BlockPool:
    """All blocks of one executor's KV cache: free list plus prefix-cache map."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Called with each cached block allocate() evicts, before its identity is cleared (the offload tier
        # saves it there if it does not hold it).
        self.on_evict: Callable[[KVBlock], None] | None = None
        self.reset()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached ones included: they are evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Takes num_blocks from the head of the free list, evicting their cache entries."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block)
            block.clear_identity()
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Takes a reference on cache hits, pulling free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drops a reference on each block, in the order given.

        A block whose last reference goes joins the free list: at the tail when
        it is a registered cache entry (evicted last), at the head otherwise
        (its content can never be a hit, so it is reused first).
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_key: ParentKey) -> KVBlock | None:
        """The cached block with this content, or None; a hash match alone is not enough."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_key != parent_key or block.token_ids != token_ids:
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...], parent_key: ParentKey) -> bool:
        """Registers a full, computed block under its hash; True when it is the one registered now.

        When an equal block is registered already, this one takes its prefix_id
        (same content) but stays out of the map. When a different block holds
        the hash (a collision), this one stays unregistered.
        """
        if block.prefix_id is not None:
            return False
        other = self.cached.get(block_hash)
        if other is None:
            block.block_hash = block_hash
            block.token_ids = token_ids
            block.parent_key = parent_key
            block.prefix_id = self._next_prefix_id
            self._next_prefix_id += 1
            self.cached[block_hash] = block
            return True
        if other.parent_key == parent_key and other.token_ids == token_ids:
            block.prefix_id = other.prefix_id
        return False

    def reset(self) -> None:
        """Every block free and uncached, as at start."""
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # block_hash -> the one registered block with that hash.
        self.cached: dict[int, KVBlock] = {}
        self._next_prefix_id = 0
