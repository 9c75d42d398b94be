"""The offload tier of one executor: host memory and/or disk behind one interface, and what it reports.

``TierStore`` holds the blocks in flight to the tiers (queued for the writer),
the host-memory tier and the disk tier, and answers for all of them: whether a
hash is held (``hashes``, ``take_deltas``), loads of a batch of blocks (from
the queue, host memory, then disk), and stores (``submit``: queued, or dropped
and counted when the queue is full). A block that fails a check is removed,
counted by reason, logged once, and reported as a miss.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from executor_svc.kv.tier.block_file import BadBlock, TierNamespace, checksum, encode_header
from executor_svc.kv.tier.disk_tier import DiskTier
from executor_svc.kv.tier.memory_tier import MemoryTier
from executor_svc.kv.tier.writer import BlockWriter, SaveItem

log = structlog.get_logger("executor")
# Disk reads of one load run on this many threads (a read and its checksum release the GIL): one per core,
# at most 4 (256 blocks from the page cache on this 2-core machine: 1.9 GiB/s with 1, 3.0 with 2, 2.8 with 4).
READ_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclasses.dataclass
class TierStats:
    """Counters since the store opened (read by the metrics at scrape time)."""

    hits: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by tier
    misses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by reason
    rejected: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by reason
    dropped_writes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by reason
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0


class TierStore:
    """The tiers of one executor (either may be None), for blocks of one namespace."""

    def __init__(
        self,
        ns: TierNamespace,
        disk: DiskTier | None,
        memory: MemoryTier | None,
        max_queued_bytes: int,
        on_store_s: Callable[[float], None] = lambda s: None,
    ) -> None:
        if disk is None and memory is None:
            raise ValueError("a tier store needs a disk or a memory tier")
        self.ns = ns
        self.disk = disk
        self.memory = memory
        self.max_queued_bytes = max_queued_bytes
        self.stats = TierStats()
        self._on_store_s = on_store_s
        self._lock = threading.Lock()
        # Blocks handed over and not stored yet: hash -> item.
        self._queued: dict[int, SaveItem] = {}
        # Every hash held anywhere, and what changed since the last take_deltas (hash -> held).
        self._held: set[int] = set()
        self._deltas: dict[int, bool] = {}
        if disk is not None:
            self._held.update(disk.hashes())
            self.stats.rejected.update(disk.rejected_at_scan)
        self._readers = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-offload-read")
        self._writer = BlockWriter(self._store)

    # -- what is held -------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._held

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def take_deltas(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(hashes now held, hashes no longer held) since the last call."""
        with self._lock:
            deltas, self._deltas = self._deltas, {}
        return tuple(h for h, held in deltas.items() if held), tuple(h for h, held in deltas.items() if not held)

    def snapshot(self) -> list[int]:
        """Every hash held, and the deltas start afresh from it (a new scheduler stream)."""
        with self._lock:
            self._deltas = {}
            return list(self._held)

    @property
    def num_queued_bytes(self) -> int:
        return len(self._queued) * self.ns.block_nbytes

    # -- stores -------------------------------------------------------------------

    def submit(self, blocks: Sequence[tuple[int, tuple[int, ...]]], rows: torch.Tensor, ready: object = None) -> int:
        """Queues blocks for storing: (hash, token ids) each, with rows [n, block_nbytes] uint8 on the host.

        Never waits: a block already held is skipped, one that does not fit the queue is dropped (counted,
        and reported as not held). Returns how many were queued.
        """
        num_queued = 0
        with self._lock:
            for (block_hash, token_ids), row in zip(blocks, rows):
                if block_hash in self._held:
                    continue
                if (len(self._queued) + 1) * self.ns.block_nbytes > self.max_queued_bytes:
                    self.stats.dropped_writes["queue full"] += 1
                    self._deltas[block_hash] = False
                    continue
                item = SaveItem(block_hash, token_ids, row, ready)
                self._queued[block_hash] = item
                self._set_held(block_hash)
                self._writer.put(item)
                num_queued += 1
        return num_queued

    def _store(self, item: SaveItem) -> None:
        """On the writer thread: one block into host memory and onto disk."""
        start = time.perf_counter()
        if item.ready is not None:
            item.ready.synchronize()  # the device-to-host copy of this block
        evicted: list[int] = []
        if self.memory is not None:
            with self._lock:
                out = self.memory.put(item.block_hash, item.row)
            evicted += [] if out is None else [out]
        if self.disk is not None:
            evicted += self._write_disk(item)
        with self._lock:
            self._queued.pop(item.block_hash, None)
            for block_hash in [item.block_hash, *evicted]:
                self._update_held(block_hash)
        self._on_store_s(time.perf_counter() - start)

    def _write_disk(self, item: SaveItem) -> list[int]:
        assert self.disk is not None
        payload = memoryview(item.row.numpy()).cast("B")
        header = encode_header(self.ns, item.block_hash, item.token_ids, checksum(payload))
        try:
            evicted = self.disk.write(item.block_hash, header, payload)
        except OSError as exc:
            reason = "disk full" if exc.errno == 28 else "write error"
            with self._lock:
                self.stats.dropped_writes[reason] += 1
                first = self.stats.dropped_writes[reason] == 1
            if first:
                log.warning("kv_offload_write_dropped", reason=reason, error=str(exc), directory=str(self.disk.dir))
            return []
        with self._lock:
            self.stats.bytes_written += len(header) + len(payload)
            self.stats.blocks_written += 1
        return evicted

    def flush(self, timeout_s: float) -> bool:
        """Waits (bounded) until every queued block is stored."""
        return self._writer.flush(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Stores what is queued (bounded by timeout_s) and stops the threads."""
        flushed = self._writer.close(timeout_s)
        self._readers.shutdown(wait=True)
        return flushed

    # -- loads ----------------------------------------------------------------------

    def load(self, blocks: Sequence[tuple[int, tuple[int, ...]]], staging: torch.Tensor) -> list[str | None]:
        """Fills staging [n, block_nbytes] uint8 (host) with blocks given as (hash, token ids).

        Returns, per block, None when loaded or the reason it is a miss (a bad stored block is removed).
        """
        results: list[str | None] = [None] * len(blocks)
        from_disk = []
        with self._lock:
            for i, (block_hash, _tokens) in enumerate(blocks):
                source = self._copy_held(block_hash, staging[i])
                if source is None:
                    from_disk.append(i)
                elif source == "missing":
                    results[i] = self._miss(block_hash, "missing")
        reads = [(i, self._readers.submit(self._read_disk, *blocks[i], staging[i])) for i in from_disk]
        for i, future in reads:
            results[i] = future.result()
        if self.memory is not None and reads:
            with self._lock:
                for i, _ in reads:
                    if results[i] is None:
                        self._promote(blocks[i][0], staging[i])
        return results

    def _copy_held(self, block_hash: int, out: torch.Tensor) -> str | None:
        """Lock held: copies from the queue or host memory; None: read it from disk; else the tier or 'missing'."""
        item = self._queued.get(block_hash)
        if item is not None:
            if item.ready is not None:
                item.ready.synchronize()
            out.copy_(item.row)
            self.stats.hits["queued"] += 1
            return "queued"
        if self.memory is not None and self.memory.copy_to(block_hash, out):
            self.stats.hits["memory"] += 1
            return "memory"
        if self.disk is not None and block_hash in self.disk:
            return None
        return "missing"

    def _read_disk(self, block_hash: int, token_ids: tuple[int, ...], out: torch.Tensor) -> str | None:
        """On a reader thread: one block file into out; None, or the reason it is a miss."""
        assert self.disk is not None
        try:
            self.disk.read_into(block_hash, token_ids, memoryview(out.numpy()).cast("B"))
        except FileNotFoundError:  # evicted meanwhile, or deleted from outside
            self.disk.remove(block_hash)
            with self._lock:
                return self._miss(block_hash, "missing")
        except (BadBlock, OSError) as exc:
            reason = exc.reason if isinstance(exc, BadBlock) else "read error"
            self.disk.remove(block_hash)
            log.warning("kv_offload_block_rejected", block_hash=f"{block_hash:016x}", reason=reason, error=str(exc))
            with self._lock:
                self.stats.rejected[reason] += 1
                return self._miss(block_hash, reason)
        with self._lock:
            self.stats.hits["disk"] += 1
            self.stats.bytes_read += self.ns.file_bytes()
        return None

    def _promote(self, block_hash: int, row: torch.Tensor) -> None:
        """Lock held: a block read from disk goes into host memory too."""
        assert self.memory is not None
        evicted = self.memory.put(block_hash, row)
        if evicted is not None:
            self._update_held(evicted)

    def _miss(self, block_hash: int, reason: str) -> str:
        """Lock held: counts a miss and reports the hash as not held."""
        self.stats.misses[reason] += 1
        self._update_held(block_hash)
        if block_hash not in self._held:
            self._deltas[block_hash] = False
        return reason

    # -- bookkeeping (lock held) --------------------------------------------------------

    def _set_held(self, block_hash: int) -> None:
        if block_hash not in self._held:
            self._held.add(block_hash)
            self._deltas[block_hash] = True

    def _update_held(self, block_hash: int) -> None:
        """Recomputes whether a hash is held anywhere; a change becomes a delta."""
        held = (
            block_hash in self._queued
            or (self.memory is not None and block_hash in self.memory)
            or (self.disk is not None and block_hash in self.disk)
        )
        if held and block_hash not in self._held:
            self._held.add(block_hash)
            self._deltas[block_hash] = True
        elif not held and block_hash in self._held:
            self._held.discard(block_hash)
            self._deltas[block_hash] = False
