"""Gated activations of the feed-forward blocks, by the name config.json gives them.

Each takes the fused gate-and-up projection [N, 2I] (gate first) and returns
act(gate) * up [N, I]. SiLU (SwiGLU: Llama, Qwen, Phi-3, Mixtral) is the layer
ops' fused kernel; the tanh-approximated GELU (GeGLU: Gemma) is torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from executor_svc.models.layer_ops import LayerOps

GatedActivation = Callable[[torch.Tensor], torch.Tensor]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate then up) -> gelu_tanh(gate) * up [N, I], rounded where transformers rounds."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# config.json activation name -> the gated activation, given the model's layer ops.
_ACTIVATIONS: dict[str, Callable[[LayerOps], GatedActivation]] = {
    "silu": lambda ops: ops.silu_and_mul,
    "swish": lambda ops: ops.silu_and_mul,
    "gelu_pytorch_tanh": lambda ops: gelu_tanh_and_mul,
    "gelu_tanh": lambda ops: gelu_tanh_and_mul,
}


def gated_activation(name: str, ops: LayerOps) -> GatedActivation:
    """The gated activation called ``name`` in config.json.

    Raises:
        ValueError: an activation no family here implements (the message lists those that are).
    """
    return _ACTIVATIONS[check_activation(name)](ops)


def check_activation(name: str) -> str:
    """``name`` when it is supported (config hooks call this, so a bad one fails before weights are read).

    Raises:
        ValueError: as ``gated_activation``.
    """
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return name
