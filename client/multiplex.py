"""Many ``Generate`` streams over one ``GenerateStreams`` call per endpoint (``AsyncClient(multiplex=True)``).

``StreamMux.open`` stands in for ``stub.Generate``: it returns an object read like a ``grpc.aio`` stream call
(``read()`` gives each ``GenerateResponse``, then ``grpc.aio.EOF``; a failure raises ``grpc.RpcError`` with the
stream's status), so the client's retry and resume logic (``pagoda_client.core``) drives a multiplexed stream
exactly as a call of its own. When the shared call breaks, every stream on it fails with the call's status
(UNAVAILABLE when the server went away) and resumes on its own, on a new call. Against a server without
``GenerateStreams`` each stream goes on as a ``Generate`` call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import grpc
import grpc.aio

from pagoda.tracing import TRACEPARENT_KEY
from pagoda.v1 import generation_pb2
from pagoda_client.core.requests import Metadata

logger = logging.getLogger(__name__)

# Metadata of a stream that travels in its StreamRequest: the call's metadata is the client's (the API key).
_STREAM_KEYS = ("x-request-id", TRACEPARENT_KEY)


class StreamError(grpc.RpcError):
    """A multiplexed stream's failure, read as a ``grpc.aio`` call's error: ``code()`` and ``details()``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


# What grpc.aio makes the status of a call whose write failed in its core (the connection went away under it).
_WRITE_FAILED = "Internal error from Core"


def _error_of(error: BaseException) -> StreamError:
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        code, details = error.code(), error.details() or ""
        if code is grpc.StatusCode.INTERNAL and details == _WRITE_FAILED:  # the transport broke: resume elsewhere
            return StreamError(grpc.StatusCode.UNAVAILABLE, f"the multiplexed call broke ({details})")
        return StreamError(code, details)
    return StreamError(grpc.StatusCode.UNAVAILABLE, f"the multiplexed call ended: {error!r}")


