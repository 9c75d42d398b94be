"""A request's pending output: merged per read, failures after tokens, one deadline."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.step import FinishReason, LogprobEntry, TokenLogprob
from scheduler_svc.text.output_buffer import OutputBuffer


def _lp(token_id: int) -> LogprobEntry:
    return LogprobEntry(TokenLogprob(token_id, -0.5), ())


def test_pushes_merge_into_one_chunk_in_order() -> None:
    buffer = OutputBuffer()
    buffer.push("a", (1,), (_lp(1),))
    buffer.push("", (2,), (_lp(2),))  # a token with no text yet (a held-back character)
    buffer.push("bc", (3, 4), (_lp(3), _lp(4)))
    chunk = buffer.take()
    assert chunk is not None
    assert (chunk.text, chunk.token_ids, chunk.end) == ("abc", (1, 2, 3, 4), None)
    assert [e.sampled.token_id for e in chunk.logprobs] == [1, 2, 3, 4]
    assert buffer.take() is None and not buffer.ready


def test_nothing_pushed_is_not_a_chunk() -> None:
    buffer = OutputBuffer()
    buffer.push("", (), ())
    assert not buffer.ready and buffer.take() is None


def test_a_normal_end_rides_with_the_last_tokens() -> None:
    buffer = OutputBuffer()
    buffer.push("x", (7,), ())
    buffer.end(FinishReason.LENGTH, None)
    chunk = buffer.take()
    assert chunk is not None and chunk.token_ids == (7,) and chunk.end == (FinishReason.LENGTH, None, "")
    assert buffer.take() is None


@pytest.mark.parametrize("reason", [FinishReason.ERROR, FinishReason.ABORT])
def test_a_failure_never_carries_tokens(reason: FinishReason) -> None:
    """The stream ends with an error status on a failure: the tokens before it must leave first."""
    buffer = OutputBuffer()
    buffer.push("x", (7, 8), ())
    buffer.end(reason, None, "executor lost")
    first, second = buffer.take(), buffer.take()
    assert first is not None and first.token_ids == (7, 8) and first.end is None
    assert second is not None and second.token_ids == () and second.end == (reason, None, "executor lost")
    assert buffer.take() is None


def test_next_waits_for_a_push_and_takes_all_of_it() -> None:
    async def main() -> tuple:
        buffer = OutputBuffer()
        reader = asyncio.create_task(buffer.next())
        await asyncio.sleep(0)
        assert not reader.done()
        buffer.push("a", (1,), ())
        buffer.push("b", (2,), ())  # before the reader runs: the same chunk
        chunk = await reader
        return chunk.text, chunk.token_ids

    assert asyncio.run(main()) == ("ab", (1, 2))


def test_expire_ends_a_wait_but_not_what_is_pending() -> None:
    async def main() -> None:
        buffer = OutputBuffer()
        buffer.push("a", (1,), ())
        buffer.expire()
        chunk = await buffer.next()  # what came before the deadline is still delivered
        assert chunk.token_ids == (1,)
        with pytest.raises(asyncio.TimeoutError):
            await buffer.next()
        waiting = OutputBuffer()
        reader = asyncio.create_task(waiting.next())
        await asyncio.sleep(0)
        waiting.expire()
        with pytest.raises(asyncio.TimeoutError):
            await reader

    asyncio.run(main())


def test_a_cancelled_reader_leaves_the_pushes_for_the_next() -> None:
    async def main() -> None:
        buffer = OutputBuffer()
        reader = asyncio.create_task(buffer.next())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        buffer.push("z", (9,), ())  # no waiter: nothing to wake, nothing lost
        chunk = await buffer.next()
        assert chunk.token_ids == (9,)

    asyncio.run(main())
