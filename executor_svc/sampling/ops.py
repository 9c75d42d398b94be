"""Batched tensor kernels of the sampler: penalties, filters, counter-based noise.

Every function works on a whole batch at once with per-row parameters held in
tensors on the logits' device, in float32. None of them keeps state or uses a
torch generator: the random noise is a pure function of a per-row 64-bit key and
the vocabulary index (see ``gumbel_noise``), so a row's result never depends on
which other rows share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """First output of a splitmix64 generator seeded with ``value`` (unsigned 64-bit).

    That is ``mix(value + golden)``; the n-th output is ``mix(value + n * golden)``.
    """
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


def hash_uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), one per (row, token id), from integer ops only.

    ``u[b, v]`` is the top 23 bits of the (v + 1)-th output of a splitmix64
    generator seeded with ``keys[b]``, i.e. ``mix(keys[b] + (v + 1) * golden)``
    (unsigned arithmetic mod 2**64, done in wrapping int64 tensors), plus one
    half, over 2**23. Those 24 significant bits are exact in float32, so the
    values are identical on every device and never 0 or 1. A value depends only
    on its key and token id, so a gathered subset of a row's tokens gets the same
    uniforms as the whole row.

    Args:
        keys: [R] int64 stream keys (``stream_key``).
        token_ids: [V] int64 token ids shared by all rows, or [R, C] per row.

    Returns:
        [R, V] or [R, C] float32 uniforms.
    """
    # In-place ops: [R, V] int64 temporaries are large, and allocating them dominates.
    z = keys[:, None] + (token_ids + 1) * _to_signed64(_GOLDEN)  # wraps mod 2**64
    shifted = torch.empty_like(z)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2)):
        torch.bitwise_right_shift(z, shift, out=shifted)
        shifted &= (1 << (64 - shift)) - 1  # logical, not arithmetic, shift
        z ^= shifted
        z *= _to_signed64(multiplier)
    # splitmix64 ends with z ^ (z >>> 31), which leaves the top 23 bits as they are.
    z >>= 41
    z &= (1 << 23) - 1
    uniforms = z.to(torch.float32)
    uniforms += 0.5
    uniforms *= 1.0 / (1 << 23)
    return uniforms


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` of ``hash_uniforms(keys, token_ids)``."""
    return hash_uniforms(keys, token_ids).log_().neg_().log_().neg_()


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

    ``p / p_max = exp(logit - max logit)``: no normaliser (a sum whose rounding
    would depend on the reduction order), only a max, which is exact.

    Args:
        scaled: [R, V] float32 temperature-scaled logits (-inf allowed).
        min_p: [R] float32 (0 keeps everything).

    Returns:
        [R, V] bool, True where kept.
    """
    ratio = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))  # p / p_max
    return ratio >= min_p[:, None]


def top_k_mask(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Exactly ``top_k`` tokens per row, ties broken towards the lower token id.

    Without a sort: the k-th largest value is the threshold; tokens above it are
    kept, and tokens equal to it are kept in vocabulary order until k are kept.

    Args:
        scaled: [R, V] float32 logits.
        top_k: [R] int64 >= 1 (V or more keeps everything).

    Returns:
        [R, V] bool, True where kept.
    """
    vocab_size = scaled.shape[-1]
    enabled = top_k < vocab_size  # [R]
    if not bool(enabled.any()):
        return torch.ones_like(scaled, dtype=torch.bool)
    max_k = int(torch.where(enabled, top_k, 1).max())
    k = torch.clamp(top_k, max=max_k)  # disabled rows are kept whole below
    top_values = torch.topk(scaled, max_k, dim=-1).values  # [R, max_k], descending
    kth = top_values.gather(1, (k - 1)[:, None])  # [R, 1]
    keep = scaled >= kth
    if bool((keep.sum(dim=-1) > k).any()):  # ties at the threshold: keep the lowest ids
        above = scaled > kth
        tied = scaled == kth
        num_tied_needed = k[:, None] - above.sum(dim=-1, keepdim=True)
        tied_rank = torch.cumsum(tied.to(torch.int32), dim=-1)  # 1-based among ties
        keep = above | (tied & (tied_rank <= num_tied_needed))
    return keep | ~enabled[:, None]


def row_masses(scaled: torch.Tensor) -> torch.Tensor:
    """``sum(exp(scaled - max))`` of each row: the softmax normaliser; [R] float32."""
    return torch.exp(scaled - scaled.amax(dim=-1, keepdim=True)).sum(dim=-1)


def kept_counts(
    sorted_values: torch.Tensor,
    row_mass: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """How many tokens top-k, then top-p over the top-k survivors, keep.

    Top-p keeps the shortest prefix of the ranking whose probability mass is at
    least ``top_p``, and at least one token; removed (-inf) tokens never count.
    Masses are prefix sums of ``exp(value - max)`` in ranking order, so a row's
    count does not depend on C or on the other rows.

    Args:
        sorted_values: [R, C] the C largest logits of each row, descending
            (C may be all of V).
        row_mass: [R] ``row_masses`` of the whole rows: the normaliser of rows
            without top-k.
        top_k: [R] int64 in [1, C], or V for rows without top-k.
        top_p: [R] float32 in (0, 1].
        vocab_size: V.

    Returns:
        [R] int64 counts; a count of C means "C or more" when C < V.
    """
    num_candidates = sorted_values.shape[-1]
    in_top_k = torch.arange(num_candidates, device=sorted_values.device) < top_k[:, None]
    masked = sorted_values.masked_fill(~in_top_k, float("-inf"))  # [R, C]
    mass = torch.cumsum(torch.exp(masked - sorted_values[:, :1]), dim=-1)  # unnormalised
    last = (torch.clamp(top_k, max=num_candidates) - 1)[:, None]
    total = torch.where(top_k < vocab_size, mass.gather(1, last)[:, 0], row_mass)  # [R]
    mass_before = torch.nn.functional.pad(mass[:, :-1], (1, 0))
    within_p = (mass_before < top_p[:, None] * total[:, None]) | (top_p[:, None] >= 1.0)
    keep = in_top_k & within_p & (masked > float("-inf"))
    keep[:, 0] = True
    return keep.sum(dim=-1)


def top_k_top_p_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p over the top-k survivors renormalised (dense, exact).

    Tokens are ranked by descending logit, ties by ascending token id.

    Args:
        scaled: [R, V] float32 logits (-inf allowed).
        top_k: [R] int64 >= 1 (V or more disables).
        top_p: [R] float32 in (0, 1] (1 disables).

    Returns:
        [R, V] bool, True where kept.
    """
    sorted_values = torch.sort(scaled, dim=-1, descending=True).values  # [R, V]
    counts = kept_counts(sorted_values, row_masses(scaled), top_k, top_p, scaled.shape[-1])
    return top_k_mask(scaled, counts)


def gumbel_argmax(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One sample per row of ``softmax(scaled)``: ``argmax(scaled + gumbel)``; [R] int64."""
    token_ids = torch.arange(scaled.shape[-1], device=scaled.device)
    return gumbel_noise(keys, token_ids).add_(scaled).argmax(dim=-1)


def filtered_gumbel_argmax(
    scaled: torch.Tensor,
    keys: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    num_candidates: int = 256,
) -> torch.Tensor:
    """Samples each row from its top-k/top-p set (see ``kept_counts``).

    A row samples among its C largest logits once its kept set is known to lie
    within them, with the same noise per token id and the same tie rule as the
    dense path, so it gets the same token either way. C starts at
    ``max(num_candidates, largest top_k + 1)`` and grows 16-fold (up to V) for rows
    whose top-p set is larger. Rows without top-k and top-p sample densely.

    Args:
        scaled: [R, V] float32 temperature-scaled logits (-inf allowed).
        keys: [R] int64 stream keys.
        top_k: [R] int64 >= 1 (V disables).
        top_p: [R] float32 in (0, 1] (1 disables).
        num_candidates: the least C to start with.

    Returns:
        [R] int64 token ids.
    """
    vocab_size = scaled.shape[-1]
    filtered = (top_k < vocab_size) | (top_p < 1.0)  # [R]
    token_ids = torch.empty_like(keys)
    rows = (~filtered).nonzero()[:, 0]
    if rows.numel():
        token_ids[rows] = gumbel_argmax(scaled[rows], keys[rows])
    needs_row_mass = bool(((top_k >= vocab_size) & (top_p < 1.0)).any())
    row_mass = row_masses(scaled) if needs_row_mass else torch.ones_like(top_p)  # [R]
    pending = filtered.nonzero()[:, 0]
    max_top_k = int(torch.where(top_k < vocab_size, top_k, 1).max())
    # One more than the largest top_k, so that ties at its boundary can be seen.
    num_candidates = min(vocab_size, max(num_candidates, max_top_k + 1))
    while pending.numel():
        values, candidate_ids = torch.topk(scaled[pending], num_candidates, dim=-1)  # [P, C]
        counts = kept_counts(values, row_mass[pending], top_k[pending], top_p[pending], vocab_size)  # [P]
        boundary = values.gather(1, (counts - 1)[:, None])[:, 0]  # smallest kept value
        everything = num_candidates == vocab_size
        complete = (counts < num_candidates) | everything
        # Ties with the boundary all lie among the candidates only if the last
        # candidate is strictly below it.
        sparse = complete & ((boundary > values[:, -1]) | everything)
        done = sparse.nonzero()[:, 0]
        if done.numel():
            token_ids[pending[done]] = _sparse_gumbel_argmax(
                values[done], candidate_ids[done], counts[done], keys[pending[done]]
            )
        done = (complete & ~sparse).nonzero()[:, 0]
        if done.numel():
            rows = pending[done]
            keep = top_k_mask(scaled[rows], counts[done])
            masked = scaled[rows].masked_fill(~keep, float("-inf"))
            token_ids[rows] = gumbel_argmax(masked, keys[rows])
        pending = pending[~complete]
        num_candidates = min(vocab_size, num_candidates * 16)
    return token_ids


def _sparse_gumbel_argmax(
    values: torch.Tensor, candidate_ids: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Gumbel-max among each row's ``counts`` best candidates, ties to lower ids.

    Args:
        values: [S, C] candidate logits, descending.
        candidate_ids: [S, C] their token ids.
        counts: [S] int64 number of tokens kept; every token tied with the
            smallest kept value is among the candidates.
        keys: [S] int64 stream keys.

    Returns:
        [S] int64 token ids.
    """
    boundary = values.gather(1, (counts - 1)[:, None])  # [S, 1]
    ids, order = torch.sort(candidate_ids, dim=-1)  # [S, C] in token id order
    values = values.gather(1, order)
    above = values > boundary
    tied = values == boundary
    num_tied_needed = counts[:, None] - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied.to(torch.int32), dim=-1) <= num_tied_needed))
    noisy = (values + gumbel_noise(keys, ids)).masked_fill(~keep, float("-inf"))
    return ids.gather(1, noisy.argmax(dim=-1, keepdim=True))[:, 0]


def apply_bias(logits: torch.Tensor, rows: Sequence[int], bias: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``bias`` added to ``rows`` (in place).

    Args:
        logits: [B, V] float32.
        rows: R distinct row indices.
        bias: [R, V] float32 on the host (0 or -inf: a constraint's mask).
    """
    bias = bias.to(logits.device)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        return logits.add_(bias)
    return logits.index_add_(0, torch.tensor(list(rows), dtype=torch.int64, device=logits.device), bias)
