"""Where each PEFT module of a model lands in Pagoda's fused linear layers.

PEFT names a module as transformers does, inside ``model.layers.N.``:
``self_attn.q_proj`` for Llama, ``self_attn.qkv_proj`` for Phi-3, which
stores q/k/v (and gate/up) fused. The models fuse them all the same way
(``models.attention_layer``, ``models.mlp``), so a module is a fused linear
layer and the columns it fills. Which modules a layer has is read from the
family's own tensor names (``ModelFamily.tensor_shapes``): a mixture-of-experts
layer has no dense ``mlp.gate_proj``, so an adapter of expert weights finds
no target and is refused.
"""

from __future__ import annotations

import dataclasses

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.lora_hook import DOWN, GATE_UP, O_PROJ, QKV
from executor_svc.models.registry import get_model_family

# Module inside model.layers.N. -> (its fused linear layer, the modules before it in that layer's columns).
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attn.q_proj": (QKV, ()),
    "self_attn.k_proj": (QKV, ("self_attn.q_proj",)),
    "self_attn.v_proj": (QKV, ("self_attn.q_proj", "self_attn.k_proj")),
    "self_attn.qkv_proj": (QKV, ()),
    "self_attn.o_proj": (O_PROJ, ()),
    "mlp.gate_proj": (GATE_UP, ()),
    "mlp.up_proj": (GATE_UP, ("mlp.gate_proj",)),
    "mlp.gate_up_proj": (GATE_UP, ()),
    "mlp.down_proj": (DOWN, ()),
}


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """One module of one layer: the fused linear layer it is part of and its columns there."""

    linear: str  # models.lora_hook.LINEARS
    column_start: int  # its first output column in the fused layer
    out_features: int
    in_features: int


def lora_targets(config: ModelConfig) -> dict[tuple[int, str], LoraTarget]:
    """(layer index, module name inside model.layers.N.) -> its target, for every module an adapter may adapt."""
    shapes = get_model_family(config.architecture).tensor_shapes(config)
    targets = {}
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        for module, (linear, before) in MODULES.items():
            shape = shapes.get(f"{prefix}{module}.weight")
            if shape is not None:
                start = sum(shapes[f"{prefix}{m}.weight"][0] for m in before)
                targets[(index, module)] = LoraTarget(linear, start, shape[0], shape[1])
    return targets
