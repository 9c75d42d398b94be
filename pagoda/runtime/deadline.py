"""A deadline over awaits that never loses a cancellation.

`asyncio.wait_for` runs its awaitable in a task of its own and, up to Python
3.11, returns that task's result when it finishes in the same loop iteration
as the caller is cancelled: the CancelledError is dropped and the caller runs
on. On a request's output queue that lost a client's hang-up, so the request
ran to its end instead of being aborted. `within` bounds the awaits of the
current task without a new task: a cancellation always reaches them (an item
that came in meanwhile stays in its queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def _within_310(delay_s: float) -> AsyncIterator[None]:
    """Python 3.10, which has no `asyncio.timeout`: cancel this task at the deadline, then say TimeoutError."""
    task = asyncio.current_task()
    assert task is not None, "within() outside a task"
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(delay_s, 0.0), expire)
    try:
        yield
    except asyncio.CancelledError:
        if expired:  # ours (a cancellation of the caller at the same moment still ends the awaits)
            raise asyncio.TimeoutError from None  # TimeoutError's alias from 3.11 on
        raise
    finally:
        timer.cancel()


def within(delay_s: float) -> contextlib.AbstractAsyncContextManager[object]:
    """The awaits inside raise asyncio.TimeoutError after ``delay_s`` seconds (now when it is not positive)."""
    if sys.version_info >= (3, 11):
        return asyncio.timeout(max(delay_s, 0.0))
    return _within_310(delay_s)
