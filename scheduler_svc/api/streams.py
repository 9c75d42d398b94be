"""Generate streams: one stream's outputs (``generate_outputs``, shared by ``Generate`` and
``GenerateStreams``), and ``StreamMux``, which serves many streams over one ``GenerateStreams`` call.

A client with many streams pays gRPC's per-message cost (its Cython core, a completion and a ``sendmsg`` per
message: ~40 µs of this process's CPU) once per step for all of them instead of once per stream: each step's
responses of every stream on the call leave in one ``StreamResponses``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import structlog

from pagoda.step import FinishReason
from pagoda.tracing import parse_traceparent
from pagoda.v1 import generation_pb2
from scheduler_svc.api import convert
from scheduler_svc.engine import Engine
from scheduler_svc.errors import (
    AlreadyExists,
    DeadlineExceeded,
    ExecutorFailure,
    InvalidRequest,
    NotFound,
    Overloaded,
    RequestError,
    Unavailable,
)
from scheduler_svc.request import RequestOutput

log = structlog.get_logger("scheduler")

STATUS_OF_ERROR = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    ExecutorFailure: grpc.StatusCode.INTERNAL,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
}


def status_of(exc: RequestError) -> grpc.StatusCode:
    """The gRPC status of an engine error."""
    return STATUS_OF_ERROR.get(type(exc), grpc.StatusCode.INTERNAL)


class StreamFailed(Exception):
    """A Generate stream ends with this status (the call is aborted with it, or its StreamEnd carries it)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def generate_outputs(
    engine: Engine,
    request: generation_pb2.GenerateRequest,
    request_id: str,
    timeout_s: float | None,
    traceparent: str | None,
) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of one Generate stream (each edge makes its own message of each: ``convert.fill_output_pb``).

    Raises:
        StreamFailed: the request was refused, failed in the executor, or must resume elsewhere.
    """
    try:
        gen_request = convert.request_from_pb(request, request_id, timeout_s)
        if traceparent:
            gen_request = dataclasses.replace(gen_request, traceparent=traceparent)
        # aclosing: a cancelled call must abort the request now, not when
        # the generator happens to be garbage-collected.
        async with contextlib.aclosing(engine.generate(gen_request)) as outputs:
            async for out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    raise StreamFailed(
                        grpc.StatusCode.INTERNAL, f"request {request_id} failed in the executor: {out.error}"
                    )
                if out.finish_reason is FinishReason.ABORT:  # no executor here, or draining: resume elsewhere
                    raise StreamFailed(grpc.StatusCode.UNAVAILABLE, f"request {request_id}: {out.error}")
                yield out
    except RequestError as exc:
        log.info("request_rejected", status=status_of(exc).name, error=str(exc))
        raise StreamFailed(status_of(exc), str(exc)) from None


# Bytes of a message kept for its framing; a response's field tag and length in it.
_MESSAGE_HEADROOM = 1024
_ITEM_FRAMING = 6


class StreamMux:
    """One ``GenerateStreams`` call: a task per open stream, and the responses waiting to leave.

    Each stream's task reads its request's outputs and appends each response to the call's outbox, then waits
    until the message that carries it has been written before it reads on: a stream has at most one response
    in flight, so a client that reads slowly gets its tokens merged into fewer responses by the engine (as a
    slow ``Generate`` stream does), and the outbox never grows past one response per stream. The call's
    generator (``run``) writes everything pending as one message whenever there is something.
    """

    def __init__(
        self, engine: Engine, requests: AsyncIterator[generation_pb2.StreamRequest], max_message_bytes: int
    ) -> None:
        """``max_message_bytes``: the server's largest message (``--max-message-bytes``): a message carries at
        most this much, and a single response larger than that ends its stream (RESOURCE_EXHAUSTED) instead of
        failing the call of every stream."""
        self._engine = engine
        self._requests = requests
        self._max_bytes = max_message_bytes - _MESSAGE_HEADROOM
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[generation_pb2.StreamResponse] = []
        self._wake = asyncio.Event()
        self._sent = asyncio.Event()  # set once the message of the pending responses has been written
        self._reading = True

    async def run(self) -> AsyncIterator[generation_pb2.StreamResponses]:
        """The call's messages, until the client stops sending and every stream has ended."""
        reader = asyncio.create_task(self._read())
        try:
            while self._outbox or self._reading or self._tasks:
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]  # a request that does not parse
                if not self._outbox:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch = self._take_batch()
                sent, self._sent = self._sent, asyncio.Event()
                yield generation_pb2.StreamResponses(responses=batch)
                sent.set()
            await asyncio.wait([reader])  # it has stopped reading: done, or about to be
            if not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

    def _take_batch(self) -> list[generation_pb2.StreamResponse]:
        """The pending responses that fit in one message, in order (the rest stay pending for the next)."""
        size = 0
        for i, item in enumerate(self._outbox):
            item_size = item.ByteSize() + _ITEM_FRAMING
            if item_size > self._max_bytes:  # alone it cannot leave: its stream ends here
                task = self._tasks.pop(item.stream, None)
                if task is not None:
                    task.cancel()
                what = f"a response of {item_size} bytes exceeds the server's message limit ({self._max_bytes})"
                end = generation_pb2.StreamEnd(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=what)
                self._outbox[i] = item = generation_pb2.StreamResponse(stream=item.stream, end=end)
                item_size = item.ByteSize() + _ITEM_FRAMING
            if size + item_size > self._max_bytes and i > 0:
                batch, self._outbox = self._outbox[:i], self._outbox[i:]
                return batch
            size += item_size
        batch, self._outbox = self._outbox, []
        return batch

    async def _read(self) -> None:
        try:
            async for message in self._requests:
                key = message.stream
                if message.cancel:
                    task = self._tasks.pop(key, None)
                    if task is not None:
                        task.cancel()
                elif not message.HasField("generate"):
                    self._end(key, grpc.StatusCode.INVALID_ARGUMENT, "a StreamRequest needs generate or cancel")
                elif key in self._tasks:  # a client's bug: that stream ends, and the new one does not start
                    self._tasks.pop(key).cancel()
                    self._end(key, grpc.StatusCode.INVALID_ARGUMENT, f"stream {key} is already open on this call")
                else:
                    self._tasks[key] = asyncio.create_task(self._serve(key, message))
        finally:
            self._reading = False
            self._wake.set()

    async def _serve(self, key: int, message: generation_pb2.StreamRequest) -> None:
        request = message.generate
        request_id = request.request_id or request.resume.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        timeout_s = message.timeout_s if message.timeout_s > 0 else None
        try:
            responses = generate_outputs(
                self._engine, request, request_id, timeout_s, parse_traceparent(message.traceparent) or None
            )
            async with contextlib.aclosing(responses):
                async for out in responses:
                    item = generation_pb2.StreamResponse(stream=key)
                    convert.fill_output_pb(item.response, out)  # in place: no copy of the response
                    self._push(item)
                    await self._sent.wait()
            self._end(key, grpc.StatusCode.OK, "")
        except StreamFailed as exc:
            self._end(key, exc.code, exc.message)
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
            self._wake.set()

    def _push(self, item: generation_pb2.StreamResponse) -> None:
        self._outbox.append(item)
        self._wake.set()

    def _end(self, key: int, code: grpc.StatusCode, message: str) -> None:
        end = generation_pb2.StreamEnd(code=code.value[0], message=message)
        self._push(generation_pb2.StreamResponse(stream=key, end=end))
