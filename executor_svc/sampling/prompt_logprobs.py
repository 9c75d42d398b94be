"""``SamplingParams.prompt_logprobs``: each prompt token's logprob given the tokens before it.

A chunk row at position p predicts the token at p + 1; the rows whose next
token is a prompt token (the step batch's ``prompt_spans``) go through the
final norm and the LM head too, a bounded number of rows at a time, and the
log-softmax of the model's logits (before temperature, penalties or masks) is
read at the prompt's next token, with the top alternatives if asked. A chunk
that does not reach the prompt's end returns its entries in an output without
tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagoda.step import LogprobEntry, SeqOutput, TokenLogprob

# Rows through the LM head at a time: a 2,048-token prompt's logits would be [2048, V] fp32 at once.
ROWS_PER_PASS = 256


def prompt_logprobs(
    model: Any, hidden: torch.Tensor, spans: Sequence[tuple[Any, int, int, int]]
) -> dict[int, tuple[int, tuple[LogprobEntry, ...]]]:
    """seq_id -> (index of the first prompt token scored, its entries) for every span of the step.

    Args:
        model: the decoder (``compute_logits``).
        hidden: the step's hidden states [T, hidden] before the final norm.
        spans: (state, first row, that row's position, rows), the step batch's ``prompt_spans``.
    """
    scored = {}
    for state, row, position, count in spans:
        top = state.sampling.prompt_logprobs
        targets = torch.tensor(state.token_ids[position + 1 : position + 1 + count], device=hidden.device)
        entries: list[LogprobEntry] = []
        for offset in range(0, count, ROWS_PER_PASS):
            rows = hidden[row + offset : row + min(count, offset + ROWS_PER_PASS)]
            logprobs = torch.log_softmax(model.compute_logits(rows.contiguous()).float(), dim=-1)  # [R, V]
            entries += _entries(logprobs, targets[offset : offset + rows.shape[0]], top)
        scored[state.seq_id] = (position + 1, tuple(entries))
    return scored


def _entries(logprobs: torch.Tensor, targets: torch.Tensor, top: int) -> list[LogprobEntry]:
    """Each row's logprob of its target, and its ``top`` best tokens."""
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    target_ids = targets.tolist()
    if not top:
        return [LogprobEntry(TokenLogprob(t, lp)) for t, lp in zip(target_ids, chosen)]
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
    return [
        LogprobEntry(TokenLogprob(t, lp), tuple(TokenLogprob(i, v) for i, v in zip(row_ids, row_values)))
        for t, lp, row_ids, row_values in zip(target_ids, chosen, ids.tolist(), values.tolist())
    ]


def with_prompt_logprobs(
    outputs: list[SeqOutput], scored: dict[int, tuple[int, tuple[LogprobEntry, ...]]], alive: Any
) -> list[SeqOutput]:
    """``outputs`` with their sequences' prompt entries, plus a token-less output for each other scored sequence
    the runner still holds (``alive(seq_id)``; one that failed this step returns nothing)."""
    if not scored:
        return outputs
    merged = []
    for out in outputs:
        start, entries = scored.pop(out.seq_id, (0, ()))
        merged.append(SeqOutput(out.seq_id, out.token_ids, out.logprobs, entries, start) if entries else out)
    merged += [
        SeqOutput(seq_id, (), (), entries, start) for seq_id, (start, entries) in scored.items() if alive(seq_id)
    ]
    return merged
