"""The disk tier: one file per block in one directory, an in-memory index in LRU order, a byte capacity.

A block is written to a temporary file and renamed into place, so a reader sees
a whole file or none (a crash leaves only a temporary file, removed at the next
start). At start the directory is scanned, headers only, oldest first by mtime:
every valid block is indexed, anything else is deleted and counted. A hit
touches the file's mtime, so the LRU order survives a restart. Thread-safe:
the writer thread writes while the model thread reads.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from executor_svc.kv.tier.block_file import BadBlock, TierNamespace, checksum, decode_header

log = structlog.get_logger("executor")
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
# Opens a temporary block file for writing; returns its descriptor (a test passes one that opens /dev/full).
Opener = Callable[[Path], int]


def open_for_write(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


class DiskTier:
    """Block files of one namespace under ``directory``, at most ``capacity_bytes`` of them."""

    def __init__(self, directory: Path, ns: TierNamespace, capacity_bytes: int, opener: Opener = open_for_write):
        if capacity_bytes < ns.file_bytes():
            raise ValueError(f"--kv-offload-size {capacity_bytes} B holds no block (one is {ns.file_bytes()} B)")
        self.dir = directory
        self.ns = ns
        self.capacity_bytes = capacity_bytes
        self._opener = opener
        self._lock = threading.Lock()
        # block hash -> file bytes, least recently used first.
        self._index: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.num_bytes = 0
        # Files found bad at the scan, by reason.
        self.rejected_at_scan: collections.Counter[str] = collections.Counter()
        self._tmp_seq = 0

    # -- index ---------------------------------------------------------------

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def scan(self) -> list[int]:
        """Indexes every valid block file (headers only, oldest first); deletes the rest. Returns evicted hashes."""
        self.dir.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, int, Path]] = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    _unlink(Path(entry.path))  # an interrupted write
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    block_hash = _hash_of(entry.name)
                    if block_hash is None:
                        self._reject_file(Path(entry.path), "not a block file")
                    else:
                        found.append((entry.stat().st_mtime, block_hash, Path(entry.path)))
        for _mtime, block_hash, path in sorted(found):
            try:
                self._check_file(path, block_hash)
            except (BadBlock, OSError) as exc:
                self._reject_file(path, exc.reason if isinstance(exc, BadBlock) else "read error")
                continue
            self._index[block_hash] = self.ns.file_bytes()
            self.num_bytes += self.ns.file_bytes()
        return self._evict_to(self.capacity_bytes)

    def _check_file(self, path: Path, block_hash: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.ns.file_bytes():
                raise BadBlock("truncated", f"{size} bytes, a block file has {self.ns.file_bytes()}")
            decode_header(self.ns, os.pread(fd, self.ns.header_bytes(self.ns.block_size), 0), block_hash)
        finally:
            os.close(fd)

    def _reject_file(self, path: Path, reason: str) -> None:
        self.rejected_at_scan[reason] += 1
        _unlink(path)

    # -- reads and writes ------------------------------------------------------

    def read_into(self, block_hash: int, token_ids: Sequence[int], payload: memoryview) -> None:
        """Reads and checks one block into ``payload`` (its block_nbytes).

        Raises:
            FileNotFoundError: not stored (evicted meanwhile).
            BadBlock: the file fails a check (header, size, checksum, token ids); the caller removes it.
        """
        ns = self.ns
        header = bytearray(ns.header_bytes(ns.block_size))
        extra = bytearray(1)
        fd = os.open(self.path(block_hash), os.O_RDONLY)
        try:
            num_read = os.readv(fd, [header, payload, extra])
        finally:
            os.close(fd)
        if num_read != ns.file_bytes():
            raise BadBlock("truncated", f"{num_read} bytes or more, a block file has {ns.file_bytes()}")
        stored = decode_header(ns, header, block_hash)
        if checksum(payload) != stored.payload_crc:
            raise BadBlock("checksum", "the payload does not match its CRC-32C")
        if stored.token_ids != tuple(token_ids):
            raise BadBlock("token ids", "another prefix has this hash")
        self.touch(block_hash)

    def touch(self, block_hash: int) -> None:
        """Marks a block most recently used (in the index and in the file's mtime)."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):  # gone meanwhile: the index is what counts
            os.utime(self.path(block_hash))

    def write(self, block_hash: int, header: bytes, payload: memoryview) -> list[int]:
        """Stores a block (evicting least recently used ones first); returns the evicted hashes.

        Raises:
            OSError: the write failed (e.g. ENOSPC); nothing is left behind and the block is not stored.
        """
        size = len(header) + len(payload)
        with self._lock:
            if block_hash in self._index:
                return []
            evicted = self._evict_to(self.capacity_bytes - size)
            self._tmp_seq += 1
            tmp = self.dir / f"{TMP_PREFIX}{threading.get_ident()}-{self._tmp_seq}"
        try:
            _write_file(self._opener(tmp), [header, payload])
            os.replace(tmp, self.path(block_hash))
        except OSError:
            _unlink(tmp)
            raise
        with self._lock:
            self._index[block_hash] = size
            self.num_bytes += size
        return evicted

    def remove(self, block_hash: int) -> bool:
        """Deletes a block (a bad file); False when it was not indexed."""
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.num_bytes -= size
        _unlink(self.path(block_hash))
        return size is not None

    def _evict_to(self, max_bytes: int) -> list[int]:
        """Deletes least recently used blocks until at most max_bytes are stored (lock held or at scan)."""
        evicted = []
        while self._index and self.num_bytes > max_bytes:
            block_hash, size = self._index.popitem(last=False)
            self.num_bytes -= size
            _unlink(self.path(block_hash))
            evicted.append(block_hash)
        return evicted


def _write_file(fd: int, buffers: list[bytes | memoryview]) -> None:
    try:
        views = [memoryview(b).cast("B") for b in buffers]
        while views:
            written = os.writev(fd, views)
            while views and written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            if views and written:
                views[0] = views[0][written:]
    finally:
        os.close(fd)


def _hash_of(name: str) -> int | None:
    stem = name[: -len(SUFFIX)]
    if len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
