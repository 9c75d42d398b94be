"""The Phi-3 family: the Llama decoder with q/k/v and gate/up stored fused, and LongRoPE.

Phi-3 keeps ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` as one matrix
each, which is the layout Pagoda fuses Llama's into, so the shared loaders take
them as they are. Long-context checkpoints scale RoPE with LongRoPE ("su"):
short factors for a sequence within ``original_max_position_embeddings``
tokens, long ones past it (chosen per sequence by the scheduler, see
``models.rope``). A sliding window, when the config
gives one, applies to every layer, as transformers applies it.
"""

from __future__ import annotations

from typing import Any

from executor_svc.loading.model_config import LayerConfig, ModelConfig, base_fields
from executor_svc.models.activations import check_activation
from executor_svc.models.llama import GGUF_GLOBAL_TENSORS, LlamaModel, decoder_shapes
from executor_svc.models.mlp import gated_mlp_shapes
from executor_svc.models.registry import GgufSpec, MetadataGetter, ModelFamily


def parse_phi3(config: dict[str, Any], architecture: str) -> ModelConfig:
    """Phi-3: SiLU, no biases, an optional sliding window on every layer, optional LongRoPE."""
    fields = base_fields(config, architecture)
    window = int(config["sliding_window"]) if config.get("sliding_window") else None
    layers = (LayerConfig(sliding_window=window),) * fields["num_layers"]
    return ModelConfig(**fields, hidden_act=check_activation(config.get("hidden_act", "silu")), layers=layers)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads: fused qkv_proj and gate_up_proj."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return decoder_shapes(config, lambda prefix, index: gated_mlp_shapes(hidden, inter, prefix, fused=True), True)


# llama.cpp's names: Phi-3's fused matrices keep their layout (ffn_up holds gate then up).
GGUF_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_CONFIG_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def _phi3_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    """Sliding window (0: none) and LongRoPE, whose factors llama.cpp stores as two tensors."""
    config["sliding_window"] = int(get("attention.sliding_window", 0)) or None
    original = get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    if "long_factor" not in config:
        return
    config["rope_scaling"] = {
        "rope_type": "longrope",
        "long_factor": config.pop("long_factor"),
        "short_factor": config.pop("short_factor"),
        "original_max_position_embeddings": int(original or config["max_position_embeddings"]),
        "attention_factor": get("rope.scaling.attn_factor"),
    }


PHI3 = ModelFamily(
    "Phi3ForCausalLM",
    "phi3",
    parse_phi3,
    tensor_shapes,
    LlamaModel,
    GgufSpec(
        "phi3",
        False,
        GGUF_BLOCK_TENSORS,
        GGUF_GLOBAL_TENSORS,
        _phi3_gguf_config,
        config_tensors=GGUF_CONFIG_TENSORS,
    ),
)
FAMILIES = (PHI3,)
