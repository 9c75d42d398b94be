"""What every quantized linear layer is to the layer ops that run it."""

from __future__ import annotations

import torch


class QuantizedLinear:
    """A quantized linear layer: ``layer(x [..., in], bias) -> [..., out]``; ``path`` names what runs it."""

    path: str
    out_features: int
    format: str = ""  # the weights' format: int8, q4_1, ...

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError
