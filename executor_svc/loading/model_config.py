"""Model hyper-parameters parsed from a Hugging Face ``config.json`` dict.

The fields every decoder family reads the same way are read here
(``base_fields``); what an architecture adds or reads its own way (qkv bias,
q/k norm, which layers slide, a family's own fields in a ``ModelConfig``
subclass) is its family's ``parse_config`` hook in the model registry
(``executor_svc.models.registry``). Anything we do not implement is rejected
at start, by name. A config dict is parsed by ``registry.parse_model_config``,
which chooses the family: the registry imports this module, never the reverse.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Older spellings of a rope type in config.json.
_ROPE_TYPE_ALIASES = {"su": "longrope"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (``rope_type`` default, linear, llama3 or longrope)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors [Dh / 2] for contexts within / past original_max_position_embeddings
    # and the factor cos and sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """What may differ from one decoder layer to the next."""

    # Attend to the last N tokens only (Mistral: every layer; None: the whole context).
    sliding_window: int | None = None
    # Attention scores become cap * tanh(score / cap) before the softmax (Gemma 2; None: not capped).
    logit_softcap: float | None = None
    # This layer's RoPE when it differs from the model's (Gemma 3's local layers; None: the model's).
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    # The feed-forward block is a mixture of experts (else a dense MLP).
    moe: bool = False


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the executor needs to build and run one decoder model."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # Qwen2: bias on q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k
    qk_norm_over_heads: bool = False  # OLMoE: that RMSNorm spans all heads of q (and of k) at once
    hidden_act: str = "silu"  # the feed-forward's gated activation (models.activations)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # One entry per layer; left empty, every layer gets LayerConfig().
    layers: tuple[LayerConfig, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", (LayerConfig(),) * self.num_layers)
        elif len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer configs for {self.num_layers} layers")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        return tuple(layer.sliding_window for layer in self.layers)

    def layer_rope(self, index: int) -> tuple[float, RopeScaling]:
        """RoPE base and scaling of layer ``index`` (its own, else the model's)."""
        layer = self.layers[index]
        theta = self.rope_theta if layer.rope_theta is None else layer.rope_theta
        return theta, self.rope_scaling if layer.rope_scaling is None else layer.rope_scaling


def base_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way, as keyword arguments.

    Raises:
        ValueError: inconsistent head counts or an unsupported rope type.
    """
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    hidden_size = int(config["hidden_size"])
    rope_theta, rope_scaling = _rope(config)
    return dict(
        architecture=architecture,
        hidden_size=hidden_size,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
    )


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Reads rope_theta and scaling from transformers 4 or 5 style keys."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    return rope_from_params({**legacy, **params}, config, float(config.get("rope_theta", 10000.0)))


def rope_from_params(params: dict[str, Any], config: dict[str, Any], default_theta: float) -> tuple[float, RopeScaling]:
    """RoPE base and scaling from one rope-parameters dict (a model's, or one layer type's).

    Raises:
        ValueError: an unsupported rope type, or a partial rotary (rotating only part of each head).
    """
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial} (only 1.0: every dim of a head rotates)")
    max_len = int(config.get("max_position_embeddings", 8192))
    original = int(
        params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings") or max_len
    )
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
    )
    if rope_type == "longrope":
        scaling = _longrope(params, scaling, max_len)
    return theta, scaling


def _longrope(params: dict[str, Any], scaling: RopeScaling, max_len: int) -> RopeScaling:
    """LongRoPE (Phi-3 "su"): short and long per-frequency factors, and the cos/sin factor.

    Without an explicit attention_factor it is sqrt(1 + ln(s) / ln(original)), s = max / original
    (or ``factor``), 1 when s <= 1, as transformers computes it.
    """
    original = scaling.original_max_position_embeddings
    factor = float(params.get("factor") or max_len / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dataclasses.replace(
        scaling,
        factor=factor,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention_factor),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
