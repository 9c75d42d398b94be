"""Synchronous Pagoda client: the I/O shell (sync gRPC) around ``pagoda_client.core``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from pagoda.channel import ChannelOption, Tls, open_channel
from pagoda_client._base import DEFAULT_TARGET, BaseClient, CallDriver, StreamDriver
from pagoda_client.core import calls
from pagoda_client.core.calls import UnaryCall
from pagoda_client.options import Message
from pagoda_client.results import GenerationDelta, GenerationResult, LoraAdapter, ModelInfo, ServerStatus

if TYPE_CHECKING:
    from typing import Unpack

    from pagoda_client.options import GenerateOptions, RequestOptions, TokenizeOptions

__all__ = ["DEFAULT_TARGET", "Client", "GenerationStream"]

T = TypeVar("T")


class _Responses(CallDriver[T]):
    """Drives a ``CallState`` with sync gRPC: reads responses, sleeps the backoff it decides."""

    def __next__(self) -> T:
        while not self._state.done:
            try:
                response = next(self._attempt())
            except StopIteration:
                self._state.on_end()
            except grpc.RpcError as error:
                self._call = None
                time.sleep(self._state.backoff_s(error))
            else:
                return self._deliver(response)
        raise StopIteration


class GenerationStream(StreamDriver, _Responses[GenerationDelta], Iterator[GenerationDelta]):
    """Deltas of one ``Generate`` call, as they arrive.

    Iterate it; ``close()`` (or leaving a ``with`` block, or breaking out and
    dropping it) cancels the RPC, which aborts the request on the server.
    UNAVAILABLE before the first response is retried with backoff; after one,
    the stream is resumed (on another address when there is one) and reads on
    as one stream. ``result`` holds every delta received so far, folded.
    """

    def __iter__(self) -> GenerationStream:
        return self

    def close(self) -> None:
        """Cancel the RPC (idempotent)."""
        self._cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._cancel()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            self._call.cancel()


def _as_stream(method: Callable[..., Any]) -> Callable[..., Iterator[Any]]:
    """A unary multi-callable read like a stream: its response, then the end."""
    return lambda *args, **kw: iter((method(*args, **kw),))


class Client(BaseClient[grpc.Channel]):
    """Synchronous client of the Pagoda ``Generation`` API (arguments: ``BaseClient``).

    Example:
        >>> with Client("127.0.0.1:50051") as client:
        ...     print(client.generate("The capital of France is", max_tokens=8).text)
    """

    def _open_channel(self, target: str, tls: Tls, options: Sequence[ChannelOption]) -> grpc.Channel:
        return open_channel(target, tls, options)

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> GenerationStream:
        """Start a generation and return its deltas as they arrive.

        Give exactly one of ``prompt`` (text), ``token_ids`` or ``messages``
        (chat messages, ``{"role": ..., "content": ...}``; the server applies
        the model's chat template). The options (``GenerateOptions``) are the
        sampling and stopping parameters of ``pagoda.params`` (``max_tokens``,
        ``temperature``, ``seed``, ``logprobs``, ``stop``, ``ignore_eos``, ...)
        and the call's own (``priority``, ``cache_salt``, ``lora``, ``request_id``,
        ``skip_special_tokens``, ``add_generation_prompt``, ``timeout``); one
        left out takes the server's default (temperature 0 is greedy).

        Raises:
            PagodaError: on any gRPC error (raised while iterating).
            TypeError: an unknown option (named) or a value of the wrong type.
            ValueError: when not exactly one input is given.
        """
        return GenerationStream(self._method("Generate"), self._core.generate(prompt, options))

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> GenerationResult:
        """Generate and return the whole result; arguments as in ``stream``."""
        with self.stream(prompt, **options) as deltas:
            for _ in deltas:
                pass
        return deltas.result

    def chat(self, messages: Sequence[Message], **options: Unpack[RequestOptions]) -> GenerationResult:
        """One assistant reply to ``messages`` (chat template applied by the server); options as in ``stream``."""
        return self.generate(messages=messages, **options)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """What model the server serves, and its limits."""
        return self._unary(calls.model_info_call(), timeout)

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> LoraAdapter:
        """Register the LoRA adapter in the PEFT folder ``path`` (on the executors' file system) as ``name`` on
        every executor; requests name it with ``lora=name``. Needs an API key where the server has keys.

        Raises:
            PagodaError: INVALID_ARGUMENT (it does not fit the model: the message says why), NOT_FOUND (no such
                folder), ALREADY_EXISTS (the name holds another adapter), UNAVAILABLE (no executor).
        """
        return self._unary(calls.load_lora_call(name, path), timeout)

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unregister the adapter ``name``: new requests naming it fail with NOT_FOUND, running ones finish.

        Raises:
            PagodaError: NOT_FOUND (no such adapter).
        """
        self._unary(calls.unload_lora_call(name), timeout)

    def tokenize(self, text: str | None = None, **options: Unpack[TokenizeOptions]) -> list[int]:
        """Token ids of ``text`` (or of ``messages=`` through the chat template); see ``TokenizeOptions``."""
        return self._unary(calls.tokenize_call(text, options), options.get("timeout"))

    def detokenize(
        self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None, timeout: float | None = None
    ) -> str:
        """Text of ``token_ids``."""
        return self._unary(calls.detokenize_call(token_ids, skip_special_tokens), timeout)

    def status(self, *, timeout: float | None = None) -> ServerStatus:
        """Queues, KV usage and executors of the server."""
        return self._unary(calls.status_call(), timeout)

    def _unary(self, call: UnaryCall[T], timeout: float | None) -> T:
        method = self._method(call.method)
        return next(_Responses(lambda endpoint: _as_stream(method(endpoint)), self._core.unary(call, timeout)))

    def close(self) -> None:
        """Close the channels (cancels calls in flight)."""
        for channel in self._take_channels():
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
