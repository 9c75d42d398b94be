"""The offload tier's store: bit-exact round trips, LRU, and every bad block a miss (never used, never a crash)."""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

import pytest
import torch

from executor_svc.kv.cache import KVCache, KVCacheSpec
from executor_svc.kv.tier.block_file import TierNamespace
from executor_svc.kv.tier.disk_tier import DiskTier
from executor_svc.kv.tier.memory_tier import MemoryTier
from executor_svc.kv.tier.store import TierStore

BS = 4
CPU = torch.device("cpu")


def make_cache(dtype: torch.dtype = torch.float32, num_blocks: int = 8, seed: int = 0) -> KVCache:
    kv = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype=dtype), num_blocks, CPU)
    generator = torch.Generator().manual_seed(seed)
    kv.storage.copy_(torch.randn(kv.storage.shape, generator=generator).to(dtype))
    return kv


def namespace(kv: KVCache, identity: str = "model=tiny;dtype=float32") -> TierNamespace:
    return TierNamespace(identity, kv.block_layout(), kv.block_nbytes, BS)


def tokens(block_hash: int) -> tuple[int, ...]:
    return tuple(range(block_hash, block_hash + BS))


def open_store(root: Path, ns: TierNamespace, capacity_blocks: int = 16, memory_blocks: int = 0, **kw) -> TierStore:
    disk = DiskTier(root / ns.dirname, ns, capacity_blocks * ns.file_bytes(), **kw) if root else None
    if disk is not None:
        disk.scan()
    memory = MemoryTier(memory_blocks * ns.block_nbytes, ns.block_nbytes, pin=False) if memory_blocks else None
    return TierStore(ns, disk, memory, max_queued_bytes=64 * ns.block_nbytes)


def save(store: TierStore, kv: KVCache, items: list[tuple[int, int]]) -> None:
    """Stores (hash, block id) pairs the way a step does: one copy out, then the writer."""
    rows = torch.empty((len(items), kv.block_nbytes), dtype=torch.uint8)
    kv.read_blocks([block_id for _, block_id in items], rows)
    store.submit([(h, tokens(h)) for h, _ in items], rows)
    assert store.flush(10)


def load(store: TierStore, kv: KVCache, items: list[tuple[int, int]]) -> list[str | None]:
    staging = torch.empty((len(items), kv.block_nbytes), dtype=torch.uint8)
    reasons = store.load([(h, tokens(h)) for h, _ in items], staging)
    ok = [i for i, r in enumerate(reasons) if r is None]
    if ok:
        kv.write_blocks(torch.tensor([items[i][1] for i in ok]), staging[ok])
    return reasons


def block_bytes(kv: KVCache, block_id: int) -> torch.Tensor:
    return kv.storage[:, :, :, block_id].contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_round_trip_bit_for_bit_across_a_reopen(tmp_path, dtype):
    source, target = make_cache(dtype, seed=1), make_cache(dtype, seed=2)
    ns = namespace(source)
    store = open_store(tmp_path, ns)
    save(store, source, [(100, 3), (200, 5), (300, 0)])
    store.close(10)
    reopened = open_store(tmp_path, ns)
    assert sorted(reopened.hashes()) == [100, 200, 300]
    assert load(reopened, target, [(200, 1), (100, 7), (300, 2)]) == [None, None, None]
    for src, dst in ((5, 1), (3, 7), (0, 2)):
        assert torch.equal(block_bytes(source, src), block_bytes(target, dst))
    untouched = make_cache(dtype, seed=2)
    assert torch.equal(block_bytes(untouched, 4), block_bytes(target, 4))
    assert reopened.stats.hits["disk"] == 3


def test_an_int8_cache_round_trips_its_rows_and_scales(tmp_path):
    """An int8 KV cache keeps scales beside K and V: block_tensors() lists both, the tier stores both."""

    def int8_cache(seed: int) -> KVCache:
        kv = KVCache(KVCacheSpec(2, 2, 8, BS, torch.int8), 6, CPU)
        generator = torch.Generator().manual_seed(seed)
        kv.storage.copy_(torch.randint(-127, 128, kv.storage.shape, generator=generator, dtype=torch.int8))
        assert kv.scales is not None and kv.scales.shape == (2, 2, 2, 6, BS)  # [L, K/V, KVH, NB, BS]
        kv.scales.copy_(torch.rand(kv.scales.shape, generator=generator))
        return kv

    source, target = int8_cache(1), int8_cache(2)
    assert "int8" in source.block_layout() and "float32" in source.block_layout()
    store = open_store(tmp_path, namespace(source))
    save(store, source, [(7, 2)])
    assert load(store, target, [(7, 4)]) == [None]
    assert torch.equal(source.storage[:, :, :, 2], target.storage[:, :, :, 4])
    assert torch.equal(source.scales[:, :, :, 2], target.scales[:, :, :, 4])


