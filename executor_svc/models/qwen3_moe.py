"""The Qwen3-MoE family: Qwen3's attention (q/k norms) with a mixture of experts.

Layers are MoE where transformers makes them so (``decoder_sparse_step``,
``mlp_only_layers``; the others keep a dense MLP of ``intermediate_size``);
each expert has ``moe_intermediate_size``; the top-k weights are renormalised
when ``norm_topk_prob`` says so. Its expert naming (``mlp.gate``,
``mlp.experts.N.*_proj``) is shared with OLMoE.
"""

from __future__ import annotations

import functools
from typing import Any

from executor_svc.loading.model_config import LayerConfig, ModelConfig, base_fields
from executor_svc.models.activations import check_activation
from executor_svc.models.llama import (
    GGUF_BLOCK_TENSORS,
    GGUF_GLOBAL_TENSORS,
    LlamaModel,
    decoder_shapes,
    qwen3_gguf_config,
    qwen_window,
)
from executor_svc.models.mlp import gated_mlp_shapes
from executor_svc.models.moe import ExpertNames, MoeModelConfig, moe_loader, moe_shapes
from executor_svc.models.registry import GgufSpec, MetadataGetter, ModelFamily

EXPERTS = ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{}.gate_proj.weight",
    up="mlp.experts.{}.up_proj.weight",
    down="mlp.experts.{}.down_proj.weight",
)


def num_experts(config: dict[str, Any]) -> int:
    """transformers 4 writes num_experts, 5 num_local_experts (for Qwen3-MoE)."""
    return int(config["num_experts"] if "num_experts" in config else config["num_local_experts"])


def moe_fields(config: dict[str, Any], architecture: str, norm_topk_default: bool) -> dict[str, Any]:
    """The ModelConfig and MoE fields transformers' Qwen-style MoE configs (Qwen3-MoE, OLMoE) name alike."""
    return dict(
        base_fields(config, architecture),
        attention_bias=bool(config.get("attention_bias", False)),
        hidden_act=check_activation(config.get("hidden_act", "silu")),
        qk_norm=True,
        num_experts=num_experts(config),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", norm_topk_default)),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
    )


def parse_qwen3_moe(config: dict[str, Any], architecture: str) -> MoeModelConfig:
    """Qwen3-MoE: which layers are MoE as transformers decides it, Qwen's sliding-window rule."""
    num_layers, window = int(config["num_hidden_layers"]), qwen_window(config)
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
    moe = [i not in dense and num_experts(config) > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    layers = tuple(LayerConfig(sliding_window=window, moe=flag) for flag in moe)
    return MoeModelConfig(**moe_fields(config, architecture, norm_topk_default=False), layers=layers)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads: experts in MoE layers, a dense MLP in the others."""
    assert isinstance(config, MoeModelConfig)

    def feed_forward(prefix: str, index: int) -> dict[str, tuple[int, ...]]:
        if config.layers[index].moe:
            return moe_shapes(config, prefix, EXPERTS)
        return gated_mlp_shapes(config.hidden_size, config.intermediate_size, prefix)

    return decoder_shapes(config, feed_forward)


# llama.cpp's names of the router and the experts, stacked [E, ...] in one tensor each.
GGUF_MOE_TENSORS = {**GGUF_BLOCK_TENSORS, "ffn_gate_inp.weight": EXPERTS.router}
GGUF_EXPERT_TENSORS = {
    "ffn_gate_exps.weight": EXPERTS.gate,
    "ffn_up_exps.weight": EXPERTS.up,
    "ffn_down_exps.weight": EXPERTS.down,
}


def moe_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    """Experts from "<arch>.expert_*"; llama.cpp renormalises the top-k weights unless told otherwise."""
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length", config["intermediate_size"]))
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))


def _qwen3_moe_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    moe_gguf_config(get, config)
    qwen3_gguf_config(get, config)


QWEN3_MOE = ModelFamily(
    "Qwen3MoeForCausalLM",
    "qwen3_moe",
    parse_qwen3_moe,
    tensor_shapes,
    functools.partial(LlamaModel, feed_forward=moe_loader(EXPERTS)),
    GgufSpec(
        "qwen3moe",
        False,
        GGUF_MOE_TENSORS,
        GGUF_GLOBAL_TENSORS,
        _qwen3_moe_gguf_config,
        expert_tensors=GGUF_EXPERT_TENSORS,
    ),
)
FAMILIES = (QWEN3_MOE,)
