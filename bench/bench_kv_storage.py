"""Storage for the KV offload tier: plain files (the tier's own DiskTier) vs SQLite vs LMDB, side by side.

Writes then reads N blocks of the served model's block size (SmolLM2-135M bf16:
720 KiB) through each store, from one thread, none of them syncing to disk (the
tier does not fsync: a torn file is a checksum miss), and prints MiB/s of each
and the ratios to files. Reads come from the page cache (the tier's common
case after a restart of the process, not of the machine). LMDB is measured when
the ``lmdb`` package is installed (it is not a dependency of Pagoda).

Usage:
    python bench/bench_kv_storage.py --blocks 200 --block-kib 720 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from executor_svc.kv.tier.block_file import TierNamespace, checksum, encode_header
from executor_svc.kv.tier.disk_tier import DiskTier

Store = tuple[Callable[[int, bytes], None], Callable[[int], bytes], Callable[[], None]]


def files(root: Path, block_nbytes: int) -> Store:
    ns = TierNamespace("bench", "bench", block_nbytes, 32)
    disk = DiskTier(root / "files", ns, 1 << 40)
    disk.scan()
    tokens = tuple(range(32))
    out = torch.empty(block_nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")

    def put(key: int, data: bytes) -> None:
        disk.write(key, encode_header(ns, key, tokens, checksum(data)), memoryview(data))

    def get(key: int) -> bytes:
        disk.read_into(key, tokens, view)
        return b""

    return put, get, lambda: None


def sqlite(root: Path, block_nbytes: int) -> Store:
    db = sqlite3.connect(root / "blocks.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("CREATE TABLE blocks (hash INTEGER PRIMARY KEY, data BLOB)")

    def put(key: int, data: bytes) -> None:
        db.execute("INSERT INTO blocks VALUES (?, ?)", (key, data))

    def get(key: int) -> bytes:
        row = db.execute("SELECT data FROM blocks WHERE hash = ?", (key,)).fetchone()
        return bytes(row[0])

    return put, get, db.close


def lmdb_store(root: Path, block_nbytes: int) -> Store | None:
    try:
        import lmdb
    except ImportError:
        return None
    env = lmdb.open(str(root / "blocks.lmdb"), map_size=1 << 36, sync=False, metasync=False, writemap=True)

    def put(key: int, data: bytes) -> None:
        with env.begin(write=True) as txn:
            txn.put(key.to_bytes(8, "little"), data)

    def get(key: int) -> bytes:
        with env.begin(buffers=True) as txn:
            return bytes(txn.get(key.to_bytes(8, "little")))

    return put, get, env.close


def measure(store: Store, blocks: list[bytes]) -> tuple[float, float]:
    """(write MiB/s, read MiB/s) of the blocks through one store."""
    put, get, close = store
    total = sum(len(b) for b in blocks) / 2**20
    start = time.perf_counter()
    for key, data in enumerate(blocks, 1):
        put(key, data)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for key in range(1, len(blocks) + 1):
        get(key)
    read_s = time.perf_counter() - start
    close()
    return total / write_s, total / read_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--block-kib", type=int, default=720)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    blocks = [os.urandom(args.block_kib * 1024) for _ in range(args.blocks)]
    makers = {"files": files, "sqlite": sqlite, "lmdb": lmdb_store}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in makers}
    for round_index in range(args.rounds):
        for name, make in makers.items():
            with tempfile.TemporaryDirectory(prefix="bench-kv-storage-") as tmp:
                store = make(Path(tmp), args.block_kib * 1024)
                if store is None:
                    continue
                write, read = measure(store, blocks)
            results[name].append((write, read))
            print(f"round {round_index + 1} {name}: write {write:.0f} MiB/s, read {read:.0f} MiB/s", flush=True)
    medians = {
        name: (statistics.median(w for w, _ in runs), statistics.median(r for _, r in runs))
        for name, runs in results.items()
        if runs
    }
    for name, (write, read) in medians.items():
        ratio_w, ratio_r = write / medians["files"][0], read / medians["files"][1]
        print(f"{name}: median write {write:.0f} MiB/s ({ratio_w:.2f}x files), read {read:.0f} MiB/s ({ratio_r:.2f}x)")
    if "lmdb" not in medians:
        print("lmdb: not installed (pip install lmdb to measure it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
