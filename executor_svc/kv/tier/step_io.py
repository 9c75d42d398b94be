"""What one step does with the offload tier: copy its saves out, fill its loads in.

Saves run first in a step, before anything writes KV: a block the scheduler
freed and reused in this same step still holds what was computed. The copy out
is one contiguous copy per block into host memory (pinned on CUDA, with an
event the writer waits on); the store takes it from there, never the step.
Loads of every sequence of the step are batched: one host buffer (kept from
step to step: a fresh one costs its page faults, ~25 ms per 130 MiB here),
the tiers fill it (the disk reads in parallel), then one copy per KV tensor
into the blocks. A sequence with any block that could not be loaded fails alone,
recoverably: the scheduler recomputes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import structlog
import torch

from executor_svc.kv.cache import KVCache
from executor_svc.kv.tier.open_tier import pinned_staging
from executor_svc.kv.tier.store import TierStore
from executor_svc.serving.sequence_table import LoadRequest, SequenceState
from pagoda.step import BlockLoad, BlockSave

log = structlog.get_logger("executor")
# seq_id -> (the hashes it could not load, the first reason).
LoadFailures = dict[int, tuple[tuple[int, ...], str]]
# The load buffer kept between steps holds at most this much (an 8k-token SmolLM2 prompt is ~190 MiB).
MAX_KEPT_STAGING_BYTES = 256 * 2**20


class TierStepIO:
    """The tier side of a step for one KV cache."""

    def __init__(self, store: TierStore, kv_cache: KVCache, on_load_s=lambda s: None) -> None:
        self.store = store
        self.kv_cache = kv_cache
        self._on_load_s = on_load_s
        self._num_bad_saves = 0
        # The host buffer loads are read into [rows, block_nbytes], grown on demand, and (CUDA) the event of
        # the last copy out of it to the device.
        self._staging: torch.Tensor | None = None
        self._staging_copied: torch.cuda.Event | None = None

    def save(self, saves: Sequence[BlockSave]) -> int:
        """Copies the blocks to save out and hands them to the store; returns the ns it took."""
        start = time.perf_counter_ns()
        kv, store = self.kv_cache, self.store
        todo = [s for s in saves if s.block_hash not in store and self._valid(s)]
        if not todo:
            return time.perf_counter_ns() - start
        try:
            rows = pinned_staging(len(todo), kv.block_nbytes, kv.storage.device)
            kv.read_blocks([s.block_id for s in todo], rows)
            ready = None
            if kv.storage.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            store.submit([(s.block_hash, s.token_ids) for s in todo], rows, ready)
        except Exception:  # a save that breaks is a block not stored; the step goes on
            log.exception("kv_offload_save_failed", num_blocks=len(todo))
        return time.perf_counter_ns() - start

    def _valid(self, save: BlockSave) -> bool:
        """A save naming no block of this cache, or the wrong number of tokens, is skipped (logged once)."""
        ok = 0 <= save.block_id < self.kv_cache.num_blocks and len(save.token_ids) == self.kv_cache.spec.block_size
        if not ok:
            self._num_bad_saves += 1
            if self._num_bad_saves == 1:
                log.warning("kv_offload_bad_save", block_id=save.block_id, num_tokens=len(save.token_ids))
        return ok

    def load(self, requests: Sequence[LoadRequest]) -> tuple[LoadFailures, int]:
        """Fills every request's blocks; returns the sequences that failed (seq_id -> hashes, reason) and the ns."""
        start = time.perf_counter_ns()
        kv = self.kv_cache
        bs = kv.spec.block_size
        flat: list[tuple[SequenceState, BlockLoad, tuple[int, ...]]] = []
        for state, loads in requests:
            first = state.num_computed_tokens // bs - len(loads)
            for j, block in enumerate(loads):
                position = first + j
                flat.append((state, block, tuple(state.token_ids[position * bs : (position + 1) * bs])))
        staging = self._staging_for(len(flat))
        reasons = self.store.load([(block.block_hash, tokens) for _, block, tokens in flat], staging)
        failures: LoadFailures = {}
        for (state, block, _), reason in zip(flat, reasons):
            if reason is not None:
                hashes, first_reason = failures.get(state.seq_id, ((), reason))
                failures[state.seq_id] = ((*hashes, block.block_hash), first_reason)
        ok = [i for i, reason in enumerate(reasons) if reason is None]
        if ok:
            rows = staging if len(ok) == len(flat) else staging[ok]
            block_ids = torch.tensor([flat[i][1].block_id for i in ok], dtype=torch.int64)
            device = kv.storage.device
            kv.write_blocks(block_ids.to(device), rows.to(device, non_blocking=True))
            if kv.storage.is_cuda:
                self._staging_copied = torch.cuda.Event()
                self._staging_copied.record()
        elapsed = time.perf_counter_ns() - start
        self._on_load_s(elapsed / 1e9)
        return failures, elapsed

    def _staging_for(self, num_blocks: int) -> torch.Tensor:
        """The first num_blocks rows of the reused host buffer (grown, at least doubling, when too small)."""
        if self._staging_copied is not None:
            self._staging_copied.synchronize()  # the last load's copy to the device has read it
            self._staging_copied = None
        kv = self.kv_cache
        if num_blocks * kv.block_nbytes > MAX_KEPT_STAGING_BYTES:
            return pinned_staging(num_blocks, kv.block_nbytes, kv.storage.device)  # a rare huge load: not kept
        if self._staging is None or self._staging.shape[0] < num_blocks:
            rows = max(num_blocks, 2 * self._staging.shape[0] if self._staging is not None else 0)
            rows = min(rows, MAX_KEPT_STAGING_BYTES // kv.block_nbytes)
            self._staging = pinned_staging(rows, kv.block_nbytes, kv.storage.device)
        return self._staging[:num_blocks]
