"""Rotary position embeddings (default, linear, llama3 and LongRoPE frequency scaling).

A model's layers may use different RoPEs (Gemma 3: local and global bases);
each distinct one is one ``RotaryEmbedding``, looked up once per step.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from executor_svc.model_config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation frequencies [Dh / 2] in float32, after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling.rope_type == "longrope":  # short_factor: the set in use (see longrope_factors)
        return 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: slow low frequencies by ``factor``, keep high ones, blend between."""
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Cos/sin tables for every position up to max_len, looked up once per step."""

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        rope: tuple[float, RopeScaling] | None = None,
    ):
        theta, scaling = (config.rope_theta, config.rope_scaling) if rope is None else rope
        if scaling.rope_type == "longrope":
            scaling = longrope_factors(scaling, max_len)
        positions = torch.arange(max_len, dtype=torch.int64).float()
        freqs = torch.outer(positions, inverse_frequencies(config.head_dim, theta, scaling))  # [max_len, Dh / 2]
        cos, sin = freqs.cos(), freqs.sin()  # float32
        if scaling.rope_type == "longrope":
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin [T, 1, Dh / 2] for the step's positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def longrope_factors(scaling: RopeScaling, max_len: int) -> RopeScaling:
    """LongRoPE with the factor set this executor uses for every position: the long factors when it serves
    contexts past original_max_position_embeddings (``max_len``, the max model length), else the short ones.

    Chosen once, not per step: a token's K is rotated once, when it is written to the paged cache, so the
    factors cannot change with the sequence's length or the batch. transformers switches per sequence (and
    recomputes a sequence's cache when it crosses the original length); the two agree on every sequence when
    max_len <= original, and on every sequence longer than original otherwise.
    """
    if max_len > scaling.original_max_position_embeddings:
        return dataclasses.replace(scaling, short_factor=scaling.long_factor)
    return scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates halves of x [T, N, Dh] (the rotate_half convention of HF Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
