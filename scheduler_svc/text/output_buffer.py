"""One request's outputs waiting for its stream: merged, so a stream sends once per wake-up.

The engine pushes a request's new text and tokens once per step; the stream
(gRPC or SSE) takes everything pushed since its last read as one response. A
stream that keeps up gets one response per step, the first as soon as the first
token is pushed; one that falls behind (a slow client, a busy event loop) gets
the steps it missed in one response instead of one each, so falling behind
costs less work, not more. `output_index` in each response keeps resume exact
however the tokens were grouped.

An error or abort end is never merged with tokens: those tokens go out first,
in a response of their own, so a stream that ends in an error status has
delivered every token it produced.

Waiting costs one future per wake-up and no task or timer per token: the
request's deadline is one timer for the whole request (`expire`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from pagoda.step import FinishReason, LogprobEntry

# Ends that carry no tokens of their own (the stream ends with an error status).
_FAILURES = (FinishReason.ERROR, FinishReason.ABORT)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What a stream takes at once: the merged text and tokens, and the end if it came."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...]
    # (reason, stop string or token id, error message) of the request's end, in this chunk.
    end: tuple[FinishReason, str | int | None, str] | None


class OutputBuffer:
    """Pending output of one request, and the one stream waiting for it."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[LogprobEntry] = []
        self._end: tuple[FinishReason, str | int | None, str] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expired = False
        # Pending output held back from a waiting stream until `release` (see push).
        self.holding = False

    def push(self, text: str, token_ids: Sequence[int], logprobs: Sequence[LogprobEntry], hold: bool = False) -> None:
        """New text and tokens (either may be empty; nothing is queued when both are).

        `hold`: leave a waiting stream asleep; the caller promises `release()` within a step.
        """
        if not text and not token_ids:
            return
        if text:
            self._texts.append(text)
        self._token_ids.extend(token_ids)
        if logprobs:
            self._logprobs.extend(logprobs)
        if hold:
            self.holding = True
        else:
            self._wake()

    def release(self) -> None:
        """Wake the stream for what `push(hold=True)` left pending."""
        if self.holding:
            self._wake()

    def end(self, reason: FinishReason, stop_reason: str | int | None = None, error: str = "") -> None:
        """The request's end, after whatever was pushed."""
        self._end = (reason, stop_reason, error)
        self._wake()

    def expire(self) -> None:
        """The request's deadline passed: a wait with nothing to take raises TimeoutError."""
        self._expired = True
        self._wake()

    @property
    def ready(self) -> bool:
        """Whether `take` has something."""
        return bool(self._texts or self._token_ids or self._end is not None)

    def take(self) -> Chunk | None:
        """Everything pending as one chunk (None when nothing is)."""
        if not self.ready:
            return None
        end = self._end
        has_tokens = bool(self._texts or self._token_ids)
        if end is not None and end[0] in _FAILURES and has_tokens:
            end = None  # the tokens first; the failure in the next chunk
        else:
            self._end = None
        self.holding = False
        chunk = Chunk("".join(self._texts), tuple(self._token_ids), tuple(self._logprobs), end)
        self._texts.clear()
        self._token_ids.clear()
        self._logprobs.clear()
        return chunk

    async def next(self) -> Chunk:
        """The next chunk, waiting for one (and for held output's release); asyncio.TimeoutError once
        expired with nothing pending."""
        while not self.ready or self.holding:
            if self._expired:
                raise asyncio.TimeoutError
            if self._loop is None:  # once per request: get_running_loop() costs a getpid() system call
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self.take()
        assert chunk is not None
        return chunk

    def _wake(self) -> None:
        self.holding = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