def test_disk_tier_evicts_least_recently_used_and_a_hit_counts_as_use(tmp_path):
    kv = make_cache()
    ns = namespace(kv)
    store = open_store(tmp_path, ns, capacity_blocks=3)
    save(store, kv, [(1, 0), (2, 1), (3, 2)])
    assert load(store, kv, [(1, 5)]) == [None]  # 1 is now the most recently used
    save(store, kv, [(4, 3)])
    assert sorted(store.hashes()) == [1, 3, 4]
    assert store.take_deltas() == ((1, 3, 4), (2,))
    save(store, kv, [(5, 4)])
    assert sorted(store.hashes()) == [1, 4, 5]
    assert not (tmp_path / ns.dirname / f"{3:016x}.kvb").exists()


def test_deltas_report_what_was_added_and_removed_since_the_last_call(tmp_path):
    kv = make_cache()
    store = open_store(tmp_path, namespace(kv), capacity_blocks=2)
    save(store, kv, [(1, 0), (2, 1)])
    assert store.take_deltas() == ((1, 2), ())
    save(store, kv, [(3, 2)])
    assert store.take_deltas() == ((3,), (1,))
    assert store.take_deltas() == ((), ())
    assert sorted(store.snapshot()) == [2, 3]


def test_the_lru_order_survives_a_restart(tmp_path):
    kv = make_cache()
    ns = namespace(kv)
    store = open_store(tmp_path, ns, capacity_blocks=3)
    for h in (1, 2, 3):
        save(store, kv, [(h, h)])
        os.utime(tmp_path / ns.dirname / f"{h:016x}.kvb", (1000 + h, 1000 + h))
    os.utime(tmp_path / ns.dirname / f"{1:016x}.kvb", (2000, 2000))  # 1 used last
    store.close(10)
    reopened = open_store(tmp_path, ns, capacity_blocks=3)
    save(reopened, kv, [(4, 4)])
    assert sorted(reopened.hashes()) == [1, 3, 4]


def test_memory_tier_is_lru_by_bytes_and_serves_before_disk(tmp_path):
    kv = make_cache()
    ns = namespace(kv)
    store = open_store(tmp_path, ns, memory_blocks=2)
    save(store, kv, [(1, 0), (2, 1), (3, 2)])
    assert sorted(store.memory.hashes()) == [2, 3] and sorted(store.hashes()) == [1, 2, 3]
    assert load(store, kv, [(3, 6)]) == [None] and store.stats.hits == {"memory": 1}
    assert load(store, kv, [(1, 7)]) == [None] and store.stats.hits["disk"] == 1
    assert sorted(store.memory.hashes()) == [1, 3]  # read from disk, kept in memory; 2 was least recent


def test_memory_only_tier_reports_what_it_evicts():
    kv = make_cache()
    store = open_store(None, namespace(kv), memory_blocks=2)
    save(store, kv, [(1, 0), (2, 1), (3, 2)])
    assert store.take_deltas() == ((2, 3), (1,))
    assert sorted(store.hashes()) == [2, 3]
    assert load(store, kv, [(1, 4)]) == ["missing"]


def _block_file(root: Path, ns: TierNamespace, block_hash: int) -> Path:
    return root / ns.dirname / f"{block_hash:016x}.kvb"


def _damage(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["payload", "header", "tokens"])
def test_a_damaged_block_is_a_miss_removed_and_counted(tmp_path, where):
    kv = make_cache()
    ns = namespace(kv)
    store = open_store(tmp_path, ns)
    save(store, kv, [(10, 1), (11, 2)])
    before = block_bytes(kv, 6).clone()
    offset = {"payload": ns.file_bytes() - 3, "header": 30, "tokens": ns.header_bytes(BS) - 2}[where]
    _damage(_block_file(tmp_path, ns, 10), offset)
    reason = {"payload": "checksum", "header": "header checksum", "tokens": "header checksum"}[where]
    assert load(store, kv, [(10, 6), (11, 5)]) == [reason, None]
    assert torch.equal(block_bytes(kv, 6), before)  # never used
    assert store.stats.rejected[reason] == 1 and store.stats.misses[reason] == 1
    assert not _block_file(tmp_path, ns, 10).exists() and 10 not in store
    assert store.take_deltas()[1] == (10,)


def test_a_block_stored_for_other_tokens_is_a_miss(tmp_path):
    kv = make_cache()
    store = open_store(tmp_path, namespace(kv))
    save(store, kv, [(10, 1)])
    staging = torch.empty((1, kv.block_nbytes), dtype=torch.uint8)
    assert store.load([(10, (9, 9, 9, 9))], staging) == ["token ids"]


