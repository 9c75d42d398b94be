"""KVCacheManager: block tables, prefix hits (salt, collisions), LRU eviction, peeking."""

from pagoda.params import SamplingParams, StoppingCriteria
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.kv.kv_cache_manager import KVCacheManager

BS = 4
# hash_block_tokens of (None, (1, 2, 3, 4), "salt") and of its child (5, 6, 7, 8): pinned, since stored tiers use them.
GOLDEN_FIRST = 10995580233736943827
GOLDEN_SECOND = 14424299491238797292


def make_seq(seq_id: int, tokens: list[int], salt: str = "") -> SchedulerSequence:
    return SchedulerSequence(
        seq_id, f"r{seq_id}", tokens, SamplingParams(), StoppingCriteria(max_tokens=8), cache_salt=salt
    )


def admit(kv: KVCacheManager, seq: SchedulerSequence) -> list[int]:
    """What the scheduler does: cache hits, then blocks for the whole rest."""
    hits = kv.get_computed_blocks(seq)
    num_hit_tokens = len(hits) * BS
    new_ids = kv.allocate_slots(seq, seq.num_tokens - num_hit_tokens, hits)
    assert new_ids is not None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq, seq.num_computed_tokens)
    return [block.block_id for block in hits]


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in kv.pool.blocks]


def test_allocate_slots_exact_ids_and_none_without_side_effects():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_seq(1, list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == []  # position 11 still fits block 2
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1) == [3]
    b = make_seq(2, list(range(100, 130)))
    assert kv.allocate_slots(b, 30) is None  # needs 8, 6 free
    assert b.block_ids == [] and kv.num_free_blocks == 6
    assert kv.allocate_slots(b, 24) == [4, 5, 6, 7, 8, 9]
    assert kv.num_free_blocks == 0 and kv.usage == 1.0


def test_prefix_hit_shares_full_blocks_and_keeps_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_seq(1, list(range(10)))  # blocks [0..3] [4..7] [8, 9]
    assert admit(kv, a) == []
    assert a.block_ids == [0, 1, 2]
    assert set(kv.pool.cached) == set(a.block_hashes[:2])  # only full blocks
    b = make_seq(2, list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == [0, 1]
    assert b.block_ids == [0, 1, 3]
    assert ref_cnts(kv)[:4] == [2, 2, 1, 1]
    # A prompt that is exactly two full blocks gets only the first: its last
    # token must be computed for the executor to have logits.
    c = make_seq(3, list(range(8)))
    assert [block.block_id for block in kv.get_computed_blocks(c)] == [0]
    assert kv.peek_prefix_hit_tokens(list(range(8))) == 4
    assert kv.peek_prefix_hit_tokens(list(range(9))) == 8
    assert kv.peek_prefix_hit_tokens([0, 1, 2, 9, 4]) == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq(1, [1, 1, 1, 1, 2, 2, 2, 2, 3])
    b = make_seq(2, [5, 5, 5, 5, 6, 6, 6, 6, 7])
    admit(kv, a)  # blocks 0, 1, 2
    admit(kv, b)  # blocks 3, 4, 5
    kv.free(a)
    kv.free(b)
    # Partial blocks to the head; full ones to the tail, last block first.
    assert [blk.block_id for blk in kv.pool.free_queue] == [5, 2, 1, 0, 4, 3]
    assert kv.num_free_blocks == 6 and kv.usage == 0.0
    # A new sequence needing 3 blocks evicts the two partial ones, then a's tail block.
    c = make_seq(3, list(range(20, 30)))
    assert kv.allocate_slots(c, 10) == [5, 2, 1]
    assert kv.peek_prefix_hit_tokens([1, 1, 1, 1, 2, 2, 2, 2, 3]) == 4
    assert kv.peek_prefix_hit_tokens([5, 5, 5, 5, 6, 6, 6, 6, 7]) == 8
    d = make_seq(4, [5, 5, 5, 5, 6, 6, 6, 6, 7])
    assert admit(kv, d) == [3, 4]


def test_cache_salt_separates_otherwise_equal_prefixes():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_seq(1, list(range(9)), salt="tenant-a"))
    assert kv.peek_prefix_hit_tokens(list(range(9)), "tenant-a") == 8
    assert kv.peek_prefix_hit_tokens(list(range(9)), "tenant-b") == 0
    assert kv.peek_prefix_hit_tokens(list(range(9))) == 0
    assert admit(kv, make_seq(2, list(range(9)), salt="tenant-b")) == []


