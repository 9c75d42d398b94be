"""The constructor ``Client`` and ``AsyncClient`` share: settings -> core, channel, stub."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from pagoda.channel import ChannelOption, Tls
from pagoda.v1 import generation_pb2_grpc
from pagoda_client.core.retry import RetryPolicy
from pagoda_client.core.session import ClientCore

DEFAULT_TARGET = "127.0.0.1:50051"
ChannelT = TypeVar("ChannelT", grpc.Channel, grpc.aio.Channel)
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
