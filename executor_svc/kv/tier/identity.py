"""The model identity a stored block belongs to: what the weights are, and how they are run.

Two executors give a token the same KV only with the same weights in the same
dtype, so a tier's blocks are keyed by a digest of the checkpoint's config and
the names and sizes of its weight files (reading every byte of the weights at
start would cost seconds per GiB), plus the dtype the executor computes in.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Files whose content changes the KV a token gets; weight files count by name and size.
_CONTENT_FILES = ("config.json",)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def model_identity(model_path: str | Path, dtype: str, **extra: str) -> str:
    """A text naming the weights at model_path run in dtype (and anything in extra, e.g. a quantization)."""
    path = Path(model_path)
    digest = hashlib.blake2b(digest_size=16)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for file in files:
        if file.name in _CONTENT_FILES:
            digest.update(f"{file.name}\0".encode() + file.read_bytes())
        elif file.suffix in _WEIGHT_SUFFIXES:
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
    parts = [f"model={path.name}", f"weights={digest.hexdigest()}", f"dtype={dtype}"]
    parts += [f"{key}={value}" for key, value in sorted(extra.items())]
    return ";".join(parts)
