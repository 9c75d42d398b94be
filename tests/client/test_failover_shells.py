"""The sync and asyncio shells carry out the core's failover over real channels.

Two in-process gRPC servers play schedulers whose streams break: each sends
a few responses of a request (token ``100 + i`` and letter ``i`` at output
index ``i``), then ends the call with UNAVAILABLE as a draining scheduler
does. The client must resume on the other address each time and hand the
application one contiguous stream; each server records the requests it got.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pagoda.v1 import generation_pb2, generation_pb2_grpc
from pagoda_client import AsyncClient, Client, GenerationDelta, PagodaError, TlsConfig
from scripts.make_certs import Issued, issue, make_ca

NUM_TOKENS = 10
SEED = 42


class BreakingScheduler(generation_pb2_grpc.GenerationServicer):
    """Streams a request from where it resumes, breaking after ``break_after`` responses of each call."""

    def __init__(self, break_after: int) -> None:
        self.break_after = break_after
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)
        start = len(request.resume.delivered_token_ids)
        for number, index in enumerate(range(start, NUM_TOKENS)):
            if number == self.break_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is draining; resume elsewhere")
            response = generation_pb2.GenerateResponse(
                request_id="req-7", text=string.ascii_letters[index], token_ids=[100 + index], output_index=index
            )
            if number == 0:
                response.seed = request.sampling.seed if request.sampling.HasField("seed") else SEED
                response.prompt_token_ids.extend([1, 2])
            if index == NUM_TOKENS - 1:
                response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            yield response


@pytest.fixture
def schedulers() -> Iterator[tuple[str, list[BreakingScheduler]]]:
    servers, servicers, addresses = [], [], []
    for break_after in (3, 3):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        servicer = BreakingScheduler(break_after)
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
        servicers.append(servicer)
    yield ",".join(addresses), servicers
    for server in servers:
        server.stop(grace=None)


def _check_one_stream(deltas: list[GenerationDelta], servicers: list[BreakingScheduler]) -> None:
    assert [t for d in deltas for t in d.token_ids] == [100 + i for i in range(NUM_TOKENS)]
    assert "".join(d.text for d in deltas) == string.ascii_letters[:NUM_TOKENS]
    assert [d.output_index for d in deltas] == list(range(NUM_TOKENS))
    assert [d.seed for d in deltas] == [SEED] + [None] * (NUM_TOKENS - 1)
    assert [bool(d.prompt_token_ids) for d in deltas] == [True] + [False] * (NUM_TOKENS - 1)
    first, second = servicers
    # a: 0-2, then b (up) at once: 3-5; then both have just failed, so whichever is back first: 6-8, then 9.
    requests = sorted(first.requests + second.requests, key=lambda r: len(r.resume.delivered_token_ids))
    assert [len(r.resume.delivered_token_ids) for r in requests] == [0, 3, 6, 9]
    assert requests[0] is first.requests[0] and requests[1] is second.requests[0]
    for resumed in requests[1:]:
        assert (resumed.request_id, resumed.resume.request_id, resumed.sampling.seed) == ("req-7", "req-7", SEED)
        assert list(resumed.resume.delivered_token_ids) == [
            100 + i for i in range(len(resumed.resume.delivered_token_ids))
        ]
        assert resumed.token_ids.token_ids == first.requests[0].token_ids.token_ids


def test_sync_stream_resumes_across_addresses(schedulers):
    target, servicers = schedulers
    with Client(target, timeout=30, retry_backoff_s=0.05) as client:
        deltas = list(client.stream(token_ids=[1, 2], max_tokens=NUM_TOKENS, temperature=0.8))
        assert client.targets.given == target.split(",")
    _check_one_stream(deltas, servicers)


def test_async_stream_resumes_across_addresses(schedulers):
    target, servicers = schedulers

    async def run() -> list[GenerationDelta]:
        async with AsyncClient(target.split(","), timeout=30, retry_backoff_s=0.05) as client:
            return [delta async for delta in client.stream(token_ids=[1, 2], max_tokens=NUM_TOKENS, temperature=0.8)]

    _check_one_stream(asyncio.run(run()), servicers)


def test_a_stream_that_breaks_more_often_than_allowed_fails(schedulers):
    target, _ = schedulers
    with Client(target, timeout=30, retry_backoff_s=0.05, max_resumes=2) as client:
        stream = client.stream(token_ids=[1, 2], max_tokens=NUM_TOKENS)
        with pytest.raises(PagodaError) as caught:
            list(stream)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in caught.value.message
    assert stream.result.token_ids == [100 + i for i in range(9)]


def _certificate_for(name: str) -> tuple[bytes, Issued]:
    """A fresh CA's certificate, and a server certificate it signed for the DNS name ``name`` only."""
    ca = make_ca("failover test CA")
    return ca.cert_pem, issue(ca, name, hosts=[name])


def test_a_name_resolved_to_several_addresses_keeps_tls_checking_that_name(tmp_path, monkeypatch):
    ca, leaf = _certificate_for("scheduler.test")
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(ca)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(BreakingScheduler(break_after=NUM_TOKENS), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(leaf.key_pem, leaf.cert_pem)]))
    server.start()
    # The name has two addresses; nothing listens on the first, so the call fails over to the second.
    lookups: list[tuple[str, int]] = []
    resolved = [f"127.0.0.2:{port}", f"127.0.0.1:{port}"]
    monkeypatch.setattr(
        "pagoda_client._base.resolve_addresses", lambda *host_port: lookups.append(host_port) or resolved
    )
    try:
        with Client(f"scheduler.test:{port}", tls=TlsConfig(str(ca_path)), timeout=30, retry_backoff_s=0.05) as client:
            assert [e.address for e in client.targets.endpoints] == resolved
            result = client.generate(token_ids=[1, 2], max_tokens=NUM_TOKENS)
    finally:
        server.stop(grace=None)
    assert lookups == [("scheduler.test", port)]
    assert result.token_ids == [100 + i for i in range(NUM_TOKENS)] and result.seed == SEED
