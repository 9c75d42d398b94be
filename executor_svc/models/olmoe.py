"""The OLMoE family: Qwen3-MoE's layout with q/k norms over all heads at once, no renormalised top-k.

OLMoE normalises the whole q projection [H * Dh] and k projection [KVH * Dh]
(not each head), every layer is MoE, and by default the top-k softmax weights
are used as they are. ``clip_qkv`` (clamping q/k/v) is not implemented and is
refused by name.
"""

from __future__ import annotations

import functools
from typing import Any

from executor_svc.loading.model_config import LayerConfig, ModelConfig
from executor_svc.models.llama import GGUF_GLOBAL_TENSORS, LlamaModel, decoder_shapes
from executor_svc.models.moe import MoeModelConfig, moe_loader, moe_shapes
from executor_svc.models.qwen3_moe import EXPERTS, GGUF_EXPERT_TENSORS, GGUF_MOE_TENSORS, moe_fields, moe_gguf_config
from executor_svc.models.registry import GgufSpec, MetadataGetter, ModelFamily


def parse_olmoe(config: dict[str, Any], architecture: str) -> MoeModelConfig:
    """OLMoE: every layer MoE, q/k norms over all heads.

    Raises:
        ValueError: clip_qkv is set.
    """
    if config.get("clip_qkv") is not None:
        raise ValueError(f"unsupported clip_qkv {config['clip_qkv']} (only null)")
    fields = moe_fields(config, architecture, norm_topk_default=False)
    layers = (LayerConfig(moe=True),) * fields["num_layers"]
    return MoeModelConfig(**fields, qk_norm_over_heads=True, layers=layers)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads."""
    assert isinstance(config, MoeModelConfig)
    return decoder_shapes(config, lambda prefix, index: moe_shapes(config, prefix, EXPERTS))


def _olmoe_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    """As Qwen3-MoE, but llama.cpp uses OLMoE's top-k weights as they are."""
    moe_gguf_config(get, config)
    config["norm_topk_prob"] = bool(get("expert_weights_norm", False))


OLMOE = ModelFamily(
    "OlmoeForCausalLM",
    "olmoe",
    parse_olmoe,
    tensor_shapes,
    functools.partial(LlamaModel, feed_forward=moe_loader(EXPERTS)),
    GgufSpec(
        "olmoe", False, GGUF_MOE_TENSORS, GGUF_GLOBAL_TENSORS, _olmoe_gguf_config, expert_tensors=GGUF_EXPERT_TENSORS
    ),
)
FAMILIES = (OLMOE,)