def test_colliding_hash_function_never_shares_different_content():
    """Every block hashes to 0: hits must still be confirmed by content."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, block_hasher=lambda parent, tokens, salt, long_rope, lora: 0)
    a = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[0]]
    # Different first block: no hit although the hash matches.
    assert admit(kv, make_seq(2, [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    # Same first block: the hit is real; the second block (hash 0 too) is not a hit.
    assert admit(kv, make_seq(3, [1, 2, 3, 4, 5, 6, 7, 8, 0])) == [0]


def test_hash_ignoring_the_parent_cannot_share_a_block_across_prefixes():
    """A hash of the block's own tokens only: X|T and Y|T collide on T, and must not share."""
    kv = KVCacheManager(
        num_blocks=12, block_size=BS, block_hasher=lambda parent, tokens, salt, long_rope, lora: hash(tokens)
    )
    admit(kv, make_seq(1, [1, 1, 1, 1, 7, 7, 7, 7, 0]))
    assert kv.peek_prefix_hit_tokens([2, 2, 2, 2, 7, 7, 7, 7, 0]) == 0
    admit(kv, make_seq(2, [2, 2, 2, 2, 7, 7, 7, 7, 0]))
    # The second sequence's T block collides with the first's: it stays unregistered,
    # so is not shared, yet the first's chain still hits.
    assert kv.peek_prefix_hit_tokens([1, 1, 1, 1, 7, 7, 7, 7, 0]) == 8
    assert kv.peek_prefix_hit_tokens([2, 2, 2, 2, 7, 7, 7, 7, 0]) == 4


def test_evicted_parent_replaced_by_colliding_content_does_not_revive_its_child():
    """hash = sum of the block's tokens (parent ignored): [1,1,1,1] and [2,2,0,0] collide."""
    kv = KVCacheManager(
        num_blocks=3, block_size=BS, block_hasher=lambda parent, tokens, salt, long_rope, lora: sum(tokens)
    )
    x = make_seq(1, [1, 1, 1, 1, 7, 7, 7, 7, 0])
    admit(kv, x)  # blocks 0 (hash 4), 1 (hash 28), 2 (partial)
    kv.free(x)
    kv.pool.touch([kv.pool.blocks[1]])  # keep the child cached while its parent is evicted
    y = make_seq(2, [2, 2, 0, 0, 3])
    admit(kv, y)  # takes the partial block 2, then x's parent block 0 (evicted)
    assert y.block_ids == [2, 0]
    assert kv.pool.cached[4].token_ids == (2, 2, 0, 0) and kv.pool.cached[28] is kv.pool.blocks[1]
    # [2,2,0,0] hits y's block; the child computed after [1,1,1,1] must not follow it.
    assert kv.peek_prefix_hit_tokens([2, 2, 0, 0, 7, 7, 7, 7, 0]) == 4


def test_generated_tokens_fill_blocks_that_get_cached():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_seq(1, [1, 2, 3, 4, 5, 6])
    admit(kv, a)
    assert len(kv.pool.cached) == 1
    for token in (7, 8):
        a.append_token(token)
    # Token 7 is computed, 8 is not yet: block 1 is full but not computed.
    kv.cache_full_blocks(a, 7)
    assert len(kv.pool.cached) == 1
    kv.allocate_slots(a, 1)
    kv.cache_full_blocks(a, 8)
    assert len(kv.pool.cached) == 2
    assert kv.peek_prefix_hit_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_peek_has_no_side_effects_and_counters_count_only_what_is_recorded():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq(1, list(range(9)))
    admit(kv, a)
    kv.free(a)
    before = ([b.block_id for b in kv.pool.free_queue], ref_cnts(kv), dict(kv.pool.cached))
    assert kv.peek_prefix_hit_tokens(list(range(12))) == 8
    assert kv.get_computed_blocks(make_seq(2, list(range(12)))) == [kv.pool.blocks[0], kv.pool.blocks[1]]
    assert ([b.block_id for b in kv.pool.free_queue], ref_cnts(kv), dict(kv.pool.cached)) == before
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.record_prefix_query(12, 8)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 8)


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_seq(1, list(range(9))))
    assert kv.pool.cached == {}
    assert admit(kv, make_seq(2, list(range(9)))) == []
    assert kv.peek_prefix_hit_tokens(list(range(9))) == 0


def test_block_hashes_are_stable_64_bit_values_the_same_in_every_process():
    """Offload tiers outlive processes: the hash of a block must not depend on PYTHONHASHSEED."""
    import subprocess
    import sys

    from scheduler_svc.kv.kv_cache_manager import hash_block_tokens

    first = hash_block_tokens(None, (1, 2, 3, 4), "salt")
    second = hash_block_tokens(first, (5, 6, 7, 8), "")
    assert (first, second) == (GOLDEN_FIRST, GOLDEN_SECOND)  # a change of scheme must change _HASH_PERSON
    assert 0 <= first < 2**64 and 0 <= second < 2**64
    code = "from scheduler_svc.kv.kv_cache_manager import hash_block_tokens as h; print(h(None, (1, 2, 3, 4), 'salt'))"
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True)
        assert out.stdout.strip() == str(first), out.stderr
    assert hash_block_tokens(None, (1, 2, 3, 4), "") != first  # the salt counts
    assert hash_block_tokens(1, (1, 2, 3, 4), "salt") != first  # and the parent
    assert hash_block_tokens(None, (1, 2, 3, 5), "salt") != first
