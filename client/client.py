"""Synchronous Pagoda client: one gRPC channel, reused by every call."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from pagoda.v1 import generation_pb2, generation_pb2_grpc
from pagoda_client import _wire
from pagoda_client._params import request_from_args
from pagoda_client._wire import Deadline, Message, RetryPolicy
from pagoda_client.errors import PagodaError
from pagoda_client.types import (
    GenerationDelta,
    GenerationResult,
    ModelInfo,
    ServerStatus,
    TlsConfig,
)

T = TypeVar("T")
DEFAULT_TARGET = "127.0.0.1:50051"


class GenerationStream(Iterator[GenerationDelta]):
    """Deltas of one ``Generate`` call, as they arrive.

    Iterate it; ``close()`` (or leaving a ``with`` block, or breaking out and
    dropping it) cancels the RPC, which aborts the request on the server.
    UNAVAILABLE before the first response is retried with backoff.
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

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationDelta:
        while True:
            if self._closed:
                raise StopIteration
            if self._call is None:
                self._call = self._start_call(_timeout(self._deadline, self.request_id))
            try:
                response = next(self._call)
            except StopIteration:
                self._closed = True
                raise
            except grpc.RpcError as error:
                self._call = None
                self._maybe_wait_retry(error)
                continue
            self._num_received += 1
            delta = _wire.delta_from_pb(response)
            self.request_id = delta.request_id or self.request_id
            return delta

    def _maybe_wait_retry(self, error: grpc.RpcError) -> None:
        """Sleep before a retry, or raise the error as a ``PagodaError``."""
        retryable = self._num_received == 0 and self._retry.should_retry(error.code(), self._num_retries)
        if not retryable:
            self._closed = True
            raise PagodaError.from_rpc_error(error, self.request_id) from None
        _sleep_backoff(self._retry, self._num_retries, self._deadline)
        self._num_retries += 1

    def close(self) -> None:
        """Cancel the RPC (idempotent)."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            self._call.cancel()


def _timeout(deadline: Deadline, request_id: str | None = None) -> float | None:
    """The per-attempt timeout; raises DEADLINE_EXCEEDED when none is left."""
    left = deadline.remaining()
    if left is not None and left <= 0:
        raise PagodaError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", request_id)
    return left


def _sleep_backoff(retry: RetryPolicy, attempt: int, deadline: Deadline) -> None:
    delay = retry.backoff_s(attempt)
    left = deadline.remaining()
    time.sleep(delay if left is None else max(0.0, min(delay, left)))


class Client:
    """Synchronous client of the Pagoda ``Generation`` API.

    Example:
        >>> with Client("127.0.0.1:50051") as client:
        ...     print(client.generate("The capital of France is", max_tokens=8).text)

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
            self._channel = grpc.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=channel_options)
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
    ) -> GenerationStream:
        """Start a generation and return its deltas as they arrive.

        Give exactly one of ``prompt`` (text), ``token_ids`` or ``messages``
        (chat messages, ``{"role": ..., "content": ...}``; the server applies
        the model's chat template). Sampling parameters left None take the
        server's defaults (temperature 0 is greedy); ``logprobs=n`` returns
        the sampled token's logprob and the top n. ``stop`` strings and
        ``stop_token_ids`` end the generation; ``ignore_eos`` generates past
        EOS. ``priority``: lower is served first. ``cache_salt`` isolates the
        prefix cache. ``request_id`` is also sent as ``x-request-id``.
        ``timeout`` (seconds) overrides the client's default deadline.

        Raises:
            PagodaError: on any gRPC error (raised while iterating).
            ValueError: when not exactly one input is given.
        """
        args = dict(locals())
        request = request_from_args(args)
        deadline = Deadline(timeout if timeout is not None else self.timeout)
        metadata = _wire.call_metadata(self._api_key, request_id)

        def start_call(call_timeout: float | None) -> Any:
            return self._stub.Generate(request, timeout=call_timeout, metadata=metadata)

        return GenerationStream(start_call, self._retry, deadline, request_id)

    def generate(
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
        with self.stream(prompt, **kwargs) as deltas:
            for delta in deltas:
                result.add(delta)
        return result

    def chat(
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
        return self.generate(**kwargs)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """What model the server serves, and its limits."""
        pb = self._unary(self._stub.GetModelInfo, generation_pb2.GetModelInfoRequest(), timeout)
        return _wire.model_info_from_pb(pb)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Token ids of ``text`` (or of ``messages`` through the chat template)."""
        request = _wire.tokenize_request(text, messages, add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        """Text of ``token_ids``."""
        request = _wire.detokenize_request(token_ids, skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout).text

    def status(self, *, timeout: float | None = None) -> ServerStatus:
        """Queues, KV usage and executors of the server."""
        pb = self._unary(self._stub.GetStatus, generation_pb2.GetStatusRequest(), timeout)
        return _wire.status_from_pb(pb)

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        deadline = Deadline(timeout if timeout is not None else self.timeout)
        metadata = _wire.call_metadata(self._api_key)
        attempt = 0
        while True:
            try:
                return method(request, timeout=_timeout(deadline), metadata=metadata)
            except grpc.RpcError as error:
                if not self._retry.should_retry(error.code(), attempt):
                    raise PagodaError.from_rpc_error(error) from None
            _sleep_backoff(self._retry, attempt, deadline)
            attempt += 1

    def close(self) -> None:
        """Close the channel (cancels calls in flight)."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
