"""The dense gated feed-forward block (SwiGLU, GeGLU) and the contract every feed-forward block follows.

A decoder layer calls its block as ``block(x)``: the dense one here, or a
mixture of experts (``models.moe``). Each family's model says which block each
layer gets through a ``FeedForwardLoader``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.activations import GatedActivation, gated_activation
from executor_svc.models.attention_layer import TensorGetter, TensorTest
from executor_svc.models.layer_ops import LayerOps
from executor_svc.models.lora_hook import DOWN, GATE_UP, LoraDeltas


class FeedForward(Protocol):
    """A layer's feed-forward block: [T, hidden] -> [T, hidden]."""

    path: str  # what runs it, as reported with the kernel paths ("dense", "moe-grouped")

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# (config, layer index, get, has, ops) -> the layer's block; get/has read names inside model.layers.N.
FeedForwardLoader = Callable[[ModelConfig, int, TensorGetter, TensorTest, LayerOps], FeedForward]


class GatedMlp:
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    path = "dense"

    def __init__(self, ops: LayerOps, gate_up: Any, down: Any, act: GatedActivation, silu: bool = False):
        self.linear = ops.linear
        self.gate_up = gate_up  # [2 * I, hidden], maybe packed
        self.down = down  # [hidden, I], maybe packed
        self.act = act
        # SwiGLU with a gate/up layer that computes act(gate_up(x)) in one pass itself (int8 on AMX), else None.
        self.fused_act = getattr(gate_up, "silu_and_mul", None) if silu else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.linear(self._activated(x), self.down)

    def with_lora(self, x: torch.Tensor, lora: LoraDeltas, layer: int) -> torch.Tensor:
        """As ``__call__``, with the step's LoRA deltas of layer ``layer`` added to gate/up and down."""
        if lora.targets(layer, GATE_UP):  # the delta goes in before the activation: no fused gate_up + act
            gate_up = self.linear(x, self.gate_up)  # [T, 2I]
            lora.add(layer, GATE_UP, x, gate_up)
            hidden = self.act(gate_up)
        else:
            hidden = self._activated(x)
        out = self.linear(hidden, self.down)
        lora.add(layer, DOWN, hidden, out)
        return out

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x) [T, I]: in one pass where the gate/up layer computes it (int8 on AMX)."""
        hidden = self.fused_act(x) if self.fused_act is not None else None
        return self.act(self.linear(x, self.gate_up)) if hidden is None else hidden


def with_lora(block: FeedForward, x: torch.Tensor, lora: LoraDeltas, layer: int) -> torch.Tensor:
    """A layer's block with the step's LoRA deltas; a mixture of experts runs as it is (executor_svc.lora refuses
    adapters of expert weights, so none targets it)."""
    return block.with_lora(x, lora, layer) if isinstance(block, GatedMlp) else block(x)


def feed_forward_path(blocks: list[FeedForward]) -> str:
    """The model's feed-forward path: its blocks' distinct paths in layer order ("moe-grouped+dense")."""
    return "+".join(dict.fromkeys(block.path for block in blocks))


def load_gated_mlp(config: ModelConfig, index: int, get: TensorGetter, has: TensorTest, ops: LayerOps) -> GatedMlp:
    """The layer's dense block from ``mlp.gate_proj``/``up_proj``/``down_proj`` (or Phi-3's fused ``gate_up_proj``)."""
    if has("mlp.gate_up_proj.weight"):
        gate_up = get("mlp.gate_up_proj.weight")
    else:
        gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
    act = gated_activation(config.hidden_act, ops)
    silu = config.hidden_act in ("silu", "swish")
    return GatedMlp(ops, ops.pack(gate_up), ops.pack(get("mlp.down_proj.weight")), act, silu)


def gated_mlp_shapes(hidden: int, intermediate: int, prefix: str, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """The dense block's tensors (``<prefix>mlp.gate_proj.weight``, ...), with their shapes."""
    p = prefix + "mlp."
    down = {p + "down_proj.weight": (hidden, intermediate)}
    if fused:
        return {p + "gate_up_proj.weight": (2 * intermediate, hidden), **down}
    return {p + "gate_proj.weight": (intermediate, hidden), p + "up_proj.weight": (intermediate, hidden), **down}
