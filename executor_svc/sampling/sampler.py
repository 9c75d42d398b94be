"""Batched sampling of one token per sequence, on the logits' device.

``sample(logits, requests)`` takes the last-position logits of a batch ([B, V],
any float dtype) and one ``SampleRequest`` per row, and returns one
``SampleOutput`` per row. Every parameter is per row, held in a tensor, so a
batch may mix greedy and random rows with different settings.

Order of operations (as in vLLM), all in float32:

1. Penalties on the raw logits: repetition (Hugging Face semantics, over prompt
   and output tokens: a positive logit is divided by the penalty, any other is
   multiplied), then presence and frequency (OpenAI semantics, output tokens
   only: ``logit -= presence * (count > 0) + frequency * count``).
2. Logprobs, when asked: ``log_softmax`` of the penalised logits, before
   temperature and filtering, i.e. the model's distribution after penalties
   (vLLM's default returns raw-model logprobs; ours include the penalties, which
   are part of what the model is asked to do; temperature and truncation are
   not). The sampled token's logprob plus the ``n`` best (n = params.logprobs).
3. Greedy rows (temperature < 1e-5) take ``argmax`` of the penalised logits
   (lowest token id on ties). Random rows go on:
4. Temperature: ``scaled = logits / T``.
5. Filters on ``scaled``: min-p (keep tokens with prob >= min_p * max prob),
   then top-k (exactly k tokens, ties towards the lower id; k <= 0 disables),
   then top-p over the top-k survivors renormalised (the shortest prefix of the
   ranking, by descending logit then ascending id, whose mass is >= p; at least
   one token). Removed tokens become -inf.
6. Gumbel-max: ``token = argmax(scaled + g)``, with ``g = -log(-log(u))``;
   this samples exactly from ``softmax(scaled)`` restricted to the kept set.

Fast paths: all rows plain greedy -> one argmax; no penalty, min-p, top-k or
top-p kernel runs unless some row uses it. Top-k/top-p rows sample among their
C best logits (``C = max(256, largest top_k + 1)``, 16-fold larger on each retry
for rows whose top-p set does not fit) once the kept set is known to lie within
them; that gives exactly the token of the dense mask (same noise per token id,
same tie rule). Rows with ties straddling the C-th logit use the dense mask.
Every step is elementwise or a max/argmax (independent of reduction order)
except the top-p mass (a softmax normaliser and a prefix sum) and the logprobs,
so only a top-p boundary within float rounding of p could come out differently
on another device.

Random stream: for the token at position ``pos = len(token_ids)`` of a request
with seed ``s``, ``key = splitmix64(splitmix64(s) ^ pos)`` (first outputs of
splitmix64 generators, on the host in exact unsigned 64-bit arithmetic), and
the uniform of vocabulary entry ``v`` is the top 23 bits of the (v + 1)-th
output of a splitmix64 generator seeded with ``key``, plus 1/2, over 2**23,
computed with wrapping int64 tensor ops on the device (``sampling_ops``). No
generator is shared, so a sequence gets the same tokens alone or in any batch,
on CPU or CUDA, and after moving to another executor.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch

from executor_svc.sampling import ops as sampling_ops
from pagoda.params import SamplingParams, out_of_range
from pagoda.step import LogprobEntry, TokenLogprob

# Temperatures below this are greedy (dividing by them would overflow).
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    # All tokens of the sequence so far (prompt then output).
    token_ids: Sequence[int]
    # token_ids[:num_prompt_tokens] is the prompt.
    num_prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """The token sampled for one row."""

    token_id: int
    # None unless params.logprobs is not None.
    logprob: LogprobEntry | None


def validate_sampling_params(params: SamplingParams) -> None:
    """Raises ValueError when ``params`` cannot be sampled with (a range of the parameter table)."""
    reason = out_of_range(params)
    if reason is not None:
        raise ValueError(reason)


def is_greedy(params: SamplingParams) -> bool:
    """True when the row takes the argmax instead of sampling."""
    return params.temperature < GREEDY_TEMPERATURE


def _has_repetition(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0


def _has_output_penalty(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _is_plain_greedy(params: SamplingParams) -> bool:
    return (
        is_greedy(params)
        and params.logprobs is None
        and not _has_repetition(params)
        and not _has_output_penalty(params)
    )


def sample(
    logits: torch.Tensor,
    requests: Sequence[SampleRequest],
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    masks: tuple[Sequence[int], torch.Tensor] | None = None,
) -> list[SampleOutput]:
    """Samples one token per row (see the module docstring for the exact rules).

    Args:
        logits: [B, V] any float dtype, on the model's device; one row per request.
        requests: B requests, in row order.
        argmax: row-wise argmax for the all-greedy fast path (a faster kernel
            for the logits' dtype); torch.argmax when None.
        masks: (rows, [R, V] float32 bias: 0 or -inf) of the constrained rows:
            their disallowed tokens are -inf before anything else (so logprobs
            are those of the constrained distribution). None: no row is.

    Returns:
        B outputs, in row order.
    """
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
    if masks is not None:
        logits = sampling_ops.apply_bias(logits.float(), *masks)
    return _sample(logits, requests, argmax)


def _sample(
    logits: torch.Tensor,
    requests: Sequence[SampleRequest],
    argmax: Callable[[torch.Tensor], torch.Tensor] | None,
) -> list[SampleOutput]:
    """``sample`` once the constrained rows are masked."""
    if all(_is_plain_greedy(r.params) for r in requests):
        token_ids = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
        return [SampleOutput(t, None) for t in token_ids.tolist()]
    logits = logits.float()  # [B, V]
    if any(_has_repetition(r.params) or _has_output_penalty(r.params) for r in requests):
        logits = _penalise(logits, requests)
    random_rows = [i for i, r in enumerate(requests) if not is_greedy(r.params)]
    if len(random_rows) == len(requests):
        token_ids = _sample_random(logits, requests)  # [B]
    else:
        token_ids = logits.argmax(dim=-1)  # [B]; random rows are overwritten
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = _sample_random(logits[rows], [requests[i] for i in random_rows])
            token_ids = token_ids.index_copy(0, rows, chosen)
    logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    entries = _logprobs(logits, token_ids, logprob_rows, requests)
    return [SampleOutput(token_id, entries.get(i)) for i, token_id in enumerate(token_ids.tolist())]


def _penalise(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Applies the rows' repetition, presence and frequency penalties."""
    device, vocab_size = logits.device, logits.shape[-1]
    all_lists = [r.token_ids if _has_repetition(r.params) else () for r in requests]
    output_lists = [r.token_ids[r.num_prompt_tokens :] if _has_output_penalty(r.params) else () for r in requests]
    all_rows, all_tokens = _flatten(all_lists, vocab_size, device)
    output_rows, output_tokens = _flatten(output_lists, vocab_size, device)
    penalties = torch.tensor(
        [
            [r.params.repetition_penalty for r in requests],
            [r.params.presence_penalty for r in requests],
            [r.params.frequency_penalty for r in requests],
        ],
        dtype=torch.float32,
    ).to(device)  # [3, B]
    return sampling_ops.apply_penalties(logits, all_rows, all_tokens, output_rows, output_tokens, *penalties)


def _flatten(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row id, token id) pairs of in-vocabulary tokens; both [N] int64."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    return rows[in_vocab].to(device), tokens[in_vocab].to(device)


def _sample_random(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Temperature, filters and Gumbel-max for random rows.

    Args:
        logits: [R, V] float32 penalised logits of the random rows.
        requests: their R requests.

    Returns:
        [R] int64 sampled token ids.
    """
    device, vocab_size = logits.device, logits.shape[-1]
    params = [r.params for r in requests]
    floats = torch.tensor(
        [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        dtype=torch.float32,
    ).to(device)  # [3, R]
    temperature, top_p, min_p = floats
    scaled = logits / temperature[:, None]  # [R, V]
    if any(p.min_p > 0.0 for p in params):
        scaled = scaled.masked_fill(~sampling_ops.min_p_mask(scaled, min_p), float("-inf"))
    keys = torch.tensor(
        [sampling_ops.stream_key(r.params.seed, len(r.token_ids)) for r in requests],
        dtype=torch.int64,
    ).to(device)  # [R]
    if not any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params):
        return sampling_ops.gumbel_argmax(scaled, keys)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=torch.int64).to(
        device
    )  # [R]
    return sampling_ops.filtered_gumbel_argmax(scaled, keys, top_k, top_p)


def _logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    rows: list[int],
    requests: Sequence[SampleRequest],
) -> dict[int, LogprobEntry]:
    """Logprob entries of the given rows, keyed by row index.

    Args:
        logits: [B, V] float32 penalised logits.
        token_ids: [B] int64 sampled tokens.
        rows: rows that asked for logprobs.
        requests: all B requests.
    """
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index], dim=-1)  # [L, V]
    sampled = logprobs.gather(1, token_ids[index][:, None])[:, 0].tolist()
    max_n = max(requests[i].params.logprobs for i in rows)
    top_values, top_ids = torch.topk(logprobs, min(max_n, logprobs.shape[-1]), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    token_list = token_ids[index].tolist()
    entries = {}
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs
        top = tuple(TokenLogprob(t, v) for t, v in zip(top_ids[j][:n], top_values[j][:n]))
        entries[i] = LogprobEntry(TokenLogprob(token_list[j], sampled[j]), top)
    return entries
