"""The Gemma 2 and Gemma 3 (text) family.

Against the Llama decoder: embeddings scaled by sqrt(hidden); RMSNorm
weights used as (1 + weight); GeGLU (tanh GELU); a norm after attention and
after the feed-forward block as well as before each ("sandwich" norms);
attention scaled by ``query_pre_attn_scalar`` ** -0.5 rather than head_dim's;
layers alternating between a sliding window and full attention
(``layer_types``). Gemma 2 soft-caps attention scores and final logits
(cap * tanh(x / cap)); Gemma 3 drops the caps for q/k norms and gives its
sliding layers a RoPE base of their own (``rope_local_base_freq``) while the
global layers keep ``rope_theta`` and any scaling.

The (1 + weight) factors are computed once at load in fp32, as transformers
computes them in each call; in bf16 the normed activations are then rounded
before that factor multiplies them (as Llama's norm does), where transformers
rounds once after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from executor_svc.loading.model_config import LayerConfig, ModelConfig, RopeScaling, base_fields, rope_from_params
from executor_svc.models.activations import check_activation
from executor_svc.models.attention_layer import AttentionWeights, attend, load_attention
from executor_svc.models.layer_ops import LayerOps
from executor_svc.models.llama import GGUF_GLOBAL_TENSORS, decoder_shapes, layer_tensors, model_ends
from executor_svc.models.lora_hook import O_PROJ, LoraDeltas
from executor_svc.models.mlp import FeedForward, gated_mlp_shapes, load_gated_mlp, with_lora
from executor_svc.models.registry import GgufSpec, MetadataGetter, ModelFamily
from executor_svc.models.rope import RotaryEmbedding
from executor_svc.parallel.collectives import SINGLE, ModelParallel


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """Gemma's own fields (per-layer windows, caps and RoPEs are in ``layers``)."""

    query_pre_attn_scalar: float = 256.0  # attention scale = this ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)


@dataclasses.dataclass
class GemmaLayer:
    """One layer's weights; norms already (1 + weight)."""

    input_norm: torch.Tensor  # [hidden]
    attn: AttentionWeights
    post_attn_norm: torch.Tensor  # [hidden]
    pre_ff_norm: torch.Tensor  # [hidden]
    post_ff_norm: torch.Tensor  # [hidden]
    mlp: FeedForward
    rope_index: int  # which of the model's RoPE tables this layer rotates with


