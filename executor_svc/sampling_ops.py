"""Batched tensor kernels of the sampler: penalties, filters, counter-based noise.

Every function works on a whole batch at once with per-row parameters held in
tensors on the logits' device, in float32. None of them keeps state or uses a
torch generator: the random noise is a pure function of a per-row 64-bit key and
the vocabulary index (see ``gumbel_noise``), so a row's result never depends on
which other rows share its batch.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea, Flood 2014).
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _to_signed64(value: int) -> int:
    """The int64 whose two's-complement bits equal ``value mod 2**64``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def splitmix64(value: int) -> int:
    """The splitmix64 finaliser of ``value + golden`` on Python ints (unsigned 64-bit)."""
    z = (value + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, position: int) -> int:
    """The 64-bit key of the random stream for one token of one sequence.

    Args:
        seed: The request's seed (any Python int; taken modulo 2**64).
        position: Index of the token being sampled in its sequence.

    Returns:
        ``splitmix64(splitmix64(seed) ^ position)`` as a signed int64 value.
    """
    return _to_signed64(splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64)))


def _shr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bits."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def hash_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), one per (row, vocabulary index), from integer ops only.

    ``u[b, v]`` is the top 23 bits of ``splitmix64(keys[b] + (v + 1) * golden)``
    (unsigned arithmetic mod 2**64, done in wrapping int64 tensors), plus one
    half, over 2**23. Those 24 significant bits are exact in float32, so the
    values are identical on every device and never 0 or 1.

    Args:
        keys: [B] int64 stream keys (``stream_key``).
        vocab_size: V.

    Returns:
        [B, V] float32 uniforms, strictly inside (0, 1).
    """
    counters = torch.arange(1, vocab_size + 1, device=keys.device, dtype=torch.int64)
    z = keys[:, None] + counters * _to_signed64(_GOLDEN)  # [B, V], wraps mod 2**64
    z = (z ^ _shr(z, 30)) * _to_signed64(_MIX1)
    z = (z ^ _shr(z, 27)) * _to_signed64(_MIX2)
    z = z ^ _shr(z, 31)
    top23 = _shr(z, 41).to(torch.float32)
    return (top23 + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` from ``hash_uniforms``; [B, V] float32."""
    u = hash_uniforms(keys, vocab_size)
    return -torch.log(-torch.log(u))


def apply_penalties(
    logits: torch.Tensor,
    all_row_ids: torch.Tensor,
    all_token_ids: torch.Tensor,
    output_row_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then presence and frequency penalties (out of place).

    Repetition (Hugging Face semantics) covers every token of the sequence,
    prompt and output: a positive logit is divided by the penalty, any other is
    multiplied. Presence and frequency (OpenAI semantics) cover output tokens
    only: ``logit -= presence * (count > 0) + frequency * count``.

    The token lists are flat: ``(all_row_ids[i], all_token_ids[i])`` says that
    token ``all_token_ids[i]`` occurs in row ``all_row_ids[i]``.

    Args:
        logits: [B, V] float32.
        all_row_ids: [N] int64 row of each prompt-or-output token.
        all_token_ids: [N] int64 those tokens.
        output_row_ids: [M] int64 row of each output token.
        output_token_ids: [M] int64 those tokens.
        repetition: [B] float32 repetition penalties (1 disables).
        presence: [B] float32 presence penalties (0 disables).
        frequency: [B] float32 frequency penalties (0 disables).

    Returns:
        [B, V] float32 penalised logits.
    """
    seen = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]
    seen[all_row_ids, all_token_ids] = True
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    counts = torch.zeros_like(logits)  # [B, V] occurrences in the output
    ones = torch.ones_like(output_token_ids, dtype=logits.dtype)
    counts.index_put_((output_row_ids, output_token_ids), ones, accumulate=True)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def min_p_mask(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is at least ``min_p`` times the largest one.

    Args:
        scaled: [B, V] float32 temperature-scaled logits (-inf allowed).
        min_p: [B] float32 (0 keeps everything).

    Returns:
        [B, V] bool, True where kept.
    """
    probs = torch.softmax(scaled, dim=-1)
    max_probs = probs.amax(dim=-1, keepdim=True)
    return probs >= min_p[:, None] * max_probs


def top_k_mask(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Exactly ``top_k`` tokens per row, ties broken towards the lower token id.

    Without a sort: the k-th largest value is the threshold; tokens above it are
    kept, and tokens equal to it are kept in vocabulary order until k are kept.

    Args:
        scaled: [B, V] float32 logits.
        top_k: [B] int64, each in [1, V] (V keeps everything).

    Returns:
        [B, V] bool, True where kept.
    """
    vocab_size = scaled.shape[-1]
    enabled = top_k < vocab_size  # [B]
    if not bool(enabled.any()):
        return torch.ones_like(scaled, dtype=torch.bool)
    max_k = int(torch.where(enabled, top_k, 1).max())
    k = torch.clamp(top_k, max=max_k)  # disabled rows are kept whole below
    top_values = torch.topk(scaled, max_k, dim=-1).values  # [B, max_k], descending
    kth = top_values.gather(1, (k - 1)[:, None])  # [B, 1]
    above = scaled > kth
    tied = scaled == kth
    num_tied_needed = k[:, None] - above.sum(dim=-1, keepdim=True)
    tied_rank = torch.cumsum(tied.to(torch.int32), dim=-1)  # 1-based among ties
    keep = above | (tied & (tied_rank <= num_tied_needed))
    return keep | ~enabled[:, None]


def top_k_top_p_mask(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p over the top-k survivors renormalised, via one stable sort.

    Tokens are ranked by descending logit, ties by ascending token id. Top-p keeps
    the shortest prefix of that ranking whose probability mass is at least
    ``top_p`` (always the first token).

    Args:
        scaled: [B, V] float32 logits (-inf allowed).
        top_k: [B] int64 in [1, V] (V disables).
        top_p: [B] float32 in (0, 1] (1 disables).

    Returns:
        [B, V] bool, True where kept.
    """
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)  # [V]
    in_top_k = ranks[None, :] < top_k[:, None]  # [B, V] in sorted order
    sorted_logits = sorted_logits.masked_fill(~in_top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass = torch.cumsum(sorted_probs, dim=-1)
    mass_before = torch.nn.functional.pad(mass[:, :-1], (1, 0))  # exclusive cumsum
    keep_sorted = in_top_k & (mass_before < top_p[:, None])
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
