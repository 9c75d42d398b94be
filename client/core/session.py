"""``ClientCore``: what ``Client`` and ``AsyncClient`` share, without a channel."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from typing import TypeVar

from pagoda_client.core.calls import CallState, UnaryCall
from pagoda_client.core.requests import build_generate_request, call_metadata
from pagoda_client.core.retry import Clock, Deadline, Jitter, RetryPolicy
from pagoda_client.core.stream import StreamState
from pagoda_client.core.targets import DEFAULT_TARGET, Targets
from pagoda_client.core.tracing import call_trace

T = TypeVar("T")


class ClientCore:
    """A client's defaults (deadline, API key, retry policy), its endpoints, and the state of each call it makes.

    Args:
        timeout: default deadline of every call, in seconds (None: none).
        api_key: sent as ``authorization: Bearer <key>`` metadata.
        retry: which failures are retried or resumed, and the backoff.
        clock: the deadlines' clock (tests pass a fake one).
        jitter: the backoff's random source (tests pass a fixed one).
        targets: the endpoints every call spreads over (None: the default target).
    """

    def __init__(
        self,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
        clock: Clock = time.monotonic,
        jitter: Jitter = random.random,
        targets: Targets | None = None,
    ) -> None:
        self.timeout = timeout
        self.api_key = api_key
        self.retry = retry or RetryPolicy()
        self.targets = targets or Targets(DEFAULT_TARGET, clock=clock)
        self._clock = clock
        self._jitter = jitter

    def deadline(self, timeout: float | None) -> Deadline:
        """The deadline of a call with this ``timeout`` (None: the client's default)."""
        return Deadline(self.timeout if timeout is None else timeout, self._clock)

    def generate(self, prompt: str | None, options: Mapping[str, object]) -> StreamState:
        """The state of a new ``Generate`` call; validates and builds its request.

        Raises:
            TypeError: an unknown option or a value of the wrong type.
            ValueError: not exactly one input.
        """
        request = build_generate_request(prompt, options)
        timeout = options.get("timeout")
        if timeout is not None and not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
        trace_metadata, span = call_trace(options.get("traceparent"))
        return StreamState(
            request,
            policy=self.retry,
            deadline=self.deadline(timeout),
            metadata=call_metadata(self.api_key, request.request_id or None) + trace_metadata,
            jitter=self._jitter,
            targets=self.targets,
            span=span,
        )

    def unary(self, call: UnaryCall[T], timeout: float | None) -> CallState[T]:
        """The state of a new unary call."""
        return CallState(
            call.request,
            call.convert,
            policy=self.retry,
            deadline=self.deadline(timeout),
            metadata=call_metadata(self.api_key),
            jitter=self._jitter,
            targets=self.targets,
        )
