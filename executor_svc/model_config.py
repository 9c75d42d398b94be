"""Model hyper-parameters parsed from a Hugging Face ``config.json`` dict.

One dataclass covers the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3): they
differ only in a few switches (qkv bias, q/k norm, sliding window, rope
scaling). Anything we do not implement is rejected here, at start, by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (``rope_type`` default, linear or llama3)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the executor needs to build and run one Llama-family model."""

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
    sliding_window: int | None = None  # Mistral: attend to the last N tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Parses a Hugging Face config.json dict.

        Raises:
            ValueError: unsupported architecture, rope type or activation,
                or inconsistent head counts.
        """
        architecture = _architecture(config)
        hidden_act = config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu)")
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        hidden_size = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _rope(config)
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            attention_bias=_attention_bias(architecture, config),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(architecture, config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos_ids(config.get("eos_token_id")),
        )


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    if not names and config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        names = [_MODEL_TYPE_TO_ARCH[config["model_type"]]]
    if not names:
        raise ValueError("config.json names no architecture (no 'architectures' or known 'model_type')")
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {names[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Reads rope_theta and scaling from transformers 4 or 5 style keys."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or config.get("max_position_embeddings", 8192)
        ),
    )
    return theta, scaling


def _attention_bias(architecture: str, config: dict[str, Any]) -> bool:
    if architecture == "Qwen2ForCausalLM":
        return True  # Qwen2 always has q/k/v bias (o_proj has none)
    return bool(config.get("attention_bias", False))


def _sliding_window(architecture: str, config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if not window:
        return None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen checkpoints carry a window but only use it with use_sliding_window.
        if not config.get("use_sliding_window", False):
            return None
        # Layers at index >= max_window_layers slide; we support all or none.
        first_sliding = int(config.get("max_window_layers") or 0)
        if first_sliding >= int(config["num_hidden_layers"]):
            return None
        if first_sliding > 0:
            raise ValueError("per-layer sliding windows (max_window_layers) are not supported")
    return int(window)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