class MuxStream:
    """One stream of a ``StreamMux``: its responses as they arrive."""

    def __init__(self, mux: StreamMux, key: int, timeout: float | None, open_plain: Callable[[], Any]) -> None:
        """``open_plain``: the same request as a ``Generate`` call of its own (with what is left of the timeout),
        for a server without ``GenerateStreams``."""
        self._mux = mux
        self.key = key
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False
        self._open_plain = open_plain
        self._plain: Any = None  # the Generate call that replaced this stream
        # The deadline here too, as grpc enforces a call's on the client: a server that never answers fails the
        # stream in time (the server ends it with the same status on its side).
        self._timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, self._expire)

    async def read(self) -> Any:
        """The next ``GenerateResponse``, or ``grpc.aio.EOF`` after the last.

        Raises:
            grpc.RpcError: the stream ended with an error status, or its call broke.
        """
        if self._plain is None:
            item = await self._items.get()
            if isinstance(item, StreamError):
                raise item
            if item is not _PLAIN:
                return item
        return await cast(Any, self._plain).read()

    def cancel(self) -> None:
        """Stop the stream (the server aborts its request); idempotent."""
        if self._plain is not None:
            self._plain.cancel()
        elif not self._closed:
            self._close()
            self._mux.cancel(self.key)

    def _expire(self) -> None:
        if not self._closed:
            self.cancel()
            self._items.put_nowait(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()

    def _deliver(self, item: generation_pb2.StreamResponse) -> None:
        if item.HasField("response"):
            self._items.put_nowait(item.response)
            return
        self._close()
        code = _CODES.get(item.end.code, grpc.StatusCode.UNKNOWN)
        self._items.put_nowait(grpc.aio.EOF if code is grpc.StatusCode.OK else StreamError(code, item.end.message))

    def _fail(self, error: StreamError) -> None:
        if self._closed:
            return
        self._close()
        if error.code() is grpc.StatusCode.UNIMPLEMENTED:  # an older server: this stream goes on as a call
            self._plain = self._open_plain()
            self._items.put_nowait(_PLAIN)
        else:
            self._items.put_nowait(error)


_PLAIN = object()  # in a stream's queue: read on from its Generate call


class StreamMux:
    """One ``GenerateStreams`` call on a channel and the streams it carries.

    A server without ``GenerateStreams`` (UNIMPLEMENTED) sets ``unsupported``, and each stream goes on as a
    ``Generate`` call of its own: the client then calls ``Generate`` on that endpoint.

    Args:
        open_call: the stub's ``GenerateStreams`` multi-callable (``metadata=`` the call's).
        open_plain: the stub's ``Generate`` multi-callable.
        metadata: the call's metadata (the API key).
    """

    def __init__(self, open_call: Callable[..., Any], open_plain: Callable[..., Any], metadata: Metadata) -> None:
        self._call = open_call(metadata=metadata)
        self._open_plain = open_plain
        self.unsupported = False
        self._streams: dict[int, MuxStream] = {}
        self._next_key = 1
        self._outbox: asyncio.Queue[generation_pb2.StreamRequest | None] = asyncio.Queue()
        self.broken = False
        self._tasks = (asyncio.create_task(self._read()), asyncio.create_task(self._write()))

    def open(
        self, request: generation_pb2.GenerateRequest, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> MuxStream:
        """A stream of ``request``: ``stub.Generate``'s arguments, read as its call."""
        key, self._next_key = self._next_key, self._next_key + 1
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def open_plain() -> Any:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            return self._open_plain(request, timeout=left, metadata=metadata)

        stream = self._streams[key] = MuxStream(self, key, timeout, open_plain)
        given = dict(metadata)
        message = generation_pb2.StreamRequest(stream=key, generate=request, timeout_s=timeout or 0.0)
        message.traceparent = str(given.get(TRACEPARENT_KEY, ""))
        if not request.request_id and given.get("x-request-id"):
            message.generate.request_id = str(given["x-request-id"])
        if self.broken:
            stream._fail(StreamError(grpc.StatusCode.UNAVAILABLE, "the multiplexed call is closed"))
        else:
            self._outbox.put_nowait(message)
        return stream

    def cancel(self, key: int) -> None:
        """Cancel stream ``key`` (the server ends its request)."""
        if self._streams.pop(key, None) is not None and not self.broken:
            self._outbox.put_nowait(generation_pb2.StreamRequest(stream=key, cancel=True))

    def close(self) -> None:
        """Cancel the call and every stream on it."""
        self._break(StreamError(grpc.StatusCode.CANCELLED, "the client closed"))
        self._call.cancel()
        for task in self._tasks:
            task.cancel()

    async def _write(self) -> None:
        try:
            # Nothing is written before the server has answered the call: a write racing the end of a call that
            # the server refused (UNIMPLEMENTED, UNAUTHENTICATED) would turn its status into grpc's INTERNAL.
            await self._call.initial_metadata()
            while (message := await self._outbox.get()) is not None:
                await self._call.write(message)
        except (grpc.RpcError, asyncio.InvalidStateError) as error:  # the reader sees the call's end
            logger.debug("multiplexed call: write failed: %r", error)

    async def _read(self) -> None:
        error: BaseException
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    error = StreamError(grpc.StatusCode.UNAVAILABLE, "the server ended the multiplexed call")
                    break
                for item in message.responses:
                    stream = self._streams.get(item.stream)
                    if stream is None:
                        continue  # cancelled here, or a response that crossed the cancel
                    stream._deliver(item)
                    if not item.HasField("response"):
                        del self._streams[item.stream]
        except grpc.RpcError as exc:
            error = exc
        failure = _error_of(error)
        self.unsupported = failure.code() is grpc.StatusCode.UNIMPLEMENTED
        if self.unsupported:
            logger.info("the server has no GenerateStreams: each stream is a Generate call")
        self._break(failure)

    def _break(self, error: StreamError) -> None:
        if self.broken:
            return
        self.broken = True
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream._fail(error)
        self._outbox.put_nowait(None)
