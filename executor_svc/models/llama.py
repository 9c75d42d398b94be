"""The Llama family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch.

Input is the step's flattened tokens (no batch dimension, no padding). Weights
are plain tensors with q/k/v and gate/up fused at load, so a layer is a handful
of large matmuls plus a few elementwise ops.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from executor_svc.model_config import ModelConfig
from executor_svc.models.layer_ops import TorchLayerOps, layer_ops
from executor_svc.models.rope import RotaryEmbedding


@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's tensors; matrices [out, in] as the layer ops' ``linear`` takes them (maybe packed)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 * KVH) * Dh, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 * KVH) * Dh]
    q_norm: torch.Tensor | None  # [Dh]
    k_norm: torch.Tensor | None  # [Dh]
    o_proj: torch.Tensor  # [hidden, H * Dh]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class LlamaModel:
    """Forward pass of a Llama-family model over a flattened, paged batch."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        ops: TorchLayerOps | None = None,
    ):
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed = tensors["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        self.final_norm = tensors["model.norm.weight"].to(device=device, dtype=dtype)
        lm_head = tensors.get("lm_head.weight")
        self.ops = ops or layer_ops(device)
        self.lm_head = self.ops.pack(self.embed if lm_head is None else lm_head.to(device=device, dtype=dtype))
        self.layers = [self._layer(tensors, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config, max_len, dtype, device)
        self.scale = config.head_dim**-0.5

    def _layer(self, tensors: dict[str, torch.Tensor], index: int) -> LayerWeights:
        prefix = f"model.layers.{index}."

        def get(name: str) -> torch.Tensor:
            return tensors[prefix + name].to(device=self.device, dtype=self.dtype)

        pack = self.ops.pack

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if prefix + name in tensors else None

        attn = "self_attn."
        qkv_bias = None
        if self.config.attention_bias:
            qkv_bias = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
        return LayerWeights(
            input_norm=get("input_layernorm.weight"),
            qkv=pack(torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])),
            qkv_bias=qkv_bias,
            q_norm=maybe(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=maybe(attn + "k_norm.weight") if self.config.qk_norm else None,
            o_proj=pack(get(attn + "o_proj.weight")),
            post_norm=get("post_attention_layernorm.weight"),
            gate_up=pack(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])),
            down=pack(get("mlp.down_proj.weight")),
        )

    def forward(self, input_ids, positions, kv_cache, backend, attn_state) -> torch.Tensor:
        """Runs every layer over the flattened tokens.

        Args:
            input_ids: [T] token ids of all scheduled tokens, all sequences.
            positions: [T] position of each token in its sequence.
            kv_cache: executor_svc.kv_cache.KVCache, written at the step's slots.
            backend: attention backend; attn_state is its per-step state.

        Returns:
            Hidden states [T, hidden] before the final norm.
        """
        ops, eps, layers = self.ops, self.config.rms_norm_eps, self.layers
        rotary = ops.rotary_for(self.rope, positions)
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden], the residual stream (updated in place)
        normed = ops.rms_norm(hidden, layers[0].input_norm, eps)
        for index, layer in enumerate(layers):
            k_cache, v_cache = kv_cache.layer(index)
            attn_out = self._attention(normed, layer, rotary, k_cache, v_cache, backend, attn_state)
            normed = ops.add_rms_norm(ops.linear(attn_out, layer.o_proj), hidden, layer.post_norm, eps)
            mlp_out = ops.linear(ops.silu_and_mul(ops.linear(normed, layer.gate_up)), layer.down)
            if index + 1 < len(layers):
                normed = ops.add_rms_norm(mlp_out, hidden, layers[index + 1].input_norm, eps)
            else:
                hidden.add_(mlp_out)
        return hidden

    def _attention(self, x, layer, rotary, k_cache, v_cache, backend, attn_state) -> torch.Tensor:
        config = self.config
        num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        qkv = self.ops.linear(x, layer.qkv, layer.qkv_bias)  # [T, (H + 2 KVH) Dh]
        qkv = qkv.view(-1, num_heads + 2 * num_kv_heads, head_dim)
        qk = qkv[:, : num_heads + num_kv_heads]  # [T, H + KVH, Dh]
        if layer.q_norm is not None:
            eps = config.rms_norm_eps
            q = F.rms_norm(qk[:, :num_heads], (head_dim,), layer.q_norm, eps)
            k = F.rms_norm(qk[:, num_heads:], (head_dim,), layer.k_norm, eps)
            qk = torch.cat((q, k), dim=1)
        qk = self.ops.rotate(qk, rotary)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, num_heads + num_kv_heads :]  # [T, KVH, Dh]
        return backend.forward(q, k, v, k_cache, v_cache, attn_state, self.scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the rows to sample only: [N, hidden] -> [N, V]."""
        normed = self.ops.rms_norm(hidden.contiguous(), self.final_norm, self.config.rms_norm_eps)
        return self.ops.linear(normed, self.lm_head)
