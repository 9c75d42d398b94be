"""Retry decisions: which errors, how long to back off, how many attempts, the deadline.

Pure: the clock and the random source are injected (tests pass fakes), and
nothing here sleeps; the shells sleep what ``CallState.backoff_s`` returns.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

Clock = Callable[[], float]
"""Seconds on a monotonic clock (``time.monotonic``)."""
Jitter = Callable[[], float]
"""A uniform draw from [0, 1) (``random.random``)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter on UNAVAILABLE: retries before any response, resumes after.

    Attempt ``n`` (0-based) waits ``uniform(0.5, 1) * min(max_backoff_s,
    initial_backoff_s * 2**n)`` seconds. UNAVAILABLE is the one code where the
    request surely did not run to completion and a new channel attempt can
    succeed (server starting, restarting, gone, draining, or a connection
    reset): a call that failed before any response is retried (at most
    ``max_retries`` times), a stream that broke after some is resumed from
    what it delivered (at most ``max_resumes`` times).
    """

    max_retries: int = 3
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    max_resumes: int = 8

    def __post_init__(self) -> None:
        settings = (self.max_retries, self.initial_backoff_s, self.max_backoff_s, self.max_resumes)
        if min(settings) < 0:
            raise ValueError(f"retry settings must not be negative: {self}")

    def backoff_s(self, attempt: int, unit: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based).

        Args:
            attempt: retries made so far.
            unit: where in the jitter range to land, in [0, 1) (None: random).
        """
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * 2.0**attempt)
        return ceiling * (0.5 + 0.5 * (random.random() if unit is None else unit))

    def should_retry(self, code: grpc.StatusCode | None, attempt: int) -> bool:
        """Whether a failure with ``code`` after ``attempt`` retries is retried."""
        return code == grpc.StatusCode.UNAVAILABLE and attempt < self.max_retries


class Deadline:
    """An absolute deadline from a relative timeout (None: no deadline)."""

    def __init__(self, timeout_s: float | None, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._end = None if timeout_s is None else clock() + timeout_s

    def remaining(self) -> float | None:
        """Seconds left (may be <= 0), or None without a deadline."""
        return None if self._end is None else self._end - self.clock()

    def expired(self) -> bool:
        """True when the deadline has passed."""
        left = self.remaining()
        return left is not None and left <= 0

    def cap(self, delay_s: float) -> float:
        """``delay_s`` shortened to what is left (never negative)."""
        left = self.remaining()
        return delay_s if left is None else max(0.0, min(delay_s, left))
