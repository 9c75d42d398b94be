"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): config hooks, tensor names and shapes, the model.

The model's input is the step's flattened tokens (no batch dimension, no
padding). Weights are plain tensors with q/k/v and gate/up fused at load, so a
layer is a handful of large matmuls plus a few elementwise ops. The attention
sublayer and the feed-forward blocks are shared with the other families
(``attention_layer``, ``mlp``, ``moe``). The family's registry entries are at
the end of this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from executor_svc.loading.model_config import LayerConfig, ModelConfig, base_fields
from executor_svc.models import fused_decode
from executor_svc.models.attention_layer import (
    AttentionWeights,
    TensorGetter,
    TensorTest,
    attend,
    attention_shapes,
    load_attention,
)
from executor_svc.models.layer_ops import LayerOps
from executor_svc.models.lora_hook import O_PROJ, LoraDeltas
from executor_svc.models.mlp import (
    FeedForward,
    FeedForwardLoader,
    feed_forward_path,
    gated_mlp_shapes,
    load_gated_mlp,
    with_lora,
)
from executor_svc.models.registry import GgufSpec, MetadataGetter, ModelFamily
from executor_svc.models.rope import RotaryEmbedding
from executor_svc.parallel.collectives import SINGLE, ModelParallel


@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's tensors and blocks."""

    input_norm: torch.Tensor  # [hidden]
    attn: AttentionWeights
    post_norm: torch.Tensor  # [hidden]
    mlp: FeedForward  # dense (SwiGLU) or a mixture of experts


class LlamaModel:
    """Forward pass of a Llama-family model over a flattened, paged batch.

    Pre-norm layers: attention then a feed-forward block, each added to the
    residual stream. The block is whatever ``feed_forward`` loads for the
    layer (the dense SwiGLU here; Mixtral and Qwen3-MoE pass a mixture of
    experts), so the same forward serves them.
    """

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        ops: LayerOps,
        feed_forward: FeedForwardLoader = load_gated_mlp,
    ):
        self.config = config
        self.dtype = dtype
        self.device = device
        self.ops = ops
        self.embed, self.final_norm, self.lm_head = model_ends(tensors, dtype, device, ops)
        self.layers = [self._layer(tensors, i, feed_forward) for i in range(config.num_layers)]
        # What the feed-forward blocks run (reported with the kernel paths).
        self.mlp_path = feed_forward_path([layer.mlp for layer in self.layers])
        self.rope = RotaryEmbedding(config, max_len, dtype, device)
        self.scale = config.head_dim**-0.5
        # Decode-only steps through all layers in one C++ call where every piece is one it chains (else None,
        # and decode_path says why): models/fused_decode.py.
        self.fused_decode, self.decode_path = fused_decode.prepare(self)

    def _layer(self, tensors: dict[str, torch.Tensor], index: int, feed_forward: FeedForwardLoader) -> LayerWeights:
        get, has = layer_tensors(tensors, index, self.dtype, self.device)
        return LayerWeights(
            input_norm=get("input_layernorm.weight"),
            attn=load_attention(self.config, get, has, self.ops),
            post_norm=get("post_attention_layernorm.weight"),
            mlp=feed_forward(self.config, index, get, has, self.ops),
        )

    # Collectives of an executor group (executor_svc.parallel); the runner sets a group's, which turns off the
    # fused decode.
    parallel: ModelParallel = SINGLE

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
        """Runs every layer over the flattened tokens.

        Args:
            input_ids: [T] token ids of all scheduled tokens, all sequences.
            rope_rows: [T] each token's row in the RoPE tables: its position in its sequence, plus the rows of
                one factor set on LongRoPE's long factors (models.rope).
            kv_cache: executor_svc.kv.cache.KVCache, written at the step's slots.
            backend: attention backend; attn_states[i] is its per-step state for layer i.
            lora: the step's LoRA deltas (models.lora_hook); None: no row has an adapter (the fused decode
                runs such steps where it applies).
            hidden_in: [T, hidden] the previous pipeline stage's output, in place of the embedding.

        Returns:
            Hidden states [T, hidden] before the final norm.
        """
        ops, config, eps, layers, scale = self.ops, self.config, self.config.rms_norm_eps, self.layers, self.scale
        par = self.parallel
        rotary = ops.rotary_for(self.rope, rope_rows)
        # [T, hidden], the residual stream (updated in place)
        hidden = par.embed(input_ids, self.embed) if hidden_in is None else hidden_in
        normed = ops.rms_norm(hidden, layers[0].input_norm, eps)
        if lora is None and self.fused_decode is not None and self.fused_decode.applies(attn_states):
            return self.fused_decode.run(hidden, normed, rotary, kv_cache, attn_states[0])
        for index, layer in enumerate(layers):
            cache = kv_cache.layer(index)
            state = attn_states[index]
            attn_out = attend(ops, config, normed, layer.attn, rotary, cache, backend, state, scale, lora, index, par)
            attn_proj = ops.linear(attn_out, layer.attn.o_proj)
            if lora is not None:
                lora.add(index, O_PROJ, attn_out, attn_proj)
            normed = ops.add_rms_norm(par.all_reduce(attn_proj), hidden, layer.post_norm, eps)
            mlp_out = layer.mlp(normed) if lora is None else with_lora(layer.mlp, normed, lora, index)
            mlp_out = par.all_reduce(mlp_out)
            if index + 1 < len(layers):
                normed = ops.add_rms_norm(mlp_out, hidden, layers[index + 1].input_norm, eps)
            else:
                hidden.add_(mlp_out)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows to sample only: [N, hidden] -> [N, V]."""
        normed = self.ops.rms_norm(hidden.contiguous(), self.final_norm, self.config.rms_norm_eps)
        return self.parallel.gather_vocab(self.ops.linear(normed, self.lm_head))


def model_ends(tensors: dict[str, Any], dtype: torch.dtype, device: torch.device, ops: LayerOps) -> tuple[Any, ...]:
    """(embedding, final norm, packed LM head), each None on a pipeline stage that does not run it (the LM head
    is the embedding when the checkpoint has none: tied)."""
    embed = tensors.get("model.embed_tokens.weight")
    embed = None if embed is None else embed.to(device=device, dtype=dtype)
    norm = tensors.get("model.norm.weight")
    norm = None if norm is None else norm.to(device=device, dtype=dtype)
    head = tensors.get("lm_head.weight")
    head = embed if head is None else head.to(device=device, dtype=dtype)
    return embed, norm, None if head is None or norm is None else ops.pack(head)


def layer_tensors(
    tensors: dict[str, torch.Tensor], index: int, dtype: torch.dtype, device: torch.device
) -> tuple[TensorGetter, TensorTest]:
    """get(name) and has(name) of the tensors of model.layers.<index>., in the model's dtype and device."""
    prefix = f"model.layers.{index}."

    def get(name: str) -> torch.Tensor:
        return tensors[prefix + name].to(device=device, dtype=dtype)

    def has(name: str) -> bool:
        return prefix + name in tensors

    return get, has


