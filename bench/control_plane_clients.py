"""The kinds of client the control-plane load streams through: one class each, behind `LoadClient`.

- `stub`: `Generate` through the generated gRPC stub, a call per stream: the lightest client process (the
  benchmark's default);
- `library`: the project's asyncio client (`pagoda_client.AsyncClient`), what an application would use: every
  stream of the load process over one `GenerateStreams` call (a `Generate` call each against a scheduler from
  before it);
- `library-per-call`: the same with `multiplex=False`: a `Generate` call per stream;
- `sse`: OpenAI-compatible streaming over the scheduler's HTTP API (`--http-port`), read by
  `control_plane_sse` on raw asyncio streams.

Each sends a token-id prompt with greedy sampling, `max_tokens` and `ignore_eos`, and calls
`received(previous_s, num_tokens)` for every response that carries tokens; it returns that
response's arrival time, which the client passes back as `previous_s` for the request's next one
(None for its first).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc
from control_plane_sse import HttpConnection, HttpError

from pagoda.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from pagoda_client import AsyncClient, PagodaError

# (arrival of the request's previous token-carrying response, or None; tokens in this one) -> its arrival.
Received = Callable[[float | None, int], float]
# One token of the simulated executor's word-level tokenizer in its decoded text: a word (words are
# joined by spaces) or one punctuation character (executor_svc/simulate/tokenizer.py).
SIMULATED_TOKEN = re.compile(r"\w+|[^\w\s]")


class RequestFailed(Exception):
    """A request that ended in an error; `status` is what the load's report counts it under."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


class LoadClient(Protocol):
    """A client of one scheduler, shared by all of a load's streams; created inside the event loop."""

    async def generate(self, prompt_ids: Sequence[int], received: Received) -> None:
        """Run one request to its end (raises RequestFailed)."""

    async def close(self) -> None:
        """Close its connections."""


class StubClient:
    """`Generate` through the generated stub on one channel."""

    def __init__(self, target: str, max_tokens: int, timeout_s: float) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.stopping = generation_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True)
        self.timeout_s = timeout_s

    async def generate(self, prompt_ids: Sequence[int], received: Received) -> None:
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIdsInput(token_ids=prompt_ids),
            sampling=common_pb2.SamplingParams(temperature=0.0),
            stopping=self.stopping,
        )
        previous_s = None
        try:
            async for response in self.stub.Generate(request, timeout=self.timeout_s):
                if response.token_ids:
                    previous_s = received(previous_s, len(response.token_ids))
        except grpc.aio.AioRpcError as exc:
            raise RequestFailed(exc.code().name) from None

    async def close(self) -> None:
        await self.channel.close()


class LibraryClient:
    """`AsyncClient.stream` with the options an application would pass (the client's defaults)."""

    multiplex = True

    def __init__(self, target: str, max_tokens: int, timeout_s: float) -> None:
        self.client = AsyncClient(target, timeout=timeout_s, multiplex=self.multiplex)
        self.max_tokens = max_tokens

    async def generate(self, prompt_ids: Sequence[int], received: Received) -> None:
        previous_s = None
        options = {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0.0}
        try:
            async with self.client.stream(token_ids=prompt_ids, **options) as deltas:
                async for delta in deltas:
                    if delta.token_ids:
                        previous_s = received(previous_s, len(delta.token_ids))
        except PagodaError as exc:
            raise RequestFailed(exc.code.name) from None

    async def close(self) -> None:
        await self.client.close()


class PerCallLibraryClient(LibraryClient):
    """`AsyncClient(multiplex=False)`: a `Generate` call per stream, as the library did before `GenerateStreams`."""

    multiplex = False


class SseClient:
    """`POST /v1/completions` with `stream: true`, a pool of keep-alive connections (one per stream in use).

    The events carry text, not token ids: tokens are counted in the text as the simulated
    tokenizer splits it (`SIMULATED_TOKEN`), which is exact for that tokenizer only.
    """

    def __init__(self, target: str, max_tokens: int, timeout_s: float) -> None:
        host, _, port = target.rpartition(":")
        self.host, self.port = host, int(port)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.idle: list[HttpConnection] = []

    async def generate(self, prompt_ids: Sequence[int], received: Received) -> None:
        body = {"prompt": list(prompt_ids), "max_tokens": self.max_tokens, "ignore_eos": True}
        payload = json.dumps({**body, "temperature": 0, "stream": True}).encode()
        previous_s = None

        def on_event(data: bytes) -> None:
            nonlocal previous_s
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RequestFailed(f"SSE {event['error'].get('type', 'error')}")
            num_tokens = len(SIMULATED_TOKEN.findall(event["choices"][0]["text"]))
            if num_tokens:
                previous_s = received(previous_s, num_tokens)

        connection = self.idle.pop() if self.idle else HttpConnection(self.host, self.port)
        try:
            post = connection.post_events("/v1/completions", payload, on_event)
            reusable = await asyncio.wait_for(post, self.timeout_s)
        except HttpError as exc:
            connection.close()
            raise RequestFailed(f"HTTP {exc.status}") from None
        except (OSError, EOFError, ValueError, asyncio.TimeoutError) as exc:  # broke, or spoke something else
            connection.close()
            raise RequestFailed(type(exc).__name__) from None
        except BaseException:  # an error event (RequestFailed), or the load stopping: the reply is left half read
            connection.close()
            raise
        if reusable:
            self.idle.append(connection)
        else:
            connection.close()

    async def close(self) -> None:
        for connection in self.idle:
            connection.close()
        self.idle.clear()


# --client name -> the class: (target, max_tokens, timeout_s) -> a LoadClient.
CLIENTS: dict[str, Callable[[str, int, float], LoadClient]] = {
    "stub": StubClient,
    "library": LibraryClient,
    "library-per-call": PerCallLibraryClient,
    "sse": SseClient,
}
