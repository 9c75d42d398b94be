"""Asyncio Pagoda client (``grpc.aio``): one channel, reused by every call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from pagoda.v1 import generation_pb2, generation_pb2_grpc
from pagoda_client import _wire
from pagoda_client._params import request_from_args
from pagoda_client._wire import Deadline, Message, RetryPolicy
from pagoda_client.client import DEFAULT_TARGET
from pagoda_client.errors import PagodaError
from pagoda_client.types import (
    GenerationDelta,
    GenerationResult,
    ModelInfo,
    ServerStatus,
    TlsConfig,
)


def _timeout(deadline: Deadline, request_id: str | None = None) -> float | None:
    left = deadline.remaining()
    if left is not None and left <= 0:
        raise PagodaError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", request_id)
    return left


async def _sleep_backoff(retry: RetryPolicy, attempt: int, deadline: Deadline) -> None:
    delay = retry.backoff_s(attempt)
    left = deadline.remaining()
    await asyncio.sleep(delay if left is None else max(0.0, min(delay, left)))


class AsyncGenerationStream(AsyncIterator[GenerationDelta]):
    """Deltas of one ``Generate`` call, as they arrive (``async for``).

    ``await stream.aclose()`` (or leaving ``async with``) cancels the RPC,
    which aborts the request on the server. UNAVAILABLE before the first
    response is retried with backoff.
    """

    def __init__(
        self,
        start_call: Callable[[float | None], Any],
        retry: RetryPolicy,
        deadline: Deadline,
        request_id: str | None,
    ) -> None:
        self._start_call = start_call
        self._retry = retry
        self._deadline = deadline
        self._call: Any = None
        self._num_received = 0
        self._num_retries = 0
        self._closed = False
        self.request_id = request_id

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._call is None:
                self._call = self._start_call(_timeout(self._deadline, self.request_id))
            try:
                response = await self._call.read()
            except grpc.RpcError as error:
                self._call = None
                await self._maybe_wait_retry(error)
                continue
            if response is grpc.aio.EOF:
                self._closed = True
                self._call = None
                raise StopAsyncIteration
            self._num_received += 1
            delta = _wire.delta_from_pb(response)
            self.request_id = delta.request_id or self.request_id
            return delta

    async def _maybe_wait_retry(self, error: grpc.RpcError) -> None:
        retryable = self._num_received == 0 and self._retry.should_retry(error.code(), self._num_retries)
        if not retryable:
            self._closed = True
            raise PagodaError.from_rpc_error(error, self.request_id) from None
        await _sleep_backoff(self._retry, self._num_retries, self._deadline)
        self._num_retries += 1

    async def aclose(self) -> None:
        """Cancel the RPC (idempotent)."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncClient:
    """Asyncio client of the Pagoda ``Generation`` API.

    Same arguments and methods as ``Client``; every call is a coroutine, and
    ``stream`` returns an ``AsyncGenerationStream``. Create it inside the
    event loop that uses it.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        tls: bool | TlsConfig = False,
        api_key: str | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        retry_max_backoff_s: float = 5.0,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._api_key = api_key
        self._retry = RetryPolicy(max_retries, retry_backoff_s, retry_max_backoff_s)
        credentials = _wire.channel_credentials(tls)
        channel_options = _wire.channel_options(tls, options)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=channel_options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        stop: Sequence[str] | str | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        priority: int = 0,
        cache_salt: str = "",
        request_id: str | None = None,
        skip_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = None,
    ) -> AsyncGenerationStream:
        """Start a generation; ``async for`` over the result (see ``Client.stream``).

        Raises:
            PagodaError: on any gRPC error (raised while iterating).
            ValueError: when not exactly one input is given.
        """
        request = request_from_args(dict(locals()))
        deadline = Deadline(timeout if timeout is not None else self.timeout)
        metadata = _wire.call_metadata(self._api_key, request_id)

        def start_call(call_timeout: float | None) -> Any:
            return self._stub.Generate(request, timeout=call_timeout, metadata=metadata)

        return AsyncGenerationStream(start_call, self._retry, deadline, request_id)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        stop: Sequence[str] | str | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        priority: int = 0,
        cache_salt: str = "",
        request_id: str | None = None,
        skip_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """Generate and return the whole result; arguments as in ``stream``.

        Raises:
            PagodaError: on any gRPC error.
            ValueError: when not exactly one input is given.
        """
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "prompt")}
        result = GenerationResult(request_id=request_id or "")
        async with self.stream(prompt, **kwargs) as deltas:
            async for delta in deltas:
                result.add(delta)
        return result

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        stop: Sequence[str] | str | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        priority: int = 0,
        cache_salt: str = "",
        request_id: str | None = None,
        skip_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        timeout: float | None = None,
    ) -> GenerationResult:
        """One assistant reply to ``messages`` (chat template applied by the server).

        Arguments as in ``stream``.
        """
        kwargs = {k: v for k, v in locals().items() if k != "self"}
        return await self.generate(**kwargs)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """What model the server serves, and its limits."""
        pb = await self._unary(self._stub.GetModelInfo, generation_pb2.GetModelInfoRequest(), timeout)
        return _wire.model_info_from_pb(pb)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Token ids of ``text`` (or of ``messages`` through the chat template)."""
        request = _wire.tokenize_request(text, messages, add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        """Text of ``token_ids``."""
        request = _wire.detokenize_request(token_ids, skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def status(self, *, timeout: float | None = None) -> ServerStatus:
        """Queues, KV usage and executors of the server."""
        pb = await self._unary(self._stub.GetStatus, generation_pb2.GetStatusRequest(), timeout)
        return _wire.status_from_pb(pb)

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        deadline = Deadline(timeout if timeout is not None else self.timeout)
        metadata = _wire.call_metadata(self._api_key)
        attempt = 0
        while True:
            try:
                return await method(request, timeout=_timeout(deadline), metadata=metadata)
            except grpc.RpcError as error:
                if not self._retry.should_retry(error.code(), attempt):
                    raise PagodaError.from_rpc_error(error) from None
            await _sleep_backoff(self._retry, attempt, deadline)
            attempt += 1

    async def close(self) -> None:
        """Close the channel (cancels calls in flight)."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
