"""Histograms fed a whole step at a time, and the step's token accounting.

prometheus_client's Histogram takes one value per call, under a lock, and the
engine has one inter-token gap per sequence per step: at thousands of tokens per
second that was a measurable share of the scheduler's CPU. A `StepHistogram`
takes the bucket counts of a whole step in one call; `StepTokens` collects them
(and the step's token count) while the engine walks the step's updates. The
exposition is the same as a Histogram's (`_bucket`, `_count`, `_sum`), so
dashboards and alerts read it unchanged.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from scheduler_svc.text.output_processor import RequestState


class StepHistogram(Collector):
    """A cumulative histogram that adds many observations per call."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = tuple(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()  # the scrape runs in the metrics server's thread
        registry.register(self)

    def bucket_of(self, value: float) -> int:
        """The index of the bucket `value` falls in (upper bounds are inclusive, as Prometheus's `le`)."""
        return bisect.bisect_left(self.bounds, value)

    def add(self, counts: Sequence[int], total: float) -> None:
        """Observations already bucketed (`counts[i]` in bucket i, +Inf last), whose values sum to `total`."""
        with self._lock:
            for i, count in enumerate(counts):
                if count:
                    self._counts[i] += count
            self._sum += total

    def observe(self, value: float) -> None:
        """One observation."""
        counts = [0] * len(self._counts)
        counts[self.bucket_of(value)] = 1
        self.add(counts, value)

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        return [HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=total)]


class StepTokens:
    """One step's generated tokens: counted once, with each sequence's time to first token or gap since its last."""

    def __init__(self, generation_tokens: Counter, ttft: Histogram, itl: StepHistogram) -> None:
        self._generation_tokens, self._ttft, self._itl = generation_tokens, ttft, itl
        self._now = time.monotonic_ns()
        self._num_tokens = 0
        self._itl_counts = [0] * (len(itl.bounds) + 1)
        self._itl_sum = 0.0

    def add(self, state: RequestState, num_tokens: int) -> None:
        """`num_tokens` new output tokens of one request in this step."""
        if num_tokens <= 0:
            return
        self._num_tokens += num_tokens
        last = state.last_token_ns
        state.last_token_ns = self._now
        if last is None:
            self._ttft.observe((self._now - state.arrival_ns) / 1e9)
            return
        gap = (self._now - last) / 1e9 / num_tokens
        self._itl_counts[self._itl.bucket_of(gap)] += 1
        self._itl_sum += gap

    def observe(self) -> None:
        """Export the step's counts (once per step)."""
        if self._num_tokens:
            self._generation_tokens.inc(self._num_tokens)
            self._itl.add(self._itl_counts, self._itl_sum)
