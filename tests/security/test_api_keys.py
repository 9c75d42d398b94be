"""API keys on the client API: `authorization: Bearer <key>`, with real processes."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pagoda.v1 import generation_pb2, generation_pb2_grpc
from pagoda_client import AsyncClient, Client, PagodaError
from scheduler_svc.api.auth import bearer_token, key_is_valid, load_api_keys
from security.system import SecureSystem, is_serving

pytestmark = pytest.mark.integration
FLAG_KEY, FILE_KEY = "flag-key-0123456789", "file-key-abcdefghij"
SECRET = "TOP-SECRET-PROMPT-7f3a"  # must never reach the log of a refused call


@pytest.fixture(scope="module")
def keyed_system(security_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    (folder / "keys.txt").write_text(f"# operators\n\n{FILE_KEY}\n")
    args = ["--api-keys", f"{FLAG_KEY}, other-key", "--api-keys-file", str(folder / "keys.txt")]
    with SecureSystem(security_model_dir, folder / "logs", scheduler_args=args, api_key=FLAG_KEY) as system:
        yield system


def _refused_calls(target: str, metadata) -> list[grpc.StatusCode]:
    """Generate, Tokenize, GetStatus and GenerateStreams with the given metadata; their status codes."""
    request = generation_pb2.GenerateRequest(request_id=f"{SECRET}-id", text=f"{SECRET} text", cache_salt=SECRET)
    streamed = generation_pb2.StreamRequest(stream=1, generate=request)
    codes = []
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [
            lambda: list(stub.Generate(request, metadata=metadata, timeout=10)),
            lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text=SECRET), metadata=metadata, timeout=10),
            lambda: stub.GetStatus(generation_pb2.GetStatusRequest(), metadata=metadata, timeout=10),
            lambda: list(stub.GenerateStreams(iter([streamed]), metadata=metadata, timeout=10)),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            codes.append(info.value.code())
    return codes


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        [("authorization", "Bearer wrong-key")],
        [("authorization", f"Bearer {FLAG_KEY}x")],
        [("authorization", f"Bearer {FLAG_KEY[:-1]}")],
        [("authorization", f"Basic {FLAG_KEY}")],
        [("authorization", FLAG_KEY)],
        [("authorization", "Bearer ")],
        [("authorization", "Bearer # operators")],
        [("x-api-key", FLAG_KEY)],
    ],
    ids=["missing", "wrong", "longer", "shorter", "basic-scheme", "no-scheme", "empty", "comment-line", "other-header"],
)
def test_missing_or_wrong_key_is_unauthenticated(keyed_system, metadata):
    assert _refused_calls(keyed_system.target, metadata) == [grpc.StatusCode.UNAUTHENTICATED] * 4


@pytest.mark.parametrize("key", [FLAG_KEY, "other-key", FILE_KEY])
def test_right_key_is_served(keyed_system, key):
    with Client(keyed_system.target, api_key=key, timeout=60) as client:
        result = client.generate(token_ids=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)
        assert len(result.token_ids) == 3 and result.finish_reason == "length"
        assert client.detokenize(client.tokenize("brown fox", add_special_tokens=False)) == "brown fox"
        assert client.status().executors[0].state == "READY"


def test_multiplexed_client_with_and_without_key(keyed_system):
    async def run(key: str | None) -> list[int] | grpc.StatusCode:
        async with AsyncClient(keyed_system.target, api_key=key, timeout=60, max_retries=0, multiplex=True) as client:
            try:
                result = await client.generate(token_ids=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)
            except PagodaError as error:
                return error.code
            return result.token_ids

    with Client(keyed_system.target, api_key=FLAG_KEY, timeout=60) as client:
        expected = client.generate(token_ids=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True).token_ids
    assert asyncio.run(run(FLAG_KEY)) == expected
    assert asyncio.run(run(None)) == asyncio.run(run("wrong-key")) == grpc.StatusCode.UNAUTHENTICATED


def test_client_without_key_gets_unauthenticated(keyed_system):
    with Client(keyed_system.target, timeout=10, max_retries=0) as client, pytest.raises(PagodaError) as info:
        client.generate("hello", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_without_a_key(keyed_system):
    assert is_serving(keyed_system.target, None)


def test_refusal_logs_only_the_method(keyed_system):
    _refused_calls(keyed_system.target, [("authorization", f"Bearer {SECRET}"), ("x-request-id", SECRET)])
    _refused_calls(keyed_system.target, None)
    text = keyed_system.scheduler.log_text()
    assert SECRET not in text
    refusals = [json.loads(line) for line in text.splitlines() if "unauthenticated_call" in line]
    assert len(refusals) >= 8
    for entry in refusals:
        assert set(entry) == {"event", "method", "level", "timestamp"}, entry
        assert entry["method"] in (
            "/pagoda.v1.Generation/Generate",
            "/pagoda.v1.Generation/Tokenize",
            "/pagoda.v1.Generation/GetStatus",
            "/pagoda.v1.Generation/GenerateStreams",
        )


def test_key_helpers():
    assert load_api_keys(" a, ,b ", "") == (b"a", b"b")
    assert bearer_token("bearer  tok ") == "tok" and bearer_token("Bearer") is None and bearer_token(None) is None
    assert key_is_valid("b", (b"a", b"b")) and not key_is_valid("", (b"a",)) and not key_is_valid(None, (b"a",))