# -- the family's config hooks --------------------------------------------------


def _parse(
    config: dict[str, Any], architecture: str, *, attention_bias: bool, qk_norm: bool, window: int | None
) -> ModelConfig:
    """A ModelConfig with the family's switches; every layer slides over ``window`` (None: none does)."""
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu)")
    fields = base_fields(config, architecture)
    layers = (LayerConfig(sliding_window=window),) * fields["num_layers"]
    return ModelConfig(**fields, attention_bias=attention_bias, qk_norm=qk_norm, layers=layers)


def parse_llama(config: dict[str, Any], architecture: str) -> ModelConfig:
    """Llama 2/3 and Mistral: optional attention bias, a sliding window when the config gives one."""
    attention_bias = bool(config.get("attention_bias", False))
    window = int(config["sliding_window"]) if config.get("sliding_window") else None
    return _parse(config, architecture, attention_bias=attention_bias, qk_norm=False, window=window)


def parse_qwen2(config: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen2 always has q/k/v bias (o_proj has none)."""
    return _parse(config, architecture, attention_bias=True, qk_norm=False, window=qwen_window(config))


def parse_qwen3(config: dict[str, Any], architecture: str) -> ModelConfig:
    """Qwen3: RMSNorm over head_dim of q and k."""
    attention_bias = bool(config.get("attention_bias", False))
    return _parse(config, architecture, attention_bias=attention_bias, qk_norm=True, window=qwen_window(config))


def qwen_window(config: dict[str, Any]) -> int | None:
    """Qwen checkpoints carry a window but use it only with use_sliding_window, on layers >= max_window_layers."""
    window = config.get("sliding_window")
    if not window or not config.get("use_sliding_window", False):
        return None
    first_sliding = int(config.get("max_window_layers") or 0)
    if first_sliding >= int(config["num_hidden_layers"]):
        return None
    if first_sliding > 0:  # all layers or none, as the Qwen family has always been served here
        raise ValueError("per-layer sliding windows (max_window_layers) are not supported")
    return int(window)


# -- tensor names and shapes ----------------------------------------------------


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name LlamaModel reads, with its shape."""
    return decoder_shapes(
        config, lambda prefix, index: gated_mlp_shapes(config.hidden_size, config.intermediate_size, prefix)
    )


def decoder_shapes(
    config: ModelConfig, feed_forward: Callable[[str, int], dict[str, tuple[int, ...]]], fused_qkv: bool = False
) -> dict[str, tuple[int, ...]]:
    """A pre-norm decoder's tensors: embedding, head, norms, attention, and ``feed_forward(prefix, index)``'s."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        shapes |= attention_shapes(config, p, fused_qkv) | feed_forward(p, i)
    return shapes


# llama.cpp's tensor names: inside blk.N -> inside model.layers.N, and outside the blocks.
GGUF_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def qwen3_gguf_config(get: MetadataGetter, config: dict[str, Any]) -> None:
    """transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads: always write it."""
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])


# -- registry entries -----------------------------------------------------------


def _gguf(arch: str, permuted_qk: bool, config_hook=None) -> GgufSpec:
    """The family's GGUF naming under general.architecture ``arch``."""
    return GgufSpec(arch, permuted_qk, GGUF_BLOCK_TENSORS, GGUF_GLOBAL_TENSORS, config_hook)


# llama.cpp writes Llama 2/3 and Mistral 7B alike as "llama", with the q/k rows permuted.
LLAMA = ModelFamily("LlamaForCausalLM", "llama", parse_llama, tensor_shapes, LlamaModel, _gguf("llama", True))
MISTRAL = ModelFamily("MistralForCausalLM", "mistral", parse_llama, tensor_shapes, LlamaModel)
QWEN2 = ModelFamily("Qwen2ForCausalLM", "qwen2", parse_qwen2, tensor_shapes, LlamaModel, _gguf("qwen2", False))
QWEN3 = ModelFamily(
    "Qwen3ForCausalLM", "qwen3", parse_qwen3, tensor_shapes, LlamaModel, _gguf("qwen3", False, qwen3_gguf_config)
)
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3)
