"""The state of one call, as the sync and asyncio shells drive it.

Every call, unary or streaming, is driven the same way (a unary call is a
stream of one response)::

    while not state.done:
        open an attempt: stub_of(state.next_endpoint()).method(
            state.next_request(), timeout=state.timeout_s(), metadata=state.metadata)
        each response   -> state.on_response(response)  (returned to the caller)
        end of stream   -> state.on_end()
        grpc.RpcError   -> sleep state.backoff_s(error), which raises PagodaError when not retried

An attempt that fails at the transport marks its endpoint down, so the next
attempt goes to another address when there is one (at once), else to the same
one after a backoff.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage

from pagoda.step_pb import lora_from_pb
from pagoda.v1 import generation_pb2
from pagoda_client.core import convert
from pagoda_client.core.requests import Metadata, detokenize_request, tokenize_request
from pagoda_client.core.retry import Deadline, Jitter, RetryPolicy
from pagoda_client.core.targets import DEFAULT_TARGET, Endpoint, Targets
from pagoda_client.errors import PagodaError, rpc_status
from pagoda_client.options import TokenizeOptions
from pagoda_client.results import LoraAdapter, ModelInfo, ServerStatus

T = TypeVar("T")
logger = logging.getLogger(__name__)
# Names are looked up again when every address failed, at most this often.
_MIN_RESOLVE_INTERVAL_S = 1.0


class CallState(Generic[T]):
    """One call's request, progress and retry decisions; no I/O.

    Args:
        request: the request message of every attempt.
        convert: response message -> what the caller gets.
        policy: which failures are retried, and the backoff.
        deadline: the whole call's deadline, retries included.
        metadata: gRPC metadata of every attempt.
        request_id: named in errors.
        jitter: the random source of the backoff.
        targets: the client's endpoints (None: one, the default target).
    """

    def __init__(
        self,
        request: ProtoMessage,
        convert: Callable[[Any], T],
        *,
        policy: RetryPolicy,
        deadline: Deadline,
        metadata: Metadata = (),
        request_id: str | None = None,
        jitter: Jitter = random.random,
        targets: Targets | None = None,
    ) -> None:
        self.request = request
        self.metadata = metadata
        self.request_id = request_id
        self._done = False
        self.num_responses = 0
        self.num_retries = 0
        self._convert = convert
        self._policy = policy
        self._deadline = deadline
        self._jitter = jitter
        self._targets = targets or Targets(DEFAULT_TARGET, clock=deadline.clock)
        # The endpoint of the attempt in flight (of the first one until it starts), whether it answered.
        self.endpoint = self._targets.pick()
        self._started = self._answered = False

    @property
    def done(self) -> bool:
        """Whether the call is over (ended, given up, or failed for good)."""
        return self._done

    @done.setter
    def done(self, value: bool) -> None:
        if value and not self._done:
            self._done = True
            self._on_done()
        self._done = value

    def _on_done(self) -> None:
        """The call just ended (a subclass closes what it opened)."""

    def next_request(self) -> ProtoMessage:
        """The request of the next attempt."""
        return self.request

    def next_endpoint(self) -> Endpoint:
        """Where the next attempt goes (round-robin over the endpoints not known to be down)."""
        if self._started:
            self.endpoint = self._targets.pick()
        self._started, self._answered = True, False
        return self.endpoint

    def timeout_s(self) -> float | None:
        """The next attempt's timeout: what is left of the deadline.

        Raises:
            PagodaError: DEADLINE_EXCEEDED when nothing is left (the call is done).
        """
        left = self._deadline.remaining()
        if left is not None and left <= 0:
            self.done = True
            raise PagodaError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", self.request_id)
        return left

    def on_response(self, response: Any) -> T:
        """One response arrived: what the caller gets for it."""
        if not self._answered:
            self._answered = True
            self._targets.mark_up(self.endpoint)
        self.num_responses += 1
        return self._convert(response)

    def on_end(self) -> None:
        """The server ended the call normally."""
        self.done = True

    def close(self) -> None:
        """The caller gave up on the call (nothing more is read)."""
        self.done = True

    def retryable(self, code: grpc.StatusCode) -> bool:
        """Whether a failure with ``code`` is retried now: only before any response, within the policy."""
        return self.num_responses == 0 and self._policy.should_retry(code, self.num_retries)

    def backoff_s(self, error: grpc.RpcError) -> float:
        """An attempt failed: the seconds to wait before the next one.

        Raises:
            PagodaError: the failure, when it is not retried (the call is done).
        """
        code, message = rpc_status(error)
        if not self.retryable(code):
            self.done = True
            raise PagodaError(code, message, self.request_id) from None
        delay_s = self._deadline.cap(self._mark_down())
        self._count_retry(code, delay_s)
        return delay_s

    def _mark_down(self) -> float:
        """The failed attempt's endpoint is down: seconds until one is up (names resolved again when none is)."""
        self._targets.mark_down(self.endpoint, self._policy, self._jitter())
        if self._targets.wait_s() > 0:
            self._targets.refresh(min_interval_s=_MIN_RESOLVE_INTERVAL_S)
        return self._targets.wait_s()

    def _count_retry(self, code: grpc.StatusCode, delay_s: float) -> None:
        self.num_retries += 1
        logger.info("%s: retry %d of %d in %.2fs", code.name, self.num_retries, self._policy.max_retries, delay_s)


@dataclass(frozen=True)
class UnaryCall(Generic[T]):
    """A unary RPC of the ``Generation`` service: its method name, request and conversion."""

    method: str
    request: ProtoMessage
    convert: Callable[[Any], T]


def model_info_call() -> UnaryCall[ModelInfo]:
    """``GetModelInfo``."""
    return UnaryCall("GetModelInfo", generation_pb2.GetModelInfoRequest(), convert.model_info_from_pb)


def status_call() -> UnaryCall[ServerStatus]:
    """``GetStatus``."""
    return UnaryCall("GetStatus", generation_pb2.GetStatusRequest(), convert.status_from_pb)


def load_lora_call(name: str, path: str) -> UnaryCall[LoraAdapter]:
    """``LoadLoraAdapter``: retried as any unary call, which is safe, as loading a name again with the same folder
    returns the adapter loaded."""
    request = generation_pb2.LoadLoraAdapterRequest(name=name, path=path)
    return UnaryCall("LoadLoraAdapter", request, lora_from_pb)


def unload_lora_call(name: str) -> UnaryCall[None]:
    """``UnloadLoraAdapter``."""
    return UnaryCall("UnloadLoraAdapter", generation_pb2.UnloadLoraAdapterRequest(name=name), lambda _: None)


def tokenize_call(text: str | None, options: Mapping[str, Any]) -> UnaryCall[list[int]]:
    """``Tokenize`` of text, or of ``messages`` through the chat template (``TokenizeOptions``)."""
    unknown = sorted(set(options) - set(TokenizeOptions.__annotations__))
    if unknown:
        raise TypeError(f"unknown tokenize options: {', '.join(unknown)}")
    request = tokenize_request(text, options.get("messages"), options.get("add_special_tokens"))
    return UnaryCall("Tokenize", request, convert.token_ids_from_pb)


def detokenize_call(token_ids: Sequence[int], skip_special_tokens: bool | None) -> UnaryCall[str]:
    """``Detokenize``."""
    return UnaryCall("Detokenize", detokenize_request(token_ids, skip_special_tokens), convert.text_from_pb)
