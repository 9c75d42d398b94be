"""The multiplexed ``AsyncClient`` against in-process servers that misbehave or are older.

- A server without ``GenerateStreams`` (UNIMPLEMENTED): every stream goes on as a ``Generate`` call, and the
  client calls ``Generate`` on that endpoint from then on.
- A server that takes a stream and never answers: the stream's deadline fails it on the client, in time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pagoda.v1 import generation_pb2, generation_pb2_grpc
from pagoda_client import AsyncClient, PagodaError


class OlderScheduler(generation_pb2_grpc.GenerationServicer):
    """Generate only (GenerateStreams is UNIMPLEMENTED, as on a server from before it): ``max_tokens`` tokens."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request, context) -> Iterator[generation_pb2.GenerateResponse]:  # noqa: N802
        self.requests.append(request)
        for index in range(request.stopping.max_tokens):
            response = generation_pb2.GenerateResponse(
                request_id=request.request_id or "r", token_ids=[100 + index], text="x", output_index=index
            )
            if index == request.stopping.max_tokens - 1:
                response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            yield response


class SilentScheduler(generation_pb2_grpc.GenerationServicer):
    """Takes GenerateStreams calls and never answers their streams."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def GenerateStreams(self, request_iterator, context):  # noqa: N802
        context.send_initial_metadata(())  # as the scheduler does: the client writes once the call is answered
        next(request_iterator)
        self.opened.set()
        while context.is_active():
            time.sleep(0.05)
        return iter(())


def _serve(servicer: generation_pb2_grpc.GenerationServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


def test_a_server_without_generate_streams_gets_generate_calls():
    servicer = OlderScheduler()
    server, address = _serve(servicer)

    async def run() -> list[list[int]]:
        async with AsyncClient(address, timeout=30) as client:
            first = await asyncio.gather(*(client.generate(token_ids=[1, i], max_tokens=3 + i) for i in range(3)))
            later = await client.generate(token_ids=[9], max_tokens=5)  # straight to Generate now
            return [result.token_ids for result in [*first, later]]

    try:
        got = asyncio.run(run())
    finally:
        server.stop(grace=None)
    assert got == [[100 + j for j in range(n)] for n in (3, 4, 5, 5)]
    assert len(servicer.requests) == 4


def test_a_stream_on_a_silent_server_fails_at_its_deadline():
    servicer = SilentScheduler()
    server, address = _serve(servicer)

    async def run() -> tuple[grpc.StatusCode, float]:
        async with AsyncClient(address, max_retries=0) as client:
            start = time.monotonic()
            with pytest.raises(PagodaError) as caught:
                await client.generate(token_ids=[1, 2], max_tokens=4, timeout=0.5)
            return caught.value.code, time.monotonic() - start

    try:
        code, took_s = asyncio.run(run())
    finally:
        server.stop(grace=None)
    assert servicer.opened.is_set()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.4 < took_s < 5.0
