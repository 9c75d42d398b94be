"""What ``Client`` and ``AsyncClient`` share: the constructor (settings -> core, endpoints, one
channel per endpoint) and the attempt bookkeeping of their call drivers; the I/O itself is theirs."""

from __future__ import annotations

import abc
import socket
import threading
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
from pagoda_client.core.targets import DEFAULT_TARGET, Endpoint, Targets, endpoint_options
from pagoda_client.errors import PagodaError
from pagoda_client.results import GenerationDelta, GenerationResult

__all__ = ["DEFAULT_TARGET", "BaseClient", "CallDriver", "StreamDriver", "resolve_addresses"]

ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)
T = TypeVar("T")
# The generated stub is untyped: its methods return what the channel kind returns.
_GenerationStub: Callable[[Any], Any] = generation_pb2_grpc.GenerationStub
# An endpoint -> the stub's multi-callable of one RPC on that endpoint's channel.
MethodOf = Callable[[Endpoint], Callable[..., Any]]


def resolve_addresses(host: str, port: int) -> list[str]:
    """``host:port`` addresses of a name, of the address family it has most of (IPv4 on a tie).

    A name with one address per family (``localhost``: 127.0.0.1 and ::1) thus
    stays one endpoint, dialed by name.
    """
    by_family: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if family in by_family:
            ip = str(sockaddr[0])
            by_family[family].append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return max(by_family.values(), key=len)


class BaseClient(abc.ABC, Generic[ChannelT]):
    """Client of the Pagoda ``Generation`` API: one channel per scheduler address, reused by every call.

    Args:
        target: ``host:port`` of the scheduler; or several, comma-separated
            (``"a:50051,b:50051"``) or as a sequence; or a DNS name that
            resolves to several addresses (looked up now and again when every
            address failed). Calls go round-robin over the addresses not known
            to be down; one that fails at the transport goes to another.
        timeout: default deadline of every call, in seconds (None: none).
        tls: False for plaintext, True for TLS with the system roots, or a
            ``TlsConfig`` (CA, client certificate and key).
        api_key: sent as ``authorization: Bearer <key>`` metadata.
        max_retries: retries on UNAVAILABLE before the first response.
        retry_backoff_s: first backoff; doubles per retry up to
            ``retry_max_backoff_s``, with jitter.
        max_resumes: resumes of one stream that broke (UNAVAILABLE after a
            response): it continues on another address, or the same one once
            it is back, from the tokens already delivered.
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        tls: Tls = False,
        api_key: str | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        retry_max_backoff_s: float = 5.0,
        max_resumes: int = 8,
        options: Sequence[ChannelOption] = (),
    ) -> None:
        self.targets = Targets(target, resolve=resolve_addresses)
        self.target = ",".join(self.targets.given)
        retry = RetryPolicy(max_retries, retry_backoff_s, retry_max_backoff_s, max_resumes)
        self._core = ClientCore(timeout=timeout, api_key=api_key, retry=retry, targets=self.targets)
        self._tls = tls
        self._options = tuple(options)
        self._channels: dict[str, ChannelT] = {}
        self._stubs: dict[str, Any] = {}
        self._lock = threading.Lock()
        for endpoint in self.targets.endpoints:
            self._stub(endpoint)

    @property
    def timeout(self) -> float | None:
        """The default deadline of every call, in seconds."""
        return self._core.timeout

    @abc.abstractmethod
    def _open_channel(self, target: str, tls: Tls, options: Sequence[ChannelOption]) -> ChannelT:
        """The channel of this client's kind (sync or asyncio)."""

    def _stub(self, endpoint: Endpoint) -> Any:
        """The stub on ``endpoint``'s channel, opened on first use (a name resolved to a new address)."""
        with self._lock:
            stub = self._stubs.get(endpoint.address)
            if stub is None:
                options = [*endpoint_options(endpoint, self._tls), *self._options]
                channel = self._channels[endpoint.address] = self._open_channel(endpoint.address, self._tls, options)
                stub = self._stubs[endpoint.address] = _GenerationStub(channel)
            return stub

    def _method(self, name: str) -> MethodOf:
        """``endpoint`` -> the multi-callable of the RPC ``name`` on its channel."""
        return lambda endpoint: getattr(self._stub(endpoint), name)

    def _take_channels(self) -> list[ChannelT]:
        """Every channel opened, forgotten here (to close them)."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        return channels


class CallDriver(Generic[T]):
    """What the sync and asyncio shells share to drive one ``CallState``: the attempt in flight.

    ``method`` gives the stub's multi-callable on an endpoint's channel; an
    attempt is one call of it, on the endpoint the state picks, with the
    state's request, timeout and metadata.
    """

    def __init__(self, method: MethodOf, state: CallState[T]) -> None:
        self._method = method
        self._state = state
        self._call: Any = None

    def _attempt(self) -> Any:
        """The call in progress, or a new attempt (raises DEADLINE_EXCEEDED when no time is left)."""
        if self._call is None:
            state = self._state
            request, timeout_s = state.next_request(), state.timeout_s()
            self._call = self._method(state.next_endpoint())(request, timeout=timeout_s, metadata=state.metadata)
        return self._call

    def _deliver(self, response: Any) -> T:
        """Hand one response to the state; a protocol error it raises cancels the call."""
        try:
            return self._state.on_response(response)
        except PagodaError:
            self._cancel()
            raise

    def _cancel(self) -> None:
        """Stop reading and cancel the RPC in flight (idempotent)."""
        self._state.close()
        if self._call is not None:
            self._call.cancel()
            self._call = None


class StreamDriver(CallDriver[GenerationDelta]):
    """A ``CallDriver`` of a ``Generate`` stream: what it exposes of its ``StreamState``."""

    def __init__(self, method: MethodOf, state: StreamState) -> None:
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

    @property
    def num_resumes(self) -> int:
        """Times the stream broke and was resumed (on another address, or the same one once back)."""
        return self._stream.num_resumes
