"""Opening the offload tier an executor's flags describe: lock the directory, scan it, size the tiers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from executor_svc.config import ExecutorConfig
from executor_svc.kv.cache import KVCache
from executor_svc.kv.tier.block_file import TierNamespace
from executor_svc.kv.tier.dir_lock import TierDirLock, lock_tier_dir
from executor_svc.kv.tier.disk_tier import DiskTier
from executor_svc.kv.tier.memory_tier import MemoryTier
from executor_svc.kv.tier.store import TierStore

log = structlog.get_logger("executor")


@dataclasses.dataclass
class OpenTier:
    """A tier ready to serve, the lock on its directory, and the line Describe reports."""

    store: TierStore
    lock: TierDirLock | None
    description: str

    def close(self, timeout_s: float) -> None:
        """Stores what is queued (bounded), then gives the directory up."""
        self.store.close(timeout_s)
        if self.lock is not None:
            self.lock.release()


def lock_dir(config: ExecutorConfig) -> TierDirLock | None:
    """The lock on config's --kv-offload-dir, taken before anything else is loaded (None: no disk tier).

    Raises:
        TierDirBusy: the directory is held by another live process (named, with its pid).
    """
    if not config.kv_offload_dir:
        return None
    return lock_tier_dir(Path(config.kv_offload_dir).expanduser(), config.kv_offload_dir_next_free)


def open_tier(
    config: ExecutorConfig,
    kv_cache: KVCache,
    identity: str,
    lock: TierDirLock | None,
    on_store_s: Callable[[float], None] = lambda s: None,
) -> OpenTier | None:
    """The tier of config's --kv-offload-* flags (disk under ``lock``'s directory) for blocks of kv_cache.

    None: no tier asked for.

    Raises:
        ValueError: a capacity too small for one block.
    """
    if lock is None and not config.kv_offload_memory:
        return None
    ns = TierNamespace(identity, kv_cache.block_layout(), kv_cache.block_nbytes, kv_cache.spec.block_size)
    on_cuda = kv_cache.storage.is_cuda
    memory = MemoryTier(config.kv_offload_memory, ns.block_nbytes, pin=on_cuda) if config.kv_offload_memory else None
    disk = None
    if lock is not None:
        disk = DiskTier(lock.directory / ns.dirname, ns, config.kv_offload_size)
        evicted = disk.scan()
        _describe_namespace(disk.dir, ns)
        _warn_if_disk_small(disk)
        log.info(
            "kv_offload_scanned",
            directory=str(disk.dir),
            num_blocks=len(disk),
            num_bytes=disk.num_bytes,
            rejected=dict(disk.rejected_at_scan),
            num_evicted=len(evicted),
        )
    store = TierStore(ns, disk, memory, config.kv_offload_queue, on_store_s)
    return OpenTier(store, lock, _description(disk, memory))


def _description(disk: DiskTier | None, memory: MemoryTier | None) -> str:
    parts = []
    if memory is not None:
        parts.append(f"memory {_gib(memory.num_slots * memory.block_nbytes)}")
    if disk is not None:
        parts.append(f"disk {_gib(disk.capacity_bytes)} at {disk.dir}")
    return "; ".join(parts)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _describe_namespace(directory: Path, ns: TierNamespace) -> None:
    """tier.json beside the blocks: what they are, for people (the headers are what is checked)."""
    text = json.dumps({"identity": ns.identity, "layout": ns.layout, "block_nbytes": ns.block_nbytes}, indent=1)
    (directory / "tier.json").write_text(text + "\n")


def _warn_if_disk_small(disk: DiskTier) -> None:
    free = shutil.disk_usage(disk.dir).free
    if free + disk.num_bytes < disk.capacity_bytes:
        log.warning(
            "kv_offload_disk_smaller_than_capacity",
            directory=str(disk.dir),
            capacity_bytes=disk.capacity_bytes,
            free_bytes=free,
            note="writes are dropped and counted when the disk is full",
        )


def pinned_staging(num_blocks: int, block_nbytes: int, device: torch.device) -> torch.Tensor:
    """A host buffer [num_blocks, block_nbytes] uint8 for loads and saves (pinned when the KV lives on CUDA)."""
    return torch.empty((num_blocks, block_nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda")
