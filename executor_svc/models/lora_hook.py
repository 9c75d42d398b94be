"""The hook through which a step's LoRA deltas reach the model code (``executor_svc.lora`` implements it).

A model's ``forward`` takes ``lora: LoraDeltas | None``. None, a step in which
no row has an adapter, runs exactly the code it runs without LoRA, the
one-call fused decode included. Otherwise each layer calls ``lora.add`` right
after each of its four fused linear layers, with that layer's input and
output; the deltas land on the rows of the sequences whose adapter targets
that linear layer, and rows of the base model are left as they are.
"""

from __future__ import annotations

from typing import Protocol

import torch

# The fused linear layers of a decoder layer, as the models hold them (attention_layer, mlp).
QKV = "qkv"  # [(H + 2 KVH) Dh, hidden]: q, k, v
O_PROJ = "o_proj"  # [hidden, H Dh]
GATE_UP = "gate_up"  # [2 I, hidden]: gate, up
DOWN = "down"  # [hidden, I]
LINEARS = (QKV, O_PROJ, GATE_UP, DOWN)


class LoraDeltas(Protocol):
    """A step's LoRA deltas, added layer by layer."""

    def targets(self, layer: int, linear: str) -> bool:
        """Whether any adapter of the step adapts ``linear`` (one of ``LINEARS``) of layer ``layer``."""
        ...

    def add(self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Adds to ``out`` [T, out] in place the deltas of ``linear`` of layer ``layer`` for its input ``x`` [T, in]."""
        ...