class GemmaModel:
    """Forward pass of a Gemma 2 / 3 model over a flattened, paged batch."""

    def __init__(
        self,
        config: GemmaConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        ops: LayerOps,
    ):
        self.config, self.ops = config, ops
        tensors = {name: _norm_factor(name, t) for name, t in tensors.items()}
        self.embed, self.final_norm, self.lm_head = model_ends(tensors, dtype, device, ops)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)  # rounded as transformers rounds it
        ropes = list(dict.fromkeys(config.layer_rope(i) for i in range(config.num_layers)))  # distinct, in order
        self.ropes = [RotaryEmbedding(config, max_len, dtype, device, rope) for rope in ropes]
        self.layers = [
            self._layer(tensors, i, ropes.index(config.layer_rope(i)), dtype, device) for i in range(config.num_layers)
        ]
        self.scale = config.query_pre_attn_scalar**-0.5
        self.mlp_path = "dense"

    def _layer(self, tensors, index: int, rope_index: int, dtype, device) -> GemmaLayer:
        get, has = layer_tensors(tensors, index, dtype, device)
        return GemmaLayer(
            input_norm=get("input_layernorm.weight"),
            attn=load_attention(self.config, get, has, self.ops),
            post_attn_norm=get("post_attention_layernorm.weight"),
            pre_ff_norm=get("pre_feedforward_layernorm.weight"),
            post_ff_norm=get("post_feedforward_layernorm.weight"),
            mlp=load_gated_mlp(self.config, index, get, has, self.ops),
            rope_index=rope_index,
        )

    parallel: ModelParallel = SINGLE  # as LlamaModel.parallel

    def forward(
        self,
        input_ids,
        rope_rows,
        kv_cache,
        backend,
        attn_states: Sequence[Any],
        lora: LoraDeltas | None = None,
        hidden_in: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs every layer over the flattened tokens [T] (rope_rows, lora, hidden_in: as LlamaModel.forward's);
        returns hidden states [T, hidden] before the final norm."""
        ops, config, eps, layers, scale = self.ops, self.config, self.config.rms_norm_eps, self.layers, self.scale
        par = self.parallel
        rotaries = [ops.rotary_for(rope, rope_rows) for rope in self.ropes]
        # [T, hidden], the residual stream
        hidden = par.embed(input_ids, self.embed) * self.embed_scale if hidden_in is None else hidden_in
        normed = ops.rms_norm(hidden, layers[0].input_norm, eps)
        for index, layer in enumerate(layers):
            cache = kv_cache.layer(index)
            rotary, state = rotaries[layer.rope_index], attn_states[index]
            attn = attend(ops, config, normed, layer.attn, rotary, cache, backend, state, scale, lora, index, par)
            attn_proj = par.all_reduce(ops.linear(attn, layer.attn.o_proj))
            if lora is not None:
                lora.add(index, O_PROJ, attn, attn_proj)
            attn = ops.rms_norm(attn_proj, layer.post_attn_norm, eps)
            normed = ops.add_rms_norm(attn, hidden, layer.pre_ff_norm, eps)  # hidden += attn
            mlp_out = layer.mlp(normed) if lora is None else with_lora(layer.mlp, normed, lora, index)
            mlp_out = ops.rms_norm(par.all_reduce(mlp_out), layer.post_ff_norm, eps)
            if index + 1 < len(layers):
                normed = ops.add_rms_norm(mlp_out, hidden, layers[index + 1].input_norm, eps)
            else:
                hidden.add_(mlp_out)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and soft-cap on the rows to sample only: [N, hidden] -> [N, V]."""
        normed = self.ops.rms_norm(hidden.contiguous(), self.final_norm, self.config.rms_norm_eps)
        logits = self.parallel.gather_vocab(self.ops.linear(normed, self.lm_head))
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _norm_factor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by (1 + weight): that factor, in fp32, for every norm weight."""
    return 1.0 + tensor.float() if name.endswith("norm.weight") else tensor


# -- config hooks ---------------------------------------------------------------


def _fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """What Gemma 2 and 3 read alike (Gemma names its activation hidden_activation)."""
    if config.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention (an embedding model, not a decoder)")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    return dict(
        base_fields(config, architecture),
        attention_bias=bool(config.get("attention_bias", False)),
        hidden_act=check_activation(activation),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
    )


def _layer_types(config: dict[str, Any], default_pattern: int) -> list[str]:
    """Each layer's type; without ``layer_types``, every ``pattern``-th layer is global, the others slide."""
    num_layers = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = int(config.get("sliding_window_pattern") or default_pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _window(config: dict[str, Any], layer_type: str) -> int | None:
    if layer_type not in ("sliding_attention", "full_attention"):
        raise ValueError(f"unsupported layer type {layer_type!r} (sliding_attention or full_attention)")
    return int(config["sliding_window"]) if layer_type == "sliding_attention" and config.get("sliding_window") else None


def parse_gemma2(config: dict[str, Any], architecture: str) -> GemmaConfig:
    """Gemma 2: alternating sliding / full layers, soft-capped attention scores and final logits."""
    cap = config.get("attn_logit_softcapping")
    layers = tuple(
        LayerConfig(sliding_window=_window(config, kind), logit_softcap=float(cap) if cap else None)
        for kind in _layer_types(config, 2)
    )
    final_cap = config.get("final_logit_softcapping")
    return GemmaConfig(
        **_fields(config, architecture), layers=layers, final_logit_softcap=float(final_cap) if final_cap else None
    )


def parse_gemma3(config: dict[str, Any], architecture: str) -> GemmaConfig:
    """Gemma 3 (text): q/k norms, 5 sliding layers per global one, a local and a global RoPE."""
    ropes = _gemma3_ropes(config)
    cap, final_cap = config.get("attn_logit_softcapping"), config.get("final_logit_softcapping")
    layers = tuple(
        LayerConfig(
            sliding_window=_window(config, kind),
            logit_softcap=float(cap) if cap else None,
            rope_theta=ropes[kind][0],
            rope_scaling=ropes[kind][1],
        )
        for kind in _layer_types(config, 6)
    )
    theta, scaling = ropes["full_attention"]
    fields = dict(_fields(config, architecture), rope_theta=theta, rope_scaling=scaling)
    return GemmaConfig(
        **fields, qk_norm=True, layers=layers, final_logit_softcap=float(final_cap) if final_cap else None
    )


def _gemma3_ropes(config: dict[str, Any]) -> dict[str, tuple[float, RopeScaling]]:
    """RoPE per layer type, from transformers 5's rope_parameters per type or 4's keys (rope_theta and
    rope_scaling for global layers, rope_local_base_freq for sliding ones)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = {**(config.get("rope_scaling") or {}), **params}
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
    return {
        "full_attention": rope_from_params(full, config, float(config.get("rope_theta", 1_000_000.0))),
        "sliding_attention": rope_from_params(local, config, float(config.get("rope_local_base_freq", 10000.0))),
    }


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor GemmaModel reads: the Llama decoder's plus the two feed-forward norms of each layer."""
    hidden, inter = config.hidden_size, config.intermediate_size

    def feed_forward(prefix: str, index: int) -> dict[str, tuple[int, ...]]:
        norms = {
            prefix + "pre_feedforward_layernorm.weight": (hidden,),
            prefix + "post_feedforward_layernorm.weight": (hidden,),
        }
        return gated_mlp_shapes(hidden, inter, prefix) | norms

    return decoder_shapes(config, feed_forward)


# -- GGUF -----------------------------------------------------------------------

# llama.cpp's names; its "ffn_norm" is Gemma's pre-feed-forward norm.
GGUF_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unshift_norm(name: str, array: Any) -> Any:
    """llama.cpp stores Gemma's norm weights plus 1 (its norm multiplies by the weight alone)."""
    return array - 1 if name.endswith("norm.weight") else array


def _gemma_gguf_config(get: MetadataGetter, config: dict[str, Any], arch: str) -> None:
    """Window, caps and scale as llama.cpp reads them: it scales q by head_dim ** -0.5, except for the 27B
    models (46 layers in Gemma 2, 62 in Gemma 3), scaled by (hidden / heads) ** -0.5."""
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    is_27b = config["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if is_27b else head_dim
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["head_dim"] = head_dim
    config["sliding_window"] = get("attention.sliding_window")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        config[key] = get(key)
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # a flag per layer
        config["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    elif pattern:
        config["sliding_window_pattern"] = int(pattern)


def _gemma3_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    """Gemma 3 adds the local RoPE base, which llama.cpp fixes at 10000."""
    _gemma_gguf_config(get, config, "gemma3")
    config["rope_local_base_freq"] = 10000.0


def _gguf(arch: str, hook) -> GgufSpec:
    return GgufSpec(arch, False, GGUF_BLOCK_TENSORS, GGUF_GLOBAL_TENSORS, hook, tensor_hook=_unshift_norm)


GEMMA2 = ModelFamily(
    "Gemma2ForCausalLM",
    "gemma2",
    parse_gemma2,
    tensor_shapes,
    GemmaModel,
    _gguf("gemma2", lambda get, config: _gemma_gguf_config(get, config, "gemma2")),
)
GEMMA3 = ModelFamily(
    "Gemma3ForCausalLM", "gemma3_text", parse_gemma3, tensor_shapes, GemmaModel, _gguf("gemma3", _gemma3_gguf_config)
)
FAMILIES = (GEMMA2, GEMMA3)
