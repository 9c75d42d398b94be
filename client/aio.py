"""Asyncio Pagoda client: the I/O shell (``grpc.aio``) around ``pagoda_client.core``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

from pagoda.channel import ChannelOption, Tls, open_aio_channel
from pagoda_client._base import BaseClient, CallDriver, StreamDriver
from pagoda_client.core import calls
from pagoda_client.core.calls import UnaryCall
from pagoda_client.core.requests import call_metadata
from pagoda_client.core.targets import Endpoint
from pagoda_client.multiplex import StreamMux
from pagoda_client.options import Message
from pagoda_client.results import GenerationDelta, GenerationResult, LoraAdapter, ModelInfo, ServerStatus

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


class _AsyncResponses(CallDriver[T]):
    """Drives a ``CallState`` with ``grpc.aio``: reads responses, sleeps the backoff it decides."""

    async def __anext__(self) -> T:
        while not self._state.done:
            try:
                response = await self._attempt().read()
            except grpc.RpcError as error:
                self._call = None
                await asyncio.sleep(self._state.backoff_s(error))
            else:
                if response is not grpc.aio.EOF:
                    return self._deliver(response)
                self._call = None
                self._state.on_end()
        raise StopAsyncIteration


class AsyncGenerationStream(StreamDriver, _AsyncResponses[GenerationDelta], AsyncIterator[GenerationDelta]):
    """Deltas of one ``Generate`` call, as they arrive (``async for``).

    ``await stream.aclose()`` (or leaving ``async with``) cancels the RPC,
    which aborts the request on the server. UNAVAILABLE before the first
    response is retried with backoff; after one, the stream is resumed (on
    another address when there is one) and reads on as one stream. ``result``
    holds every delta received so far, folded.
    """

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def aclose(self) -> None:
        """Cancel the RPC (idempotent)."""
        self._cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._cancel()


class AsyncClient(BaseClient[grpc.aio.Channel]):
    """Asyncio client of the Pagoda ``Generation`` API.

    Same arguments (``BaseClient``) and methods as ``Client``; every call is a
    coroutine, and ``stream`` returns an ``AsyncGenerationStream``. Create it
    inside the event loop that uses it.
    """

    def __init__(self, *args: Any, multiplex: bool = True, **kwargs: Any) -> None:
        """``multiplex``: carry every stream to an endpoint over one ``GenerateStreams`` call
        (``pagoda_client.multiplex``): one message per server step for all of them, instead of one per stream,
        for clients that hold many streams at once. Needs a server with ``GenerateStreams``."""
        super().__init__(*args, **kwargs)
        self._multiplex = multiplex
        self._muxes: dict[str, StreamMux] = {}

    def _open_channel(self, target: str, tls: Tls, options: Sequence[ChannelOption]) -> grpc.aio.Channel:
        return open_aio_channel(target, tls, options)

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> AsyncGenerationStream:
        """Start a generation; ``async for`` over the result (arguments and errors: ``Client.stream``)."""
        method = self._mux_open if self._multiplex else self._method("Generate")
        return AsyncGenerationStream(method, self._core.generate(prompt, options))

    def _mux_open(self, endpoint: Endpoint) -> Callable[..., Any]:
        """``StreamMux.open`` of ``endpoint``'s multiplexed call (a new call when there is none or it broke)."""
        mux = self._muxes.get(endpoint.address)
        if mux is not None and mux.unsupported:
            return self._method("Generate")(endpoint)
        if mux is None or mux.broken:
            open_call, open_plain = self._method("GenerateStreams")(endpoint), self._method("Generate")(endpoint)
            mux = self._muxes[endpoint.address] = StreamMux(open_call, open_plain, call_metadata(self._core.api_key))
        return mux.open

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

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> LoraAdapter:
        """Register a LoRA adapter on every executor (arguments and errors: ``Client.load_lora_adapter``)."""
        return await self._unary(calls.load_lora_call(name, path), timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unregister a LoRA adapter (errors: ``Client.unload_lora_adapter``)."""
        await self._unary(calls.unload_lora_call(name), timeout)

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
        method = self._method(call.method)
        return await _AsyncResponses(
            lambda endpoint: lambda *args, **kw: _Once(method(endpoint)(*args, **kw)), self._core.unary(call, timeout)
        ).__anext__()

    async def close(self) -> None:
        """Close the channels (cancels calls in flight)."""
        muxes, self._muxes = list(self._muxes.values()), {}
        for mux in muxes:
            mux.close()
        await asyncio.gather(*(channel.close() for channel in self._take_channels()))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
