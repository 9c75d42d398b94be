"""The decoder's elementwise ops: fused C++ kernels on the CPU, plain torch elsewhere.

``layer_ops(device)`` picks the C++ ops (executor_svc/native/cpu_ops.cpp) on
the CPU when they are already built, else the torch versions; both have the
same interface so the model code does not branch.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from executor_svc.models.rope import RotaryEmbedding, apply_rotary
from executor_svc.native import build


class TorchLayerOps:
    """Reference implementations in torch (any device)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of x [N, H]."""
        return F.rms_norm(x, x.shape[-1:], weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place; returns RMSNorm(residual)."""
        residual.add_(x)
        return F.rms_norm(residual, residual.shape[-1:], weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_for(self, rope: RotaryEmbedding, positions: torch.Tensor):
        """Per-step rotary state for ``rotate`` (looked up once, used by every layer)."""
        return rope.lookup(positions)

    def rotate(self, x: torch.Tensor, rotary) -> torch.Tensor:
        """x [T, N, Dh] rotated (a new tensor or x itself)."""
        cos, sin = rotary
        return apply_rotary(x, cos, sin)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax [B, V] -> [B] int64 (first index of the max; NaN counts as max)."""
        return logits.argmax(dim=-1)


class CppLayerOps(TorchLayerOps):
    """The fused C++ CPU kernels; rotates in place."""

    name = "cpp"

    def __init__(self):
        self.kernel = build.OPS.load()

    def rms_norm(self, x, weight, eps):
        return self.kernel.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernel.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        return self.kernel.silu_and_mul(gate_up)

    def rotary_for(self, rope, positions):
        return positions, rope.cos, rope.sin

    def rotate(self, x, rotary):
        self.kernel.rotary_(x, *rotary)
        return x

    def argmax(self, logits):
        if logits.dtype == torch.bfloat16 and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1]:
            return self.kernel.argmax_rows(logits)
        return logits.argmax(dim=-1)


def layer_ops(device: torch.device) -> TorchLayerOps:
    """The C++ ops on a CPU where they are built from the current source, else torch."""
    if device.type != "cpu" or not build.OPS.is_built():
        return TorchLayerOps()
    try:
        return CppLayerOps()
    except Exception as exc:  # a broken build must not stop the executor
        warnings.warn(f"C++ layer ops unusable ({exc}); using torch", stacklevel=2)
        return TorchLayerOps()
