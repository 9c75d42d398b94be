"""What ``Client`` and ``AsyncClient`` share: the constructor (settings -> core, channel,
stub) and the attempt bookkeeping of their call drivers; the I/O itself is theirs."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from pagoda.channel import ChannelOption, Tls
from pagoda.v1 import generation_pb2_grpc
from pagoda_client.core.calls import CallState
from pagoda_client.core.retry import RetryPolicy
from pagoda_client.core.session import ClientCore
from pagoda_client.core.stream import StreamState
from pagoda_client.results import GenerationDelta, GenerationResult

DEFAULT_TARGET = "127.0.0.1:50051"
ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)
T = TypeVar("T")
# The generated stub is untyped: its methods return what the channel kind returns.
_GenerationStub: Callable[[Any], Any] = generation_pb2_grpc.GenerationStub


class BaseClient(abc.ABC, Generic[ChannelT]):
    """Client of the Pagoda ``Generation`` API: one channel, reused by every call.

    Args:
        target: ``host:port`` of the scheduler.
        timeout: default deadline of every call, in seconds (None: none).
        tls: False for plaintext, True for TLS with the system roots, or a
            ``TlsConfig`` (CA, client certificate and key).
        api_key: sent as ``authorization: Bearer <key>`` metadata.
        max_retries: retries on UNAVAILABLE before the first response.
        retry_backoff_s: first backoff; doubles per retry up to
            ``retry_max_backoff_s``, with jitter.
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        tls: Tls = False,
        api_key: str | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        retry_max_backoff_s: float = 5.0,
        options: Sequence[ChannelOption] = (),
    ) -> None:
        self.target = target
        retry = RetryPolicy(max_retries, retry_backoff_s, retry_max_backoff_s)
        self._core = ClientCore(timeout=timeout, api_key=api_key, retry=retry)
        self._channel: ChannelT = self._open_channel(target, tls, options)
        self._stub = _GenerationStub(self._channel)

    @property
    def timeout(self) -> float | None:
        """The default deadline of every call, in seconds."""
        return self._core.timeout

    @abc.abstractmethod
    def _open_channel(self, target: str, tls: Tls, options: Sequence[ChannelOption]) -> ChannelT:
        """The channel of this client's kind (sync or asyncio)."""


class CallDriver(Generic[T]):
    """What the sync and asyncio shells share to drive one ``CallState``: the attempt in flight.

    ``method`` is the stub's multi-callable; an attempt is one call of it with
    the state's request, timeout and metadata.
    """

    def __init__(self, method: Callable[..., Any], state: CallState[T]) -> None:
        self._method = method
        self._state = state
        self._call: Any = None

    def _attempt(self) -> Any:
        """The call in progress, or a new attempt (raises DEADLINE_EXCEEDED when no time is left)."""
        if self._call is None:
            state = self._state
            self._call = self._method(state.next_request(), timeout=state.timeout_s(), metadata=state.metadata)
        return self._call

    def _cancel(self) -> None:
        """Stop reading and cancel the RPC in flight (idempotent)."""
        self._state.close()
        if self._call is not None:
            self._call.cancel()
            self._call = None


class StreamDriver(CallDriver[GenerationDelta]):
    """A ``CallDriver`` of a ``Generate`` stream: what it exposes of its ``StreamState``."""

    def __init__(self, method: Callable[..., Any], state: StreamState) -> None:
        super().__init__(method, state)
        self._stream = state

    @property
    def request_id(self) -> str | None:
        """The request id: the one given, else the server's once a response arrived."""
        return self._stream.request_id

    @property
    def result(self) -> GenerationResult:
        """The deltas received so far, folded into one result."""
        return self._stream.result
