"""Benchmark workloads (prompts as token ids, so lengths are exact) and arrivals.

Random workload rule (W-mixed is ``random`` with 64 prompts, 16:512, 16:256,
seed 0): ``rng = random.Random(seed)``; for each request draw
``rng.randint(*input_len_range)`` then ``rng.randint(*output_len_range)``;
after all lengths, the same ``rng`` draws each prompt's token ids in order,
uniformly from ``[0, vocab_size)`` without the excluded (EOS) ids. With an
``ids_salt`` the ids come from ``random.Random(f"{seed}:{ids_salt}")`` instead:
the same lengths, prompts no server has seen (``pagoda bench --server`` salts
them per invocation, round and server, so a server that keeps its KV cache
across starts, as ``pagoda serve``'s disk tier does, or shares its directory
with another server compared, prefills every run's prompts).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_NUM_PROMPTS = 100_000


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt and the output length it forces."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        """Prompt tokens."""
        return len(self.prompt_token_ids)


def parse_range(spec: str) -> tuple[int, int]:
    """``"16:512"`` → ``(16, 512)`` (inclusive); ``"32"`` → ``(32, 32)``.

    Raises:
        ValueError: malformed, non-positive or reversed.
    """
    low_text, _, high_text = spec.partition(":")
    low, high = int(low_text), int(high_text or low_text)
    if low < 1 or high < low:
        raise ValueError(f"bad length range {spec!r}: expected LOW:HIGH with 1 <= LOW <= HIGH")
    return low, high


def draw_lengths(
    num_prompts: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int], rng: random.Random
) -> list[tuple[int, int]]:
    """(prompt length, output length) per request: prompt drawn first, then output."""
    return [(rng.randint(*input_len_range), rng.randint(*output_len_range)) for _ in range(num_prompts)]


def _vocab_ids(vocab_size: int, excluded_ids: Sequence[int]) -> list[int]:
    excluded = set(excluded_ids)
    return [t for t in range(vocab_size) if t not in excluded]


def _draw_ids(rng: random.Random, vocab_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
    return tuple(vocab_ids[rng.randrange(len(vocab_ids))] for _ in range(num_tokens))


def random_workload(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int,
    vocab_size: int,
    excluded_ids: Sequence[int] = (),
    prefix_len: int = 0,
    ids_salt: int | str | None = None,
) -> list[BenchRequest]:
    """The ``random`` workload (see the module docstring for the rule); with ``prefix_len``, the ``prefix`` one.

    The ``prefix`` workload: N requests sharing one ``prefix_len``-token system
    prompt. With ``rng = random.Random(seed)``: (suffix length, output length)
    per request drawn as in the random rule (``input_len_range`` is the suffix's),
    then the shared prefix's ids, then each request's suffix ids.
    """
    _check_count(num_prompts)
    rng = random.Random(seed)
    lengths = draw_lengths(num_prompts, input_len_range, output_len_range, rng)
    if ids_salt is not None:
        rng = random.Random(f"{seed}:{ids_salt}")
    vocab_ids = _vocab_ids(vocab_size, excluded_ids)
    prefix = _draw_ids(rng, vocab_ids, prefix_len)  # no draw without a prefix: the random rule
    return [
        BenchRequest(i, prefix + _draw_ids(rng, vocab_ids, prompt_len), output_len)
        for i, (prompt_len, output_len) in enumerate(lengths)
    ]


def sharegpt_workload(
    path: str | Path,
    num_prompts: int,
    seed: int,
    tokenize: Callable[[str], list[int]],
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[BenchRequest]:
    """Conversations of a ShareGPT JSON file: first human turn → prompt,
    the reply's token count → output length (as ``vllm bench``).

    Conversations are shuffled with ``random.Random(seed)``; pairs with a
    prompt or output under 4 tokens, a prompt over ``max_prompt_len`` or a
    total over ``max_total_len`` are skipped (unless ``fixed_output_len``).
    """
    _check_count(num_prompts)
    conversations = [
        c["conversations"] for c in json.loads(Path(path).read_text()) if len(c.get("conversations", [])) >= 2
    ]
    random.Random(seed).shuffle(conversations)
    requests: list[BenchRequest] = []
    for turns in conversations:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenize(turns[0]["value"])
        output_len = fixed_output_len or len(tokenize(turns[1]["value"]))
        too_short = len(prompt_ids) < 4 or output_len < 4
        too_long = len(prompt_ids) > max_prompt_len or len(prompt_ids) + output_len > max_total_len
        if fixed_output_len is None and (too_short or too_long):
            continue
        requests.append(BenchRequest(len(requests), tuple(prompt_ids), output_len))
    return requests


def arrival_times(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets (seconds from the start) of each request.

    ``request_rate`` inf: all at 0. Otherwise gaps are gamma-distributed with
    shape ``burstiness`` and mean ``1 / request_rate`` (burstiness 1 is a
    Poisson process), drawn from ``random.Random(seed)``; the first request
    is sent after the first gap.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.gammavariate(burstiness, scale)
        times.append(now)
    return times


def _check_count(num_prompts: int) -> None:
    if not 1 <= num_prompts <= MAX_NUM_PROMPTS:
        raise ValueError(f"num_prompts must be in [1, {MAX_NUM_PROMPTS}]")
