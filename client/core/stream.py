"""The state of one ``Generate`` stream: deltas folded into a result, what was delivered, how to resume it."""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import TYPE_CHECKING

import grpc

from pagoda.v1 import generation_pb2
from pagoda_client.core.calls import CallState
from pagoda_client.core.convert import delta_from_pb
from pagoda_client.core.requests import Metadata, resume_request
from pagoda_client.core.retry import Deadline, Jitter, RetryPolicy
from pagoda_client.core.targets import Targets
from pagoda_client.errors import PagodaError
from pagoda_client.results import GenerationDelta, GenerationResult

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)


class StreamState(CallState[GenerationDelta]):
    """A ``Generate`` call: its request, every delta folded into ``result``, the request id and seed.

    ``result.token_ids`` are exactly the output tokens handed to the caller,
    in order (a delta is folded in as it is returned, never before): with the
    request and the effective seed of the first response, that is all it takes
    to continue the stream elsewhere, since a request is a pure function of
    its prompt, parameters, seed and delivered tokens. When the stream breaks
    at the transport (UNAVAILABLE) after some responses, the next attempt is
    that resume request (``next_request``), on another endpoint when one is up;
    the caller sees one stream: no second prompt or seed, contiguous tokens and
    text. A server that sent no seed (one that cannot resume) is not resumed.
    """

    def __init__(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        policy: RetryPolicy,
        deadline: Deadline,
        metadata: Metadata = (),
        jitter: Jitter = random.random,
        targets: Targets | None = None,
        span: Span | None = None,
    ) -> None:
        """``span``: the client span of the call (``pagoda_client.core.tracing``), ended with it."""
        self._span = span
        super().__init__(
            request,
            delta_from_pb,
            policy=policy,
            deadline=deadline,
            metadata=metadata,
            request_id=request.request_id or None,
            jitter=jitter,
            targets=targets,
        )
        self.generate_request = request
        self.result = GenerationResult(request_id=request.request_id)
        # The effective seed, from the first response (None until then, or from a server without resume).
        self.seed: int | None = None
        self.num_resumes = 0
        self._resume_request: generation_pb2.GenerateRequest | None = None

    def on_response(self, response: generation_pb2.GenerateResponse) -> GenerationDelta:
        """Fold one response into ``result``; returns its delta.

        Raises:
            PagodaError: INTERNAL when the response does not continue the stream
                (its output index or seed), a protocol error (the call is done).
        """
        resumed = self._resume_request is not None and not self._answered
        self._check_continues(response)
        delta = super().on_response(response)
        if resumed:  # the application saw the prompt and the seed once already
            delta = dataclasses.replace(delta, prompt_token_ids=(), seed=None, prompt_logprobs=())
        self.result.add(delta)
        self.request_id = delta.request_id or self.request_id
        return delta

    def _on_done(self) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        result = self.result
        span.set_attribute("pagoda.request_id", self.request_id or "")
        span.set_attribute("pagoda.num_completion_tokens", len(result.token_ids))
        span.set_attribute("pagoda.num_resumes", self.num_resumes)
        if result.finish_reason is None:
            from opentelemetry.trace import StatusCode

            span.set_status(StatusCode.ERROR, "the stream ended without a final response")
        else:
            span.set_attribute("pagoda.finish_reason", result.finish_reason.value)
        span.end()

    def _check_continues(self, response: generation_pb2.GenerateResponse) -> None:
        if response.HasField("seed"):
            if self.seed is not None and response.seed != self.seed:
                raise self._protocol_error(f"the resumed stream has seed {response.seed}, not {self.seed}")
            self.seed = response.seed
        expected = len(self.result.token_ids)
        if self.seed is not None and response.output_index != expected:
            raise self._protocol_error(f"a response starts at output index {response.output_index}, not {expected}")

    def _protocol_error(self, what: str) -> PagodaError:
        self.done = True
        return PagodaError(grpc.StatusCode.INTERNAL, f"protocol error: {what}", self.request_id)

    @property
    def delivered_token_ids(self) -> tuple[int, ...]:
        """The output token ids delivered so far, in order."""
        return tuple(self.result.token_ids)

    @property
    def resumable(self) -> bool:
        """Whether a break now can be resumed: the server named the request and its seed."""
        return self.seed is not None and bool(self.request_id) and self.result.finish_reason is None

    def next_request(self) -> generation_pb2.GenerateRequest:
        """The request of the next attempt: the original, or after a break the resume request."""
        return self.generate_request if self._resume_request is None else self._resume_request

    def retryable(self, code: grpc.StatusCode) -> bool:
        """Before any response: a retry (``CallState``); after: a resume of a resumable stream, within the policy."""
        if self.num_responses == 0:
            return super().retryable(code)
        return code == grpc.StatusCode.UNAVAILABLE and self.resumable and self.num_resumes < self._policy.max_resumes

    def backoff_s(self, error: grpc.RpcError) -> float:
        """As ``CallState.backoff_s``; a break after the final response just ends the stream (0 s, done)."""
        if self.result.finish_reason is not None:
            self.done = True
            return 0.0
        return super().backoff_s(error)

    def _count_retry(self, code: grpc.StatusCode, delay_s: float) -> None:
        if self.num_responses == 0:
            super()._count_retry(code, delay_s)
            return
        assert self.seed is not None and self.request_id is not None  # resumable
        self.num_resumes += 1
        delivered = self.delivered_token_ids
        self._resume_request = resume_request(self.generate_request, self.request_id, self.seed, delivered)
        logger.info(
            "%s: resuming request %s after %d tokens, resume %d of %d, in %.2fs",
            code.name,
            self.request_id,
            len(delivered),
            self.num_resumes,
            self._policy.max_resumes,
            delay_s,
        )
