"""Layer ops whose linear weights are quantized at pack time; every other op is the base layer ops'.

The model code does not change with quantization: it packs each linear
weight once (``ops.pack``) and multiplies by it (``ops.linear``). Wrapped in
``QuantizedLayerOps``, ``pack`` hands a weight to the quantization, which
returns a ``QuantizedLinear`` (or None: the weight stays dense and the base
ops pack it), and ``linear`` runs it. A weight packed with ``dense=True``
(MoE routers: tiny, and they steer which experts run) is never quantized.
"""

from __future__ import annotations

from typing import Any

import torch

from executor_svc.models.layer_ops import LayerOps, PackedWeight, PanelWeight
from executor_svc.models.rope import RotaryEmbedding


class QuantizedLinear:
    """A quantized linear layer: ``layer(x [..., in], bias) -> [..., out]``; ``path`` names what runs it."""

    path: str
    out_features: int

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


def packed_path(packed: Any) -> str:
    """How a packed weight is multiplied: a quantized layer's path, our panel GEMMs, oneDNN or torch."""
    if isinstance(packed, QuantizedLinear):
        return packed.path
    if isinstance(packed, PanelWeight):
        return "amx-panel" if packed.panels.dtype == torch.bfloat16 else "avx512-panel"
    if isinstance(packed, PackedWeight):
        return "onednn"
    return "torch"


class QuantizedLayerOps:
    """``base``'s ops, with ``quantize(weight) -> QuantizedLinear | None`` applied to every linear weight."""

    def __init__(self, base: LayerOps, quantize: Any):
        self.base = base
        self.name = base.name
        self.quantize = quantize
        # Path -> how many weights run it (what Describe reports as the gemm path), and the bytes they hold.
        self.gemm_paths: dict[str, int] = {}
        self.quantized_bytes = 0

    def pack(self, weight: Any, dense: bool = False) -> Any:
        """A linear weight quantized (or, with ``dense`` or when the quantization keeps it, packed by the base)."""
        layer = None if dense else self.quantize(weight)
        packed = self.base.pack(weight) if layer is None else layer
        path = packed_path(packed)
        self.gemm_paths[path] = self.gemm_paths.get(path, 0) + 1
        if layer is not None:
            self.quantized_bytes += layer.nbytes
        return packed

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, QuantizedLinear):
            return weight(x, bias)
        return self.base.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.base.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.base.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.base.silu_and_mul(gate_up)

    def rotary_for(self, rope: RotaryEmbedding, positions: torch.Tensor) -> Any:
        return self.base.rotary_for(rope, positions)

    def rotate(self, x: torch.Tensor, rotary: Any) -> torch.Tensor:
        return self.base.rotate(x, rotary)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.base.argmax(logits)
