"""Paged attention backends behind one interface (``AttentionBackend``, see registry).

A backend has ``prepare(meta) -> state`` (once per step) and
``forward(q, k, v, k_cache, v_cache, state, scale) -> out`` (once per layer;
writes the step's K/V into the cache at ``meta.slot_mapping`` then attends).
"""

from __future__ import annotations

from executor_svc.attention.metadata import AttentionMetadata, PrefillSpan
from executor_svc.attention.registry import (
    BACKENDS,
    AttentionBackend,
    backend_names,
    get_backend,
    triton_available,
)
from executor_svc.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "PrefillSpan",
    "TorchAttentionBackend",
    "backend_names",
    "get_backend",
    "triton_available",
]
