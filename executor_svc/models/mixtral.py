"""The Mixtral family: the Llama decoder (Mistral's attention) with a mixture of experts in every layer.

Each token's top ``num_experts_per_tok`` experts out of ``num_local_experts``,
their softmax weights renormalised to sum to one (``models.moe``). llama.cpp
writes Mixtral as a "llama" file with expert tensors; the entry's GGUF test
picks it out by its ``expert_count``.
"""

from __future__ import annotations

import functools
from typing import Any

from executor_svc.loading.model_config import LayerConfig, ModelConfig, base_fields
from executor_svc.models.activations import check_activation
from executor_svc.models.llama import GGUF_BLOCK_TENSORS, GGUF_GLOBAL_TENSORS, LlamaModel, decoder_shapes
from executor_svc.models.moe import ExpertNames, MoeModelConfig, moe_loader, moe_shapes
from executor_svc.models.registry import GgufSpec, MetadataGetter, ModelFamily

EXPERTS = ExpertNames(
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{}.w1.weight",
    up="block_sparse_moe.experts.{}.w3.weight",
    down="block_sparse_moe.experts.{}.w2.weight",
)


def parse_mixtral(config: dict[str, Any], architecture: str) -> MoeModelConfig:
    """Mixtral: every layer MoE, top-k renormalised, a sliding window on every layer when given."""
    fields = base_fields(config, architecture)
    window = int(config["sliding_window"]) if config.get("sliding_window") else None
    return MoeModelConfig(
        **fields,
        hidden_act=check_activation(config.get("hidden_act", "silu")),
        layers=(LayerConfig(sliding_window=window, moe=True),) * fields["num_layers"],
        num_experts=int(config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        norm_topk_prob=True,
        moe_intermediate_size=fields["intermediate_size"],
    )


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads: the Llama decoder's, experts in place of the MLP."""
    assert isinstance(config, MoeModelConfig)
    return decoder_shapes(config, lambda prefix, index: moe_shapes(config, prefix, EXPERTS))


def _has_experts(get: MetadataGetter) -> bool:
    return int(get("expert_count", 0) or 0) > 0


def _mixtral_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    config["num_local_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))


GGUF = GgufSpec(
    "llama",
    True,  # written as llama: q/k rows permuted
    {**GGUF_BLOCK_TENSORS, "ffn_gate_inp.weight": EXPERTS.router},
    GGUF_GLOBAL_TENSORS,
    _mixtral_gguf_config,
    accepts=_has_experts,
    expert_tensors={
        "ffn_gate_exps.weight": EXPERTS.gate,
        "ffn_up_exps.weight": EXPERTS.up,
        "ffn_down_exps.weight": EXPERTS.down,
    },
)
MIXTRAL = ModelFamily(
    "MixtralForCausalLM",
    "mixtral",
    parse_mixtral,
    tensor_shapes,
    functools.partial(LlamaModel, feed_forward=moe_loader(EXPERTS)),
    GGUF,
)
FAMILIES = (MIXTRAL,)
