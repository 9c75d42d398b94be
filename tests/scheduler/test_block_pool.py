"""BlockPool and its free list: exact block ids, ref counts and eviction order."""

import pytest

from scheduler_svc.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_free_queue_append_remove_popleft_are_linked_list_ops():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [0, 1, 3] and len(queue) == 3
    queue.append(blocks[4])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3, 4]
    assert queue.popleft() is blocks[2]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    for _ in range(4):
        queue.popleft()
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_allocate_takes_from_head_and_free_returns_in_order():
    pool = BlockPool(10)
    assert free_ids(pool) == list(range(10))
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 7 and pool.num_used_blocks == 3
    with pytest.raises(ValueError):
        pool.allocate(8)
    assert pool.num_free_blocks == 7  # a refused allocation takes nothing
    # Uncached blocks go to the head (reused first), in the order freed.
    pool.free([blocks[2], blocks[0]])
    assert free_ids(pool) == [0, 2, 3, 4, 5, 6, 7, 8, 9]
    assert blocks[1].ref_cnt == 1


def test_cached_blocks_are_freed_to_the_tail_and_evicted_lru():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 111, (1, 2), "")
    pool.cache_block(b, 222, (3, 4), a.prefix_id)
    # c stays uncached (a partial block).
    pool.free([b, a, c])
    assert free_ids(pool) == [2, 3, 4, 5, 1, 0]
    # Allocation evicts in that order: the uncached block, the never-used ones,
    # then the least recently freed cached block (b) before a.
    assert [x.block_id for x in pool.allocate(4)] == [2, 3, 4, 5]
    assert set(pool.cached) == {111, 222}
    assert pool.allocate(1)[0] is b
    assert set(pool.cached) == {111}
    assert b.block_hash is None and b.token_ids is None and b.prefix_id is None


def test_touch_pulls_a_free_cached_block_out_of_the_middle():
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 100 + i, (i,), "")
    pool.free(blocks)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    pool.touch([blocks[2]])
    assert free_ids(pool) == [0, 1, 3, 4] and blocks[2].ref_cnt == 1
    pool.touch([blocks[2]])  # a second holder: only the count changes
    assert blocks[2].ref_cnt == 2 and pool.num_free_blocks == 4
    pool.free([blocks[2]])
    assert blocks[2].ref_cnt == 1 and pool.num_free_blocks == 4
    pool.free([blocks[2]])
    assert free_ids(pool) == [0, 1, 3, 4, 2]


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_lookup_confirms_tokens_and_parent_not_just_the_hash():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    pool.cache_block(first, 7, (1, 2), "salt")
    pool.cache_block(second, 8, (3, 4), first.prefix_id)
    assert pool.lookup(7, (1, 2), "salt") is first
    assert pool.lookup(7, (1, 2), "other salt") is None
    assert pool.lookup(7, (1, 9), "salt") is None  # same hash, other tokens
    assert pool.lookup(8, (3, 4), first.prefix_id) is second
    assert pool.lookup(8, (3, 4), first.prefix_id + 100) is None  # other parent
    assert pool.lookup(9, (1, 2), "salt") is None


def test_cache_block_collision_and_duplicate():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 5, (1, 1), "")
    # A different block with a colliding hash stays out of the cache.
    pool.cache_block(b, 5, (2, 2), "")
    assert pool.cached == {5: a} and b.prefix_id is None and b.block_hash is None
    # An equal block (computed twice) shares the identity but not the map entry.
    pool.cache_block(c, 5, (1, 1), "")
    assert pool.cached == {5: a} and c.prefix_id == a.prefix_id and c.block_hash is None
    # Registering a registered block again changes nothing.
    prefix_id = a.prefix_id
    pool.cache_block(a, 6, (1, 1), "")
    assert pool.cached == {5: a} and a.prefix_id == prefix_id


def test_free_plus_used_is_total_and_reset():
    pool = BlockPool(8)
    held = pool.allocate(5)
    pool.cache_block(held[0], 1, (0,), "")
    pool.free(held[:2])
    assert pool.num_free_blocks + pool.num_used_blocks == 8 and pool.num_free_blocks == 5
    pool.reset()
    assert free_ids(pool) == list(range(8)) and pool.cached == {}
    assert all(block.ref_cnt == 0 for block in pool.blocks)
