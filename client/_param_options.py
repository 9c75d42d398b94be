"""Sampling and stopping parameters as client options: one key per row of ``pagoda.params``.

Generated from the table by ``make proto`` (``python -m scripts.gen_client_options``);
do not edit. ``tests/client/test_options.py`` checks that it is current.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict


class ParamOptions(TypedDict, total=False):
    """Sampling and stopping parameters; a key left out (or None) takes the server's default."""

    # sampling: 0 is greedy (argmax)
    temperature: float | None

    # sampling: nucleus sampling mass in (0, 1]; 1 disables
    top_p: float | None

    # sampling: keep the k most likely tokens; 0 or -1 disables
    top_k: int | None

    # sampling: drop tokens below min_p times the top probability
    min_p: float | None

    # sampling: Hugging Face repetition penalty (> 0; 1 disables)
    repetition_penalty: float | None

    # sampling: OpenAI presence penalty in [-2, 2]
    presence_penalty: float | None

    # sampling: OpenAI frequency penalty in [-2, 2]
    frequency_penalty: float | None

    # sampling: random stream seed; the stream depends only on (seed, position); unset: the server draws one
    seed: int | None

    # sampling: top alternatives returned with each token's logprob; unset: none, 0: the sampled token's only
    logprobs: int | None

    # sampling: each prompt token's logprob given the ones before it (the model's, before any sampling parameter),
    # with this many top alternatives; unset: none. The prompt is then computed, not read from the prefix cache
    prompt_logprobs: int | None

    # stopping: new tokens to generate at most (server default when unset)
    max_tokens: int | None

    # stopping: stop when the output contains one of these (not returned)
    stop: Sequence[str] | str | None

    # stopping: stop when one of these token ids is sampled (it is returned)
    stop_token_ids: Sequence[int] | None

    # stopping: keep generating past EOS (benchmarks)
    ignore_eos: bool | None

    # stopping: keep the matched stop string in the returned text
    include_stop_str_in_output: bool | None
