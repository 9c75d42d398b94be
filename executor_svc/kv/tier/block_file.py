"""One stored KV block: a header that says what it is, then its bytes.

A block file (and a block in host memory) is a fixed header, the block's token
ids, and the payload: every tensor the KV cache holds for one block id, laid
out as ``KVCache.read_blocks`` writes them. The header names the block's hash,
the model identity and the KV layout (as digests of their texts), the payload's
length and CRC-32C, and carries a CRC-32C of itself. A block whose header or
payload does not match what this executor expects is a miss, never used.

CRC-32C rather than zlib's CRC-32 or a hash: ~18 GiB/s with the CPU's crc32
instruction against ~3.6 GiB/s (one 720 KiB block, this machine), so verifying
a block costs a fraction of reading it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from array import array
from collections.abc import Sequence

import crc32c

MAGIC = b"PGDKVB\x00\x01"
FORMAT_VERSION = 1
# magic, version, header length, block hash, payload length, payload crc, token count, identity, layout, header crc
_FIXED = struct.Struct("<8sIIQQII16s16sI")
FIXED_HEADER_BYTES = _FIXED.size
# The most token ids a header carries (a block of more tokens is refused when the tier opens).
MAX_BLOCK_TOKENS = 4096


class BadBlock(Exception):
    """A stored block that must not be used; the message says which check failed."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def checksum(data: memoryview | bytes) -> int:
    """CRC-32C of data (the CPU's instruction where it has one; the GIL is released for large buffers)."""
    return int(crc32c.crc32c(data))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclasses.dataclass(frozen=True)
class TierNamespace:
    """What every block of one tier directory belongs to: one model, one KV layout.

    ``identity`` names the weights (config and weight files' digest, dtype, anything that changes the KV a
    token gets); ``layout`` is ``KVCache.block_layout()`` (block size, KV dtype, per-block shape of each tensor).
    """

    identity: str
    layout: str
    block_nbytes: int
    block_size: int

    @property
    def identity_digest(self) -> bytes:
        return _digest(self.identity)

    @property
    def layout_digest(self) -> bytes:
        return _digest(self.layout)

    @property
    def dirname(self) -> str:
        """The subdirectory of the tier root for this model and layout (another one sees an empty tier)."""
        return f"model-{self.identity_digest.hex()[:16]}-kv-{self.layout_digest.hex()[:8]}"

    def header_bytes(self, num_tokens: int) -> int:
        return FIXED_HEADER_BYTES + 4 * num_tokens

    def file_bytes(self) -> int:
        """Size of one block file (header, token ids, payload)."""
        return self.header_bytes(self.block_size) + self.block_nbytes


@dataclasses.dataclass(frozen=True)
class BlockHeader:
    """A decoded, checked header."""

    block_hash: int
    payload_len: int
    payload_crc: int
    token_ids: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return FIXED_HEADER_BYTES + 4 * len(self.token_ids)


def encode_header(ns: TierNamespace, block_hash: int, token_ids: Sequence[int], payload_crc: int) -> bytes:
    """The header of a block of ns with this hash, tokens and payload CRC."""
    tokens = _token_bytes(token_ids)
    fields = (MAGIC, FORMAT_VERSION, FIXED_HEADER_BYTES + len(tokens), block_hash, ns.block_nbytes, payload_crc)
    body = _FIXED.pack(*fields, len(token_ids), ns.identity_digest, ns.layout_digest, 0)[:-4]
    return body + struct.pack("<I", checksum(body + tokens)) + tokens


def decode_header(ns: TierNamespace, data: memoryview | bytes, block_hash: int | None = None) -> BlockHeader:
    """The header at the start of data, checked against ns (and against block_hash when given).

    Raises:
        BadBlock: too short, not a block, another format version, a damaged header, another model or
            layout, another hash, or a payload length that is not this layout's.
    """
    if len(data) < FIXED_HEADER_BYTES:
        raise BadBlock("truncated", f"{len(data)} bytes, a header needs {FIXED_HEADER_BYTES}")
    magic, version, header_len, stored_hash, payload_len, payload_crc, num_tokens, identity, layout, crc = (
        _FIXED.unpack_from(data)
    )
    if magic != MAGIC:
        raise BadBlock("not a block file")
    if version != FORMAT_VERSION:
        raise BadBlock("format version", f"{version}, this executor reads {FORMAT_VERSION}")
    if num_tokens > MAX_BLOCK_TOKENS or header_len != FIXED_HEADER_BYTES + 4 * num_tokens:
        raise BadBlock("header checksum", "inconsistent lengths")
    if len(data) < header_len:
        raise BadBlock("truncated", f"{len(data)} bytes, the header needs {header_len}")
    tokens = bytes(data[FIXED_HEADER_BYTES:header_len])
    if checksum(bytes(data[: FIXED_HEADER_BYTES - 4]) + tokens) != crc:
        raise BadBlock("header checksum")
    if identity != ns.identity_digest:
        raise BadBlock("model identity", "written for another model")
    if layout != ns.layout_digest or payload_len != ns.block_nbytes:
        raise BadBlock("layout", "written with another KV dtype, block size or shape")
    if block_hash is not None and stored_hash != block_hash:
        raise BadBlock("block hash", f"holds {stored_hash:016x}")
    return BlockHeader(stored_hash, payload_len, payload_crc, _token_ids(tokens))


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    values = array("i", token_ids)
    if values.itemsize != 4:  # pragma: no cover - every platform we build for has 32-bit C ints
        raise RuntimeError("array('i') is not 32-bit here")
    if array("H", b"\x01\x00")[0] != 1:  # pragma: no cover - big-endian hosts
        values.byteswap()
    return values.tobytes()


def _token_ids(data: bytes) -> tuple[int, ...]:
    values = array("i")
    values.frombytes(data)
    if array("H", b"\x01\x00")[0] != 1:  # pragma: no cover - big-endian hosts
        values.byteswap()
    return tuple(values)
