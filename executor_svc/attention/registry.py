"""The attention backend contract and the registry of backends, by name.

A backend is one module with a class following ``AttentionBackend`` plus one
``BACKENDS.register`` entry below, saying where it can run and where ``auto``
ranks it.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol

import torch

from executor_svc.attention import cpp_backend
from executor_svc.attention.implementations import Implementation, ImplementationRegistry
from executor_svc.attention.metadata import AttentionMetadata
from executor_svc.attention.torch_backend import TorchAttentionBackend
from executor_svc.kv.cache import LayerKV


class AttentionBackend(Protocol):
    """Paged attention over the step's flattened tokens."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step state (block tables, masks) built once and passed to every layer's ``forward``."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, KVH, Dh]
        v: torch.Tensor,  # [T, KVH, Dh]
        cache: LayerKV,  # one layer's K/V [KVH, NB, BS, Dh] (+ scales [KVH, NB, BS] when int8)
        state: Any,
        scale: float,
    ) -> torch.Tensor:
        """Writes the step's K/V into the cache at ``meta.slot_mapping`` (quantized for an int8 cache), then
        attends; returns [T, H * Dh]. Every backend reads an int8 cache (docs/quantization.md)."""
        ...


def triton_available() -> bool:
    """True when the triton package is importable (it is not needed on CPU)."""
    return importlib.util.find_spec("triton") is not None


def _triton_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type == "cuda" and triton_available():
        return None
    return "needs a CUDA device and the triton package"


def _triton(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    from executor_svc.attention.triton_backend import TritonAttentionBackend  # imports triton

    return TritonAttentionBackend(dtype)


BACKENDS: ImplementationRegistry[AttentionBackend] = ImplementationRegistry("attention backend")
# auto: the Triton kernel on CUDA; on the CPU the C++ kernels when already built; else torch.
BACKENDS.register(Implementation("triton", _triton, _triton_unavailable, auto_priority=30))
BACKENDS.register(
    Implementation(
        "cpp", lambda device, dtype: cpp_backend.CppAttentionBackend(dtype), cpp_backend.unavailable, auto_priority=20
    )
)
BACKENDS.register(Implementation("torch", lambda device, dtype: TorchAttentionBackend(dtype), auto_priority=0))


def get_backend(name: str, device: torch.device, dtype: torch.dtype, batch_invariant: bool = False) -> AttentionBackend:
    """The attention backend called ``name`` (or ``auto``'s choice) for a device and model dtype.

    ``batch_invariant``: a query row's bits depend on its sequence alone, not on the rest of the step (the C++
    kernels run every row as a decode row; Triton fixes its split of the keys). The torch backend cannot: SDPA
    blocks queries and keys by the chunk's length.

    Raises:
        ValueError: an unknown name, or a backend this machine cannot run (batch-invariant: the torch one).
    """
    backend = BACKENDS.create(name, device, dtype)
    if not batch_invariant:
        return backend
    if isinstance(backend, cpp_backend.CppAttentionBackend):
        return cpp_backend.CppAttentionBackend(dtype, batch_invariant=True)
    if backend.name == "triton":
        from executor_svc.attention.triton_backend import TritonAttentionBackend  # imports triton

        return TritonAttentionBackend(dtype, batch_invariant=True)
    reason = cpp_backend.unavailable(device, dtype) or f"the {backend.name!r} attention backend was asked for"
    raise ValueError(f"batch-invariant attention needs the cpp (CPU) or triton (CUDA) backend: {reason}")


def backend_names() -> tuple[str, ...]:
    """Every name get_backend takes."""
    return BACKENDS.names()
