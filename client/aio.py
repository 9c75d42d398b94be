"""Asyncio Pagoda client: the I/O shell (``grpc.aio``) around ``pagoda_client.core``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
import grpc.aio

from pagoda.channel import ChannelOption, Tls, open_aio_channel
from pagoda_client._base import BaseClient
from pagoda_client.core import calls
from pagoda_client.core.calls import CallState, UnaryCall
from pagoda_client.core.stream import StreamState
from pagoda_client.options import Message
from pagoda_client.results import GenerationDelta, GenerationResult, ModelInfo, ServerStatus

if TYPE_CHECKING:
    from typing import Unpack

    from pagoda_client.options import GenerateOptions, RequestOptions, TokenizeOptions

__all__ = ["AsyncClient", "AsyncGenerationStream"]

T = TypeVar("T")


class _Once:
    """A unary ``grpc.aio`` call read like a stream: its response, then EOF."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._read = False

    async def read(self) -> Any:
        if self._read:
            return grpc.aio.EOF
        self._read = True
        return await self._call

    def cancel(self) -> None:
        self._call.cancel()


class _AsyncResponses(Generic[T]):
    """Drives a ``CallState``: opens attempts, reads responses, sleeps the backoff it decides."""

    def __init__(self, method: Callable[..., Any], state: CallState[T]) -> None:
        self._method = method
        self._state = state
        self._call: Any = None

    async def __anext__(self) -> T:
        while not self._state.done:
            try:
                response = await self._attempt().read()
            except grpc.RpcError as error:
                self._call = None
                await asyncio.sleep(self._state.backoff_s(error))
            else:
                if response is not grpc.aio.EOF:
                    return self._state.on_response(response)
                self._call = None
                self._state.on_end()
        raise StopAsyncIteration

    def _attempt(self) -> Any:
        """The call in progress, or a new attempt."""
        if self._call is None:
            state = self._state
            self._call = self._method(state.next_request(), timeout=state.timeout_s(), metadata=state.metadata)
        return self._call


class AsyncGenerationStream(_AsyncResponses[GenerationDelta], AsyncIterator[GenerationDelta]):
    """Deltas of one ``Generate`` call, as they arrive (``async for``).

    ``await stream.aclose()`` (or leaving ``async with``) cancels the RPC,
    which aborts the request on the server. UNAVAILABLE before the first
    response is retried with backoff. ``result`` holds every delta received
    so far, folded.
    """

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

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def aclose(self) -> None:
        """Cancel the RPC (idempotent)."""
        self._stream.close()
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncClient(BaseClient[grpc.aio.Channel]):
    """Asyncio client of the Pagoda ``Generation`` API.

    Same arguments (``BaseClient``) and methods as ``Client``; every call is a
    coroutine, and ``stream`` returns an ``AsyncGenerationStream``. Create it
    inside the event loop that uses it.
    """

    def _open_channel(self, target: str, tls: Tls, options: Sequence[ChannelOption]) -> grpc.aio.Channel:
        return open_aio_channel(target, tls, options)

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> AsyncGenerationStream:
        """Start a generation; ``async for`` over the result (arguments and errors: ``Client.stream``)."""
        return AsyncGenerationStream(self._stub.Generate, self._core.generate(prompt, options))

    async def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> GenerationResult:
        """Generate and return the whole result; arguments as in ``Client.stream``."""
        async with self.stream(prompt, **options) as deltas:
            async for _ in deltas:
                pass
        return deltas.result

    async def chat(self, messages: Sequence[Message], **options: Unpack[RequestOptions]) -> GenerationResult:
        """One assistant reply to ``messages`` (chat template applied by the server)."""
        return await self.generate(messages=messages, **options)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """What model the server serves, and its limits."""
        return await self._unary(calls.model_info_call(), timeout)

    async def tokenize(self, text: str | None = None, **options: Unpack[TokenizeOptions]) -> list[int]:
        """Token ids of ``text`` (or of ``messages=`` through the chat template)."""
        return await self._unary(calls.tokenize_call(text, options), options.get("timeout"))

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        """Text of ``token_ids``."""
        return await self._unary(calls.detokenize_call(token_ids, skip_special_tokens), timeout)

    async def status(self, *, timeout: float | None = None) -> ServerStatus:
        """Queues, KV usage and executors of the server."""
        return await self._unary(calls.status_call(), timeout)

    async def _unary(self, call: UnaryCall[T], timeout: float | None) -> T:
        method = getattr(self._stub, call.method)
        return await _AsyncResponses(
            lambda *args, **kw: _Once(method(*args, **kw)), self._core.unary(call, timeout)
        ).__anext__()

    async def close(self) -> None:
        """Close the channel (cancels calls in flight)."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
