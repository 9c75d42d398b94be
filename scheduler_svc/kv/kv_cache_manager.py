"""Block tables of sequences over one block pool, with automatic prefix caching.

The scheduler asks three things: which leading blocks of a sequence are
already cached (get_computed_blocks), blocks for the tokens it is about to
schedule (allocate_slots, None when they do not fit), and to let a sequence's
blocks go (free). Full blocks whose KV is known to be computed are offered to
the prefix cache (cache_full_blocks) so later sequences can share them.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.kv.block_pool import BlockPool, CacheRoot, KVBlock, ParentKey
from scheduler_svc.kv.tier_index import TierIndex

# (parent block hash or None, the block's token ids, cache salt, long RoPE factors, LoRA adapter) -> hash; the
# salt, the factor set and the adapter are given for a first block only ("", False, "" after it: the chain
# carries them).
BlockHasher = Callable[[int | None, tuple[int, ...], str, bool, str], int]
# Domain of the block hash: a new scheme gets a new one, so no old tier entry can match it.
_HASH_PERSON = b"pagoda-kv-1"


def hash_block_tokens(
    parent_hash: int | None, token_ids: tuple[int, ...], cache_salt: str, long_rope: bool = False, lora: str = ""
) -> int:
    """Chained block hash: the parent's hash, this block's tokens, and for a first block the salt, the RoPE
    factor set and the LoRA adapter.

    A first block on LongRoPE's long factors starts from another tag than one on the short factors (or on a
    model's only RoPE), and one computed with a LoRA adapter (``lora``: its weights' fingerprint) from another
    tag again, followed by the fingerprint, so no two kinds share a hash, here or in an offload tier: an
    adapter changes K and V, and one adapter never reads another's KV, nor the base model's. The base model's
    hashes are what they were before adapters existed.

    A 64-bit BLAKE2b, the same in every process and on every host (Python's ``hash()`` is salted per
    process): the prefix cache, the router, the plan and the executors' offload tiers, which outlive
    processes, all key blocks by it.
    """
    digest = hashlib.blake2b(digest_size=8, person=_HASH_PERSON)
    if parent_hash is None:
        digest.update(bytes([(2 if long_rope else 0) | (4 if lora else 0)]))
    else:
        digest.update(struct.pack("<BQ", 1, parent_hash))
    salt = cache_salt.encode()
    digest.update(struct.pack("<I", len(salt)) + salt)
    if lora:
        adapter = lora.encode()
        digest.update(struct.pack("<I", len(adapter)) + adapter)
    tokens = array("q", token_ids)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        tokens.byteswap()
    digest.update(tokens.tobytes())
    return int.from_bytes(digest.digest(), "little")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees the blocks of sequences."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        block_hasher: BlockHasher = hash_block_tokens,
        tier: TierIndex | None = None,
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._hasher = block_hasher
        # The executor's offload tier (docs/kv-offload.md): every block registered here, and every cached
        # block evicted that the tier lacks, is saved to it; its blocks continue prefix hits as loads.
        self.tier = tier if enable_prefix_caching else None
        if self.tier is not None:
            self.pool.on_evict = self._save_evicted
        # Prompt (and resumed) tokens looked up at admission, and how many hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_computed_blocks(self, seq: SchedulerSequence) -> list[KVBlock]:
        """Leading cached blocks of a sequence with an empty block table.

        At most num_tokens - 1 tokens come from the cache: the last one must be
        computed so that the executor has logits to sample from. No side effects
        beyond remembering the sequence's block hashes.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        return self._match(seq.token_ids, _root(seq), max_blocks, seq.block_hashes)

    def count_tier_blocks(self, seq: SchedulerSequence, first_block: int) -> int:
        """How many blocks of seq from first_block on (after its device hits) the tier holds, in a row.

        Bounded like get_computed_blocks: the last token is always computed.
        """
        if self.tier is None:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        return self._count_in_tier(seq.token_ids, _root(seq), first_block, max_blocks, seq.block_hashes)

    def peek_prefix_hit_tokens(
        self, token_ids: Sequence[int], cache_salt: str = "", long_rope: bool = False, lora: str = ""
    ) -> int:
        """Tokens of token_ids the device cache and then the tier could serve now (for routing); no side effects.

        ``long_rope``: of a sequence on LongRoPE's long factors (the blocks computed with them); ``lora``: of
        one with that LoRA adapter (its fingerprint).
        """
        if not self.enable_prefix_caching or not token_ids:
            return 0
        root = CacheRoot(cache_salt, long_rope, lora)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes: list[int] = []
        num_hits = len(self._match(token_ids, root, max_blocks, hashes))
        if self.tier is not None:
            num_hits += self._count_in_tier(token_ids, root, num_hits, max_blocks, hashes)
        return num_hits * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted lookup (failed admissions are retried, not counted)."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, seq: SchedulerSequence, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Blocks for num_new_tokens more tokens of seq, or None if they do not fit.

        computed_blocks (prefix hits, for a sequence with an empty table) join
        its table first. Returns the ids of the newly allocated blocks; on None
        nothing changed.
        """
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(seq.block_ids) - len(computed_blocks)
        if num_needed <= 0 and not computed_blocks:
            return []  # the common decode step: the last block has room
        # Hits that are free now leave the free list when taken.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
            seq.block_ids.extend(block.block_id for block in computed_blocks)
            seq.num_registered_blocks = len(seq.block_ids)
        if num_needed <= 0:
            return []
        new_ids = [block.block_id for block in self.pool.allocate(num_needed)]
        seq.block_ids.extend(new_ids)
        return new_ids

    def cache_full_blocks(self, seq: SchedulerSequence, num_computed_tokens: int) -> None:
        """Offers the blocks made full and computed up to num_computed_tokens to the cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens, seq.num_tokens) // bs
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        root = _root(seq)
        self._extend_hashes(seq.token_ids, root, num_full, seq.block_hashes)
        blocks, table = self.pool.blocks, seq.block_ids
        parent_key: ParentKey | None = root if start == 0 else blocks[table[start - 1]].prefix_id
        for i in range(start, num_full):
            if parent_key is None:
                # Its parent is not identifiable (a hash collision): no child can be verified.
                break
            block = blocks[table[i]]
            token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if self.pool.cache_block(block, seq.block_hashes[i], token_ids, parent_key) and self.tier is not None:
                self.tier.queue_save(block.block_id, seq.block_hashes[i], token_ids)
            parent_key = block.prefix_id
        seq.num_registered_blocks = num_full

    def truncate(self, seq: SchedulerSequence, num_blocks: int) -> None:
        """Frees the blocks of seq's table past its first num_blocks (rejected drafts' KV only), last first.

        They were never offered to the prefix cache: only blocks full of computed tokens are.
        """
        if num_blocks >= len(seq.block_ids):
            return
        assert num_blocks >= seq.num_registered_blocks, "a cached block held rejected KV"
        blocks = self.pool.blocks
        self.pool.free([blocks[block_id] for block_id in reversed(seq.block_ids[num_blocks:])])
        del seq.block_ids[num_blocks:]

    def free(self, seq: SchedulerSequence) -> None:
        """Releases the sequence's blocks, last block first (so it is evicted first)."""
        blocks = self.pool.blocks
        self.pool.free([blocks[block_id] for block_id in reversed(seq.block_ids)])
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def reset(self) -> None:
        """Every block free and uncached (the executor behind this pool is gone)."""
        self.pool.reset()

    def _save_evicted(self, block: KVBlock) -> None:
        """A cached block about to be reused: saved first unless the tier holds it (its write was dropped)."""
        assert self.tier is not None and block.block_hash is not None and block.token_ids is not None
        self.tier.queue_save(block.block_id, block.block_hash, block.token_ids)

    def _count_in_tier(
        self, token_ids: Sequence[int], root: CacheRoot, first_block: int, max_blocks: int, hashes: list[int]
    ) -> int:
        """Blocks first_block.. (below max_blocks) whose hashes the tier holds, up to the first it lacks."""
        assert self.tier is not None
        num = 0
        for i in range(first_block, max_blocks):
            if i >= len(hashes):
                self._extend_hashes(token_ids, root, i + 1, hashes)
            if hashes[i] not in self.tier:
                break
            num += 1
        return num

    def _match(self, token_ids: Sequence[int], root: CacheRoot, max_blocks: int, hashes: list[int]) -> list[KVBlock]:
        """Walks the cache block by block, hashing lazily, until the first miss."""
        bs = self.block_size
        hits: list[KVBlock] = []
        parent_key: ParentKey = root
        for i in range(max_blocks):
            if i == len(hashes):
                self._extend_hashes(token_ids, root, i + 1, hashes)
            block = self.pool.lookup(hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]), parent_key)
            if block is None:
                break
            hits.append(block)
            assert block.prefix_id is not None  # set when the block was cached
            parent_key = block.prefix_id
        return hits

    def _extend_hashes(self, token_ids: Sequence[int], root: CacheRoot, num_blocks: int, hashes: list[int]) -> None:
        """Appends the chained hashes of blocks len(hashes)..num_blocks-1."""
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            if i:
                hashes.append(self._hasher(hashes[i - 1], tokens, "", False, ""))
            else:
                hashes.append(self._hasher(None, tokens, root.cache_salt, root.long_rope, root.lora))


def _root(seq: SchedulerSequence) -> CacheRoot:
    """The root of seq's blocks: its salt, its RoPE factor set (chosen at admission) and its LoRA adapter."""
    return CacheRoot(seq.cache_salt, seq.long_rope, seq.lora_fingerprint)
