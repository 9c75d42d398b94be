"""``AsyncClient(multiplex=True)``: many streams over one ``GenerateStreams`` call, against a real system.

Each stream must read exactly as the same request on a call of its own (tokens, text, logprobs, finish), and
one stream's end (a cancel, a refused request, a deadline) must change nothing for the others on the call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from support.pool import wait_pool_whole

from pagoda.v1 import generation_pb2, generation_pb2_grpc
from pagoda_client import AsyncClient, Client, FinishReason, PagodaError

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 42, 99, 100, 7, 250]


def _requests() -> list[dict[str, Any]]:
    """Greedy and seeded requests of several lengths, one with logprobs, one with a stop token."""
    requests: list[dict[str, Any]] = []
    for i in range(8):
        request: dict[str, Any] = {"token_ids": [*PROMPT, 30 + i], "max_tokens": 6 + 3 * i, "ignore_eos": True}
        request.update({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i})
        requests.append(request)
    requests[2]["logprobs"] = 3
    return requests


async def _run_all(client: AsyncClient, requests: list[dict[str, Any]]) -> list[tuple]:
    async def one(request: dict[str, Any]) -> tuple:
        deltas = []
        async with client.stream(**request) as stream:
            async for delta in stream:
                deltas.append(delta)
        result = stream.result
        logprobs = [(e.sampled.token_id, round(e.sampled.logprob, 4)) for d in deltas for e in d.logprobs]
        streamed = ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas))
        return result.token_ids, result.text, result.finish_reason, logprobs, streamed

    return list(await asyncio.gather(*(one(request) for request in requests)))


def test_multiplexed_streams_read_as_calls_of_their_own(client_tiny_system):
    requests = _requests()

    async def run(multiplex: bool) -> list[tuple]:
        async with AsyncClient(client_tiny_system.target, timeout=120, multiplex=multiplex) as client:
            return await _run_all(client, requests)

    alone, multiplexed = asyncio.run(run(False)), asyncio.run(run(True))
    assert multiplexed == alone
    for (token_ids, text, finish, _, streamed), request in zip(multiplexed, requests):
        assert len(token_ids) == request["max_tokens"] and finish is FinishReason.LENGTH
        assert streamed == (token_ids, text)
    assert multiplexed[2][3], "the logprobs were lost"


def test_one_stream_ending_leaves_the_others_whole(client_tiny_system):
    """A cancelled stream, a refused request and a deadline, among streams that run to the end on one call."""
    requests = _requests()[:4]

    async def run() -> tuple[list[tuple], int, grpc.StatusCode, str, grpc.StatusCode]:
        async with AsyncClient(client_tiny_system.target, timeout=120, multiplex=True) as client:
            others = asyncio.ensure_future(_run_all(client, requests))
            cancelled = client.stream(token_ids=PROMPT, max_tokens=900, ignore_eos=True)
            received = 0
            async with cancelled:
                async for delta in cancelled:
                    received += len(delta.token_ids)
                    if received >= 2:
                        break
            try:
                await client.generate(token_ids=PROMPT, max_tokens=0, request_id="bad-1")
                refused, message = grpc.StatusCode.OK, ""
            except PagodaError as error:
                refused, message = error.code, f"{error.request_id}: {error.message}"
            try:
                await client.generate(token_ids=PROMPT, max_tokens=900, ignore_eos=True, timeout=0.3)
                late = grpc.StatusCode.OK
            except PagodaError as error:
                late = error.code
            return await others, received, refused, message, late

    with Client(client_tiny_system.target, timeout=120) as sync_client:

        async def alone() -> list[tuple]:
            async with AsyncClient(client_tiny_system.target, timeout=120) as client:
                return await _run_all(client, requests)

        expected = asyncio.run(alone())
        others, received, refused, message, late = asyncio.run(run())
        assert others == expected
        assert 2 <= received < 900
        assert refused == grpc.StatusCode.INVALID_ARGUMENT and "bad-1" in message and "max_tokens" in message
        assert late == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_pool_whole(sync_client, nothing_waiting=True)  # the cancelled and late requests were aborted
    assert "Traceback" not in client_tiny_system.logs()["scheduler"]


def test_closing_the_client_cancels_every_stream_on_the_call(client_tiny_system):
    async def run() -> int:
        client = AsyncClient(client_tiny_system.target, timeout=120, multiplex=True)
        streams = [client.stream(token_ids=[*PROMPT, i], max_tokens=900, ignore_eos=True) for i in range(3)]
        firsts = [await stream.__anext__() for stream in streams]
        await client.close()
        return sum(len(delta.token_ids) for delta in firsts)

    assert asyncio.run(run()) >= 3
    with Client(client_tiny_system.target, timeout=60) as client:
        wait_pool_whole(client, nothing_waiting=True)


def _raw_call(target: str, messages: list[bytes]) -> tuple[grpc.StatusCode, list[generation_pb2.StreamResponse]]:
    """One GenerateStreams call sending ``messages`` as they are (raw bytes); its status and every item."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/pagoda.v1.Generation/GenerateStreams",
            request_serializer=None,
            response_deserializer=generation_pb2.StreamResponses.FromString,
        )
        items: list[generation_pb2.StreamResponse] = []
        try:
            for message in call(iter(messages), timeout=60):
                items.extend(message.responses)
        except grpc.RpcError as error:
            return error.code(), items
        return grpc.StatusCode.OK, items


def _open(key: int, max_tokens: int = 4) -> bytes:
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIdsInput(token_ids=PROMPT))
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    request.sampling.temperature = 0.0
    return generation_pb2.StreamRequest(stream=key, generate=request).SerializeToString()


def test_malformed_and_conflicting_stream_requests(client_tiny_system):
    target = client_tiny_system.target
    # A message that does not parse (invalid UTF-8 in request_id) ends the call with INVALID_ARGUMENT.
    bad_utf8 = b"\x0a\x02\xc3\x28"  # GenerateRequest.request_id = b"\xc3\x28"
    garbage = b"\x08\x01\x12" + bytes([len(bad_utf8)]) + bad_utf8
    code, _ = _raw_call(target, [garbage])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # A second stream under a key in use ends that stream with INVALID_ARGUMENT; the others run to the end.
    neither = generation_pb2.StreamRequest(stream=3).SerializeToString()
    code, items = _raw_call(target, [_open(1, 600), _open(1), _open(2), neither])
    assert code == grpc.StatusCode.OK
    ends = {item.stream: item.end for item in items if item.HasField("end")}
    assert ends[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already open" in ends[1].message
    assert ends[2].code == 0 and ends[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert sum(len(i.response.token_ids) for i in items if i.stream == 2 and i.HasField("response")) == 4
    with Client(target, timeout=60) as client:
        wait_pool_whole(client, nothing_waiting=True)
        assert len(client.generate(token_ids=PROMPT, max_tokens=3).token_ids) == 3
    assert client_tiny_system.dead_child() is None


def test_generate_streams_through_the_generated_stub(client_tiny_system):
    """What the API offers any gRPC client: two streams, each read to its OK end, one message for many items."""
    with grpc.insecure_channel(client_tiny_system.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        messages = [generation_pb2.StreamRequest.FromString(_open(key, 8)) for key in (7, 8)]
        items = [item for message in stub.GenerateStreams(iter(messages), timeout=60) for item in message.responses]
    for key in (7, 8):
        mine = [item for item in items if item.stream == key]
        assert mine[-1].HasField("end") and mine[-1].end.code == 0
        assert sum(len(item.response.token_ids) for item in mine[:-1]) == 8
        assert mine[-2].response.finish_reason == generation_pb2.FINISH_REASON_LENGTH
