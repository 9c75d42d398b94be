"""Concurrent generation streams with arrival times, for fault tests that kill a process mid-stream.

``run_streams`` (``run_streams_async``: through an ``AsyncClient``) runs requests concurrently through one client
and records, per
stream, the tokens, the text and when each delta arrived; ``KillOnce`` is a
progress callback that fires an action once enough tokens have arrived (and,
if asked, once enough streams have had their first token);
``gaps_after`` measures how long each stream waited for its next token after a
moment (the kill).
"""

from __future__ import annotations

import concurrent.futures
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def mixed_requests(num_requests: int, max_tokens: int, *, vocab: int = 384, seed: int = 1000) -> list[dict[str, Any]]:
    """Half greedy, half seeded sampling at temperature 0.8; random prompts of 4..60 token ids; ``ignore_eos``."""
    requests = []
    for i in range(num_requests):
        rng = random.Random(seed + i)
        request: dict[str, Any] = dict(
            token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 60))],
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0,
        )
        if i % 2:  # seeded: the (seed, position) stream continues identically wherever the request runs
            request.update(temperature=0.8, seed=seed + i)
        requests.append(request)
    return requests


@dataclass
class StreamRecord:
    """One stream as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # The sampled token's logprob of each token, when the request asked for logprobs.
    logprobs: list[float] = field(default_factory=list)
    # How often the client library resumed the stream on another scheduler.
    num_resumes: int = 0
    # (time.monotonic() when a delta arrived, number of tokens in it)
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    def next_token_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first token that arrived after it (None: none did)."""
        later = [t for t, num_tokens in self.arrivals if t > moment and num_tokens]
        return later[0] - moment if later else None


def run_streams(
    client: Any, requests: Sequence[dict[str, Any]], on_progress: Callable[[int, int], None] | None = None
) -> list[StreamRecord]:
    """Run every request concurrently through ``client.stream``.

    ``on_progress(total tokens so far, streams that have had a token)`` is called per delta.
    """
    received = [0]
    started: set[int] = set()
    lock = threading.Lock()

    def one(index: int, request: dict[str, Any]) -> StreamRecord:
        record = StreamRecord()
        with client.stream(**request) as stream:
            for delta in stream:
                record.arrivals.append((time.monotonic(), len(delta.token_ids)))
                record.token_ids.extend(delta.token_ids)
                record.text += delta.text
                record.logprobs.extend(entry.sampled.logprob for entry in delta.logprobs)
                with lock:
                    received[0] += len(delta.token_ids)
                    if delta.token_ids:
                        started.add(index)
                    total, num_started = received[0], len(started)
                if on_progress is not None:
                    on_progress(total, num_started)
            record.num_resumes = stream.num_resumes
        return record

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests)), requests))


async def run_streams_async(
    client: Any, requests: Sequence[dict[str, Any]], on_progress: Callable[[int, int], None] | None = None
) -> list[StreamRecord]:
    """``run_streams`` through an ``AsyncClient``: every request concurrently on its event loop."""
    import asyncio

    received = [0]
    started: set[int] = set()

    async def one(index: int, request: dict[str, Any]) -> StreamRecord:
        record = StreamRecord()
        async with client.stream(**request) as stream:
            async for delta in stream:
                record.arrivals.append((time.monotonic(), len(delta.token_ids)))
                record.token_ids.extend(delta.token_ids)
                record.text += delta.text
                record.logprobs.extend(entry.sampled.logprob for entry in delta.logprobs)
                received[0] += len(delta.token_ids)
                if delta.token_ids:
                    started.add(index)
                if on_progress is not None:
                    on_progress(received[0], len(started))
            record.num_resumes = stream.num_resumes
        return record

    return list(await asyncio.gather(*(one(i, request) for i, request in enumerate(requests))))


class KillOnce:
    """A progress callback that runs ``action`` once; records when.

    It fires when ``at_tokens`` tokens have arrived and at least
    ``min_streams_started`` streams have had a token. The second condition keeps
    a kill mid-stream for every stream of a process that started late: on two
    busy cores one scheduler's batch can begin a second after the other's.
    """

    def __init__(self, at_tokens: int, action: Callable[[], None], *, min_streams_started: int = 0) -> None:
        self.at_tokens = at_tokens
        self.min_streams_started = min_streams_started
        self.action = action
        self.fired_at: float | None = None
        self._lock = threading.Lock()

    def __call__(self, total: int, num_started: int) -> None:
        with self._lock:
            if self.fired_at is not None or total < self.at_tokens or num_started < self.min_streams_started:
                return
            self.fired_at = time.monotonic()
        self.action()


def gaps_after(records: Sequence[StreamRecord], moment: float) -> list[float]:
    """Per stream that got a token after ``moment``, the seconds it waited for it; sorted."""
    return sorted(gap for gap in (r.next_token_after(moment) for r in records) if gap is not None)


def p50_and_max(values: Sequence[float]) -> tuple[float, float]:
    """Median and maximum (0, 0 for none)."""
    return (statistics.median(values), max(values)) if values else (0.0, 0.0)
