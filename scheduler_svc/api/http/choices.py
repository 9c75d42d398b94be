"""The n choices of one OpenAI request: n engine requests that share the prompt's KV.

Choice 0 starts first; the others are admitted once its first token arrived,
when the prompt's full blocks are in the prefix cache, so they compute only the
prompt's last partial block (the router prefers the executor that holds the
prefix). Choice i samples with seed ``seed + i``: each has its own random stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from pagoda.params import MAX_SEED
from scheduler_svc.request import GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine


def choice_requests(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine request of each choice (the request itself when n is 1)."""
    if n == 1:
        return [generation]
    seed = generation.sampling.get("seed")
    base = random.getrandbits(63) if seed is None else seed
    return [
        dataclasses.replace(
            generation,
            request_id=generation.request_id if i == 0 else f"{generation.request_id}-{i}",
            sampling={**generation.sampling, "seed": (base + i) % (MAX_SEED + 1)},
        )
        for i in range(n)
    ]


class Choices:
    """The streams of a request's choices, opened together and read together."""

    def __init__(self, engine: Engine, generation: GenerationRequest, n: int) -> None:
        self._streams: list[AsyncGenerator[RequestOutput, None]] = [
            engine.generate(request) for request in choice_requests(generation, n)
        ]
        # The first output of each choice (open() fills it).
        self.firsts: list[RequestOutput] = []
        self._pumps: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Admits choice 0, waits for its first output, then admits the others (validation errors raise here)."""
        first = await anext(self._streams[0])
        rest = await asyncio.gather(*(anext(stream) for stream in self._streams[1:]))
        self.firsts = [first, *rest]

    async def collect(self) -> list[list[RequestOutput]]:
        """Every output of every choice, until each finished."""

        async def rest(i: int) -> list[RequestOutput]:
            if self.firsts[i].finished:
                return [self.firsts[i]]
            return [self.firsts[i]] + [out async for out in self._streams[i]]

        return list(await asyncio.gather(*(rest(i) for i in range(len(self._streams)))))

    def only(self) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:
        """n = 1: the first output and the engine's stream of the rest, to read directly. Each generator
        between the engine and the writer is resumed once per response: ~1% of the scheduler's CPU at 256
        SSE streams."""
        if len(self._streams) != 1:
            raise ValueError(f"only() needs one choice, not {len(self._streams)}")
        return self.firsts[0], self._streams[0]

    async def interleave(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) in the order they arrive, the first outputs first."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self._streams[i]:
                    await queue.put((i, out))
            except Exception as exc:  # a RequestError of this choice ends the whole response
                await queue.put((i, exc))

        for i, first in enumerate(self.firsts):
            yield i, first
        running = [i for i, first in enumerate(self.firsts) if not first.finished]
        if len(running) == 1:  # one stream left (n = 1, the common case): read it directly, no task or queue
            async for out in self._streams[running[0]]:
                yield running[0], out
            return
        self._pumps = [asyncio.create_task(pump(i)) for i in running]
        num_left = len(running)
        while num_left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item
            num_left -= item.finished

    async def aclose(self) -> None:
        """Stops the pumps, then closes every stream (an unfinished request is aborted and its blocks freed)."""
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()
