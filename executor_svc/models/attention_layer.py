"""The self-attention sublayer every family shares: fused qkv, optional q/k norms, RoPE, paged attention.

Weights are read once at load (``load_attention``): q/k/v fused into one
matrix (or taken fused, as Phi-3 stores them), so the sublayer is one matmul,
two optional norms, one rotation and the backend's paged attention. The
output projection is left to the caller, which fuses it with its own norms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from executor_svc.kv.cache import LayerKV
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.layer_ops import LayerOps
from executor_svc.models.lora_hook import QKV, LoraDeltas
from executor_svc.parallel.collectives import SINGLE, ModelParallel

# (name inside model.layers.N.) -> the tensor in the model's dtype and device; has(name) says whether it exists.
TensorGetter = Callable[[str], torch.Tensor]
TensorTest = Callable[[str], bool]


@dataclasses.dataclass
class AttentionWeights:
    """One layer's attention tensors; matrices [out, in] as the layer ops' ``linear`` takes them (maybe packed)."""

    qkv: Any  # [(H + 2 * KVH) * Dh, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 * KVH) * Dh]
    q_norm: torch.Tensor | None  # [Dh] (per head), or [H * Dh] (qk_norm_over_heads)
    k_norm: torch.Tensor | None  # [Dh], or [KVH * Dh]
    o_proj: Any  # [hidden, H * Dh]


def load_attention(config: ModelConfig, get: TensorGetter, has: TensorTest, ops: LayerOps) -> AttentionWeights:
    """The layer's attention weights, q/k/v fused (read fused when the checkpoint stores them so)."""
    attn = "self_attn."
    if has(attn + "qkv_proj.weight"):
        qkv = get(attn + "qkv_proj.weight")
    else:
        qkv = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])
    qkv_bias = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"]) if config.attention_bias else None
    return AttentionWeights(
        qkv=ops.pack(qkv),
        qkv_bias=qkv_bias,
        q_norm=get(attn + "q_norm.weight") if config.qk_norm else None,
        k_norm=get(attn + "k_norm.weight") if config.qk_norm else None,
        o_proj=ops.pack(get(attn + "o_proj.weight")),
    )


def attention_shapes(config: ModelConfig, prefix: str, fused_qkv: bool = False) -> dict[str, tuple[int, ...]]:
    """The attention tensors of one layer (names under ``prefix``), with their shapes."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    p = prefix + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {p + "o_proj.weight": (hidden, q_size)}
    if fused_qkv:
        shapes[p + "qkv_proj.weight"] = (q_size + 2 * kv_size, hidden)
    else:
        shapes |= {p + "q_proj.weight": (q_size, hidden), p + "k_proj.weight": (kv_size, hidden)}
        shapes[p + "v_proj.weight"] = (kv_size, hidden)
    if config.attention_bias:
        shapes |= {p + "q_proj.bias": (q_size,), p + "k_proj.bias": (kv_size,), p + "v_proj.bias": (kv_size,)}
    if config.qk_norm:
        over_heads = config.qk_norm_over_heads
        shapes[p + "q_norm.weight"] = (q_size,) if over_heads else (head_dim,)
        shapes[p + "k_norm.weight"] = (kv_size,) if over_heads else (head_dim,)
    return shapes


def attend(
    ops: LayerOps,
    config: ModelConfig,
    x: torch.Tensor,  # [T, hidden], normed
    weights: AttentionWeights,
    rotary: Any,  # ops.rotary_for(...) of this layer's RoPE
    cache: LayerKV,
    backend: Any,
    attn_state: Any,
    scale: float,
    lora: LoraDeltas | None = None,
    layer: int = 0,
    parallel: ModelParallel = SINGLE,
) -> torch.Tensor:
    """Attention of the step's tokens, before the output projection: [T, H * Dh] (this rank's heads).

    ``lora``: the step's LoRA deltas (models.lora_hook), added to q/k/v of layer ``layer``; None: none.
    ``parallel``: an executor group's collectives (a q/k norm over all heads sums over the ranks' heads).
    """
    num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = ops.linear(x, weights.qkv, weights.qkv_bias)  # [T, (H + 2 KVH) Dh]
    if lora is not None:
        lora.add(layer, QKV, x, qkv)
    qkv = qkv.view(-1, num_heads + 2 * num_kv_heads, head_dim)
    qk = qkv[:, : num_heads + num_kv_heads]  # [T, H + KVH, Dh]
    if weights.q_norm is not None:
        qk = _norm_qk(qk, weights, config, parallel)
    qk = ops.rotate(qk, rotary)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    v = qkv[:, num_heads + num_kv_heads :]  # [T, KVH, Dh]
    return backend.forward(q, k, v, cache, attn_state, scale)


def _norm_qk(
    qk: torch.Tensor, weights: AttentionWeights, config: ModelConfig, parallel: ModelParallel = SINGLE
) -> torch.Tensor:
    """RMSNorm of q and k [T, H + KVH, Dh]: over each head (Qwen3, Gemma 3) or over all heads (OLMoE)."""
    num_heads, eps = config.num_heads, config.rms_norm_eps
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    if config.qk_norm_over_heads and parallel.placement.tp_size > 1:
        q = _norm_over_ranks(q, weights.q_norm, eps, parallel, 1)
        k = _norm_over_ranks(
            k, weights.k_norm, eps, parallel, max(1, parallel.placement.tp_size // config.num_kv_heads)
        )
    elif config.qk_norm_over_heads:
        q = F.rms_norm(q.flatten(1), (q.shape[1] * q.shape[2],), weights.q_norm, eps).view(q.shape)
        k = F.rms_norm(k.flatten(1), (k.shape[1] * k.shape[2],), weights.k_norm, eps).view(k.shape)
    else:
        q = F.rms_norm(q, (config.head_dim,), weights.q_norm, eps)
        k = F.rms_norm(k, (config.head_dim,), weights.k_norm, eps)
    return torch.cat((q, k), dim=1)


def _norm_over_ranks(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, parallel: ModelParallel, replicas: int
) -> torch.Tensor:
    """RMSNorm over all heads of x [T, N, Dh] when a group's ranks each hold some of them: the squares are summed
    over the ranks (``replicas``: ranks holding each head, so each counts once)."""
    assert weight is not None
    flat = x.flatten(1).float()
    squares = parallel.all_reduce(flat.pow(2).sum(-1, keepdim=True)) / replicas
    width = flat.shape[1] * parallel.placement.tp_size / replicas
    normed = flat * torch.rsqrt(squares / width + eps)
    return (normed.to(x.dtype) * weight).view(x.shape)
