"""Paged attention backends behind one interface.

A backend has ``prepare(meta) -> state`` (once per step) and
``forward(q, k, v, k_cache, v_cache, state, scale) -> out`` (once per layer;
writes the step's K/V into the cache at ``meta.slot_mapping`` then attends).
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from executor_svc.attention import cpu_kernel
from executor_svc.attention.metadata import AttentionMetadata, PrefillSpan
from executor_svc.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "cpp", "triton")


def triton_available() -> bool:
    """True when the triton package is importable (it is not needed on CPU)."""
    return importlib.util.find_spec("triton") is not None


def get_backend(name: str, device: torch.device, dtype: torch.dtype):
    """Returns the attention backend for a device.

    ``auto`` picks the Triton kernels on CUDA when triton is installed; on the
    CPU the C++ decode kernel when it is already built (see cpu_kernel), else
    the torch backend.

    Raises:
        ValueError: an unknown name, or a backend this machine cannot run.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; use one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = _auto_backend(device)
        if name == "cpp":
            try:
                return _cpp_backend(dtype)
            except Exception as exc:  # a broken build must not stop the executor
                warnings.warn(f"C++ attention kernel unusable ({exc}); using the torch backend", stacklevel=2)
                return TorchAttentionBackend(dtype)
    if name == "cpp":
        if device.type != "cpu" or not (cpu_kernel.is_built() or cpu_kernel.can_build()):
            raise ValueError("attention backend 'cpp' needs the CPU device and a C++ compiler with ninja")
        return _cpp_backend(dtype)
    if name == "triton":
        if device.type != "cuda" or not triton_available():
            raise ValueError("attention backend 'triton' needs a CUDA device and the triton package")
        from executor_svc.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(dtype)
    return TorchAttentionBackend(dtype)


def _cpp_backend(dtype: torch.dtype):
    from executor_svc.attention.cpp_backend import CppAttentionBackend

    return CppAttentionBackend(dtype)


def _auto_backend(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton" if triton_available() else "torch"
    if device.type == "cpu" and cpu_kernel.is_built():
        return "cpp"
    return "torch"


__all__ = ["AttentionMetadata", "PrefillSpan", "TorchAttentionBackend", "get_backend", "triton_available"]
