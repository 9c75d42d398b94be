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

from executor_svc.models.layer_ops import LayerOps, PackedWeight, PanelWeight, WidenedWeight
from executor_svc.models.rope import RotaryEmbedding
from executor_svc.quant.base import QuantizedLinear
from executor_svc.quant.gguf_blocks import GgufRows, GgufWeight


def packed_path(packed: Any) -> str:
    """How a packed weight is multiplied: a quantized layer's path, our panel GEMMs, oneDNN or torch."""
    if isinstance(packed, QuantizedLinear):
        return packed.path
    if isinstance(packed, (PanelWeight, WidenedWeight)):
        return packed.path
    if isinstance(packed, PackedWeight):
        return "onednn"
    return "torch"


class ConcatLinear(QuantizedLinear):
    """Weights of different formats fused along rows (a K-quant mix's q/k/v): each part multiplies x and the
    outputs sit side by side."""

    def __init__(self, parts: list[Any], sizes: list[int], linear: Any):
        self.parts = parts
        self.sizes = sizes  # output features of each part
        self.linear = linear
        self.out_features = sum(sizes)
        self.path = "+".join(dict.fromkeys(packed_path(part) for part in parts))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts if isinstance(part, QuantizedLinear))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outputs, start = [], 0
        for part, size in zip(self.parts, self.sizes):
            outputs.append(self.linear(x, part, None if bias is None else bias[start : start + size]))
            start += size
        return torch.cat(outputs, dim=-1)


class QuantizedLayerOps:
    """``base``'s ops, with ``quantize(weight) -> QuantizedLinear | None`` applied to every linear weight."""

    def __init__(self, base: LayerOps, quantize: Any):
        self.base = base
        self.name = base.name
        self.quantize = quantize
        # Path -> how many weights run it (what Describe reports as the gemm path), the weight formats
        # quantized (in order), and the bytes the quantized layers hold.
        self.gemm_paths: dict[str, int] = {}
        self.formats: dict[str, int] = {}
        self.quantized_bytes = 0

    def pack(self, weight: Any, dense: bool = False) -> Any:
        """A linear weight quantized (or, with ``dense`` or when the quantization keeps it, packed by the base).

        GGUF blocks are always multiplied as they are (there is no dense copy to keep); weights of several
        formats fused along rows become one layer of parts.
        """
        if isinstance(weight, GgufRows):
            parts = [self.pack(part, dense) for part in weight.parts]
            return ConcatLinear(parts, [part.shape[0] for part in weight.parts], self.linear)
        layer = None if dense and not isinstance(weight, GgufWeight) else self.quantize(weight)
        packed = self.base.pack(weight) if layer is None else layer
        path = packed_path(packed)
        self.gemm_paths[path] = self.gemm_paths.get(path, 0) + 1
        if layer is not None:
            self.quantized_bytes += layer.nbytes
            self.formats[layer.format] = self.formats.get(layer.format, 0) + 1
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

    def rotary_for(self, rope: RotaryEmbedding, rope_rows: torch.Tensor) -> Any:
        return self.base.rotary_for(rope, rope_rows)

    def rotate(self, x: torch.Tensor, rotary: Any) -> torch.Tensor:
        return self.base.rotate(x, rotary)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.base.argmax(logits)
