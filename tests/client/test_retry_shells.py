"""The sync and asyncio shells carry out the core's retry decisions (a port nobody listens on)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from pagoda.launch.launcher import free_port
from pagoda_client import AsyncClient, Client, PagodaError

RETRIES = {"max_retries": 2, "retry_backoff_s": 0.01, "retry_max_backoff_s": 0.02}


def _retry_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split(" in ")[0] for r in caplog.records if "retry" in r.getMessage()]


@pytest.fixture
def dead_target() -> str:
    return f"127.0.0.1:{free_port()}"


def test_sync_calls_and_streams_retry_unavailable_then_raise(dead_target, caplog):
    caplog.set_level(logging.INFO, logger="pagoda_client.core.calls")
    with Client(dead_target, timeout=10, **RETRIES) as client:
        for call in (client.model_info, lambda: list(client.stream("hi", request_id="r-3"))):
            caplog.clear()
            with pytest.raises(PagodaError) as caught:
                call()
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert _retry_lines(caplog) == ["UNAVAILABLE: retry 1 of 2", "UNAVAILABLE: retry 2 of 2"]
        assert caught.value.request_id == "r-3"


def test_async_calls_and_streams_retry_unavailable_then_raise(dead_target, caplog):
    caplog.set_level(logging.INFO, logger="pagoda_client.core.calls")

    async def run() -> list[tuple[grpc.StatusCode, list[str]]]:
        outcomes = []
        async with AsyncClient(dead_target, timeout=10, **RETRIES) as client:
            for call in (client.status, lambda: client.generate(token_ids=[1, 2])):
                caplog.clear()
                try:
                    await call()
                except PagodaError as error:
                    outcomes.append((error.code, _retry_lines(caplog)))
        return outcomes

    expected = (grpc.StatusCode.UNAVAILABLE, ["UNAVAILABLE: retry 1 of 2", "UNAVAILABLE: retry 2 of 2"])
    assert asyncio.run(run()) == [expected, expected]


def test_the_deadline_bounds_the_retries(dead_target):
    many = {"max_retries": 10_000, "retry_backoff_s": 0.05, "retry_max_backoff_s": 0.05}
    start = time.monotonic()
    with Client(dead_target, timeout=0.5, **many) as client, pytest.raises(PagodaError) as caught:
        client.tokenize("hi")
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5.0


def test_bad_options_fail_before_any_call(dead_target):
    with Client(dead_target, max_retries=0) as client:
        with pytest.raises(TypeError, match="unknown generation options: temprature"):
            client.generate("hi", temprature=0.5)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="unknown tokenize options: add_bos"):
            client.tokenize("hi", add_bos=True)  # type: ignore[call-arg]
        with pytest.raises(ValueError, match="exactly one of prompt, token_ids or messages"):
            client.generate("hi", token_ids=[1])