@pytest.mark.parametrize(
    ("other", "reason"),
    [("identity", "model identity"), ("layout", "layout")],
)
def test_blocks_of_another_model_or_layout_are_never_used(tmp_path, other, reason):
    kv = make_cache()
    ns = namespace(kv)
    foreign_ns = (
        namespace(kv, identity="model=other;dtype=float32")
        if other == "identity"
        else TierNamespace(ns.identity, ns.layout + ";x", ns.block_nbytes, BS)
    )
    assert foreign_ns.dirname != ns.dirname  # another model or layout sees an empty tier
    foreign = open_store(tmp_path, foreign_ns)
    save(foreign, kv, [(10, 1), (11, 2)])
    store = open_store(tmp_path, ns)
    save(store, kv, [(10, 3)])
    # A foreign file where this tier's block 10 is (a copied directory, a mix-up): a miss at load.
    shutil.copy(_block_file(tmp_path, foreign_ns, 10), _block_file(tmp_path, ns, 10))
    assert load(store, kv, [(10, 4)]) == [reason]
    # And one found at the scan is deleted there.
    shutil.copy(_block_file(tmp_path, foreign_ns, 11), _block_file(tmp_path, ns, 11))
    reopened = open_store(tmp_path, ns)
    assert 11 not in reopened and reopened.stats.rejected[reason] == 1


@pytest.mark.parametrize(
    ("content", "reason"),
    [("empty", "truncated"), ("cut", "truncated"), ("short garbage", "truncated"), ("garbage", "not a block file")],
)
def test_truncated_or_garbage_files_are_misses_not_crashes(tmp_path, content, reason):
    kv = make_cache()
    ns = namespace(kv)
    store = open_store(tmp_path, ns)
    save(store, kv, [(10, 1), (11, 2)])
    path = _block_file(tmp_path, ns, 10)
    data = {
        "empty": b"",
        "cut": path.read_bytes()[: ns.file_bytes() - 100],
        "short garbage": b"garbage" * 50,
        "garbage": os.urandom(ns.file_bytes()),
    }[content]
    path.write_bytes(data)
    assert load(store, kv, [(10, 4)]) == [reason]
    assert store.stats.rejected[reason] == 1 and not path.exists()
    path.write_bytes(data)
    (tmp_path / ns.dirname / "zzzz.kvb").write_bytes(b"junk")
    (tmp_path / ns.dirname / ".tmp-1-1").write_bytes(b"half a block")
    reopened = open_store(tmp_path, ns)
    assert reopened.hashes() == [11]
    assert reopened.stats.rejected == collections.Counter([reason, "not a block file"])  # and zzzz.kvb
    assert [p.name for p in (tmp_path / ns.dirname).iterdir()] == [f"{11:016x}.kvb"]


def test_a_full_disk_drops_writes_and_serving_goes_on(tmp_path):
    kv = make_cache()
    ns = namespace(kv)
    store = open_store(tmp_path, ns, opener=lambda path: os.open("/dev/full", os.O_WRONLY))
    save(store, kv, [(1, 0), (2, 1)])
    assert store.stats.dropped_writes["disk full"] == 2 and store.stats.blocks_written == 0
    assert store.hashes() == [] and store.take_deltas() == ((), (1, 2))
    assert load(store, kv, [(1, 3)]) == ["missing"]
    assert list((tmp_path / ns.dirname).iterdir()) == []  # no temporary file left


def test_a_full_queue_drops_blocks_without_waiting(tmp_path):
    kv = make_cache()
    ns = namespace(kv)
    disk = DiskTier(tmp_path / ns.dirname, ns, 16 * ns.file_bytes())
    disk.scan()
    store = TierStore(ns, disk, None, max_queued_bytes=2 * ns.block_nbytes)
    rows = torch.zeros((5, kv.block_nbytes), dtype=torch.uint8)
    assert store.submit([(h, tokens(h)) for h in range(5)], rows) == 2
    assert store.stats.dropped_writes["queue full"] == 3
    assert store.flush(10)
    assert store.take_deltas() == ((0, 1), (2, 3, 4))
    assert sorted(store.hashes()) == [0, 1]


def test_a_queued_block_can_be_loaded_before_it_is_written(tmp_path):
    kv = make_cache()
    ns = namespace(kv)
    disk = DiskTier(tmp_path / ns.dirname, ns, 16 * ns.file_bytes(), opener=_slow_opener)
    disk.scan()
    store = TierStore(ns, disk, None, max_queued_bytes=8 * ns.block_nbytes)
    rows = torch.empty((1, kv.block_nbytes), dtype=torch.uint8)
    kv.read_blocks([2], rows)
    store.submit([(5, tokens(5))], rows)
    target = make_cache(seed=9)
    assert load(store, target, [(5, 0)]) == [None]
    assert torch.equal(block_bytes(kv, 2), block_bytes(target, 0))
    assert store.flush(10)


def _slow_opener(path: Path) -> int:
    import time

    time.sleep(0.2)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def test_a_capacity_below_one_block_is_refused(tmp_path):
    ns = namespace(make_cache())
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(tmp_path, ns, ns.file_bytes() - 1)
    with pytest.raises(ValueError, match="holds no block"):
        MemoryTier(ns.block_nbytes - 1, ns.block_nbytes, pin=False)
