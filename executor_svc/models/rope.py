"""Rotary position embeddings (default, linear, llama3 and LongRoPE frequency scaling).

A model's layers may use different RoPEs (Gemma 3: local and global bases);
each distinct one is one ``RotaryEmbedding``, looked up once per step.

LongRoPE (Phi-3 128k, Phi-3.5) has two sets of per-frequency factors: the
short ones for a sequence within ``original_max_position_embeddings`` tokens,
the long ones past it. Which set a sequence runs on is the scheduler's
decision (docs/decisions.md, model families), sent with the sequence; its
K is rotated once, with that set. The tables then hold both sets, one after
the other, and a token looks up its row: its position, plus ``max_len`` on
the long set (``StepBatch.rope_rows``), so a step of mixed sequences is still one
gather (or one kernel call).
"""

from __future__ import annotations

import math

import torch

from executor_svc.loading.model_config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> torch.Tensor:
    """Per-pair rotation frequencies [Dh / 2] in float32, after scaling (LongRoPE: the long set if ``long``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
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


def uses_longrope(config: ModelConfig) -> bool:
    """Whether any layer of the model scales its RoPE with LongRoPE (two factor sets)."""
    return any(config.layer_rope(i)[1].rope_type == "longrope" for i in range(config.num_layers))


def rope_switch_len(config: ModelConfig, max_len: int) -> int:
    """The sequence length past which a sequence runs on LongRoPE's long factors; 0: one set for every sequence.

    It is ``original_max_position_embeddings`` of a LongRoPE model served past it (``max_len``, the max model
    length); an executor serving no more than that never leaves the short factors.

    Raises:
        ValueError: layers whose LongRoPEs switch at different lengths (no model does; one rule per sequence).
    """
    scalings = [config.layer_rope(i)[1] for i in range(config.num_layers)]
    originals = {s.original_max_position_embeddings for s in scalings if s.rope_type == "longrope"}
    if len(originals) > 1:
        raise ValueError(f"LongRoPE layers switch at different lengths {sorted(originals)}: unsupported")
    original = originals.pop() if originals else 0
    return original if 0 < original < max_len else 0


class RotaryEmbedding:
    """Cos/sin tables for every position below max_len, looked up once per step.

    Of a model with a LongRoPE switch (``rope_switch_len``), the tables have two sets of ``max_len`` rows: the
    short factors', then the long factors'. Any other RoPE of such a model repeats its rows, so that every
    layer of a mixed model takes the same row of a token.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        rope: tuple[float, RopeScaling] | None = None,
    ):
        theta, scaling = (config.rope_theta, config.rope_scaling) if rope is None else rope
        # Rows of one factor set: a sequence on the long set looks up max_len + position.
        self.max_len = max_len
        sets = (False, True) if rope_switch_len(config, max_len) else (False,)
        positions = torch.arange(max_len, dtype=torch.int64).float()
        inv_freqs = [inverse_frequencies(config.head_dim, theta, scaling, long) for long in sets]
        freqs = torch.cat([torch.outer(positions, inv_freq) for inv_freq in inv_freqs])
        cos, sin = freqs.cos(), freqs.sin()  # [sets * max_len, Dh / 2] float32
        if scaling.rope_type == "longrope":  # both sets, as transformers scales them
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def lookup(self, rope_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin [T, 1, Dh / 2] of the step's tokens, by their table rows [T]."""
        return self.cos[rope_rows].unsqueeze(1), self.sin[rope_rows].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates halves of x [T, N, Dh] (the rotate_half convention of HF Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
