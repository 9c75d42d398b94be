"""The state of one ``Generate`` stream: deltas folded into a result, what was delivered."""

from __future__ import annotations

import random

from pagoda.v1 import generation_pb2
from pagoda_client.core.calls import CallState
from pagoda_client.core.convert import delta_from_pb
from pagoda_client.core.requests import Metadata
from pagoda_client.core.retry import Deadline, Jitter, RetryPolicy
from pagoda_client.results import GenerationDelta, GenerationResult


class StreamState(CallState[GenerationDelta]):
    """A ``Generate`` call: its request, every delta folded into ``result``, the request id.

    ``result.token_ids`` are exactly the output tokens handed to the caller,
    in order (a delta is folded in as it is returned, never before): with the
    request, that is all it takes to continue the stream elsewhere, since a
    request is a pure function of its prompt, parameters, seed and delivered
    tokens.
    """

    def __init__(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        policy: RetryPolicy,
        deadline: Deadline,
        metadata: Metadata = (),
        jitter: Jitter = random.random,
    ) -> None:
        super().__init__(
            request,
            delta_from_pb,
            policy=policy,
            deadline=deadline,
            metadata=metadata,
            request_id=request.request_id or None,
            jitter=jitter,
        )
        self.generate_request = request
        self.result = GenerationResult(request_id=request.request_id)

    def on_response(self, response: generation_pb2.GenerateResponse) -> GenerationDelta:
        """Fold one response into ``result``; returns its delta."""
        delta = super().on_response(response)
        self.result.add(delta)
        self.request_id = delta.request_id or self.request_id
        return delta

    @property
    def delivered_token_ids(self) -> tuple[int, ...]:
        """The output token ids delivered so far, in order."""
        return tuple(self.result.token_ids)

    def next_request(self) -> generation_pb2.GenerateRequest:
        """The request of the next attempt.

        Attempts are retried only before any response (``retryable``), so this
        is the original request. Resuming a broken stream is the follow-up of
        this request plus ``delivered_token_ids``, built here.
        """
        return self.generate_request
