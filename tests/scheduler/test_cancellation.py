"""A client that goes away aborts its request, even when it goes in the loop turn an output arrives.

Python 3.11's `asyncio.wait_for` drops a cancellation that comes while the
awaitable it wraps has just finished: the reader gets the output and runs on,
so the request was never aborted and ran to its end (counted "length", its
blocks held meanwhile). Each test here delivers an output (or the model) and
cancels in the same turn, then gives the abort a bounded time; with the
cancellation lost the reader waits for an output that never comes and the
test fails.

The Engine runs for real; the executor is test_resume's script, stepped by the
test, so nothing moves unless the test says so.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from scheduler.test_resume import INFO, PROMPT, ScriptedExecutor, System

from pagoda.runtime import deadline
from scheduler_svc.api.http.choices import Choices
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.fleet.executor_handle import ExecutorHandle, ExecutorState
from scheduler_svc.request import GenerationRequest, PromptInput, RequestOutput

# Far more than any test waits for: the request is still running when the client goes.
MAX_TOKENS = 40
# Bound on how long an abort may take once nothing else is pending (it takes a few loop turns).
ABORT_BOUND_S = 5.0


def _system(*, with_model: bool = True) -> System:
    """An Engine with one scripted executor (described only when ``with_model``)."""
    engine = Engine(SchedulerServiceConfig(max_new_tokens=200))
    config = SchedulerConfig(num_blocks=INFO.num_kv_blocks, block_size=INFO.block_size, eos_token_ids=(0,))
    handle = ExecutorHandle("scripted:1", engine, lambda info: config, step_timeout_s=1.0)
    handle.info, handle.scheduler, handle.state = INFO, Scheduler(config), ExecutorState.READY
    engine.executors[handle.address] = handle
    if with_model:
        _describe(engine, handle)
    return System(engine, handle, handle.scheduler, ScriptedExecutor())


def _describe(engine: Engine, handle: ExecutorHandle) -> None:
    assert engine.on_executor_described(handle, INFO)
    engine.on_executor_ready(handle, INFO)


def _request() -> GenerationRequest:
    return GenerationRequest(
        "req-1", prompt=PromptInput(token_ids=PROMPT), sampling={"seed": 3}, stopping={"max_tokens": MAX_TOKENS}
    )


def _num_aborted(engine: Engine) -> float:
    value = engine.metrics.registry.get_sample_value("pagoda:request_success_total", {"finished_reason": "abort"})
    return value or 0.0


async def _turns(n: int = 10) -> None:
    """A few loop turns: every woken task runs and waits again."""
    for _ in range(n):
        await asyncio.sleep(0)


async def _step_until(system: System, done: Callable[[], bool]) -> None:
    for _ in range(MAX_TOKENS // 2):
        if done():
            return
        system.step()
        await _turns()
    raise AssertionError("the request did not get going")


def _assert_aborted(system: System) -> None:
    assert _num_aborted(system.engine) == 1
    assert not system.engine._requests and not system.scheduler.has_unfinished()
    assert system.scheduler.kv.num_free_blocks == INFO.num_kv_blocks


async def test_a_hang_up_as_an_output_arrives_aborts_the_request():
    """The gRPC servicer's path: the task that iterates Engine.generate is cancelled."""
    system = _system()
    outputs: list[RequestOutput] = []

    async def read() -> None:
        async for out in system.engine.generate(_request()):
            outputs.append(out)

    reader = asyncio.create_task(read())
    await _step_until(system, lambda: len(outputs) >= 2)
    await _turns()  # the reader waits on an empty queue
    system.step()  # an output arrives ...
    reader.cancel()  # ... in the turn the client goes
    await asyncio.wait({reader}, timeout=ABORT_BOUND_S)
    assert reader.cancelled(), "the cancellation was lost: the reader still waits for outputs"
    assert not outputs[-1].finished
    _assert_aborted(system)


async def test_closing_the_choices_as_an_output_arrives_aborts_the_request():
    """The HTTP path: the handler closes its Choices, which cancels the task that pumps the stream."""
    system = _system()
    choices = Choices(system.engine, _request(), 1)
    opening = asyncio.create_task(choices.open())
    await _step_until(system, opening.done)
    await opening
    outputs: list[RequestOutput] = []

    async def write_events() -> None:
        async for _, out in choices.interleave():
            outputs.append(out)

    writer = asyncio.create_task(write_events())
    await _step_until(system, lambda: len(outputs) >= 3)
    await _turns()
    system.step()
    writer.cancel()
    closing = asyncio.create_task(choices.aclose())
    await asyncio.wait({closing}, timeout=ABORT_BOUND_S)
    assert closing.done(), "the pump's cancellation was lost: it still reads the request's outputs"
    await closing
    _assert_aborted(system)


async def test_a_hang_up_as_the_model_becomes_known_admits_nothing():
    system = _system(with_model=False)
    reader = asyncio.create_task(anext(system.engine.generate(_request())))
    await _turns()  # the request waits for a model
    _describe(system.engine, system.handle)
    reader.cancel()
    await asyncio.wait({reader}, timeout=ABORT_BOUND_S)
    assert reader.cancelled(), "the cancellation was lost: the request was admitted for a client that left"
    assert not system.engine._requests and not system.scheduler.has_unfinished()


WITHINS = [pytest.param(deadline.within, id="within"), pytest.param(deadline._within_310, id="python-3.10")]


@pytest.mark.parametrize("within", WITHINS)
async def test_within_keeps_a_cancellation_that_comes_with_the_item(
    within: Callable[[float], AbstractAsyncContextManager[object]],
):
    queue: asyncio.Queue[int] = asyncio.Queue()
    got: list[int] = []

    async def read() -> None:
        while True:
            async with within(60):
                got.append(await queue.get())

    reader = asyncio.create_task(read())
    await _turns()
    queue.put_nowait(1)
    reader.cancel()
    await asyncio.wait({reader}, timeout=ABORT_BOUND_S)
    assert reader.cancelled() and got == [] and queue.qsize() == 1  # the item waits for the next reader


@pytest.mark.parametrize("within", WITHINS)
async def test_within_times_out(within: Callable[[float], AbstractAsyncContextManager[object]]):
    queue: asyncio.Queue[int] = asyncio.Queue()
    with pytest.raises(asyncio.TimeoutError):
        async with within(0.01):
            await queue.get()
    queue.put_nowait(2)
    async with within(0):  # an item already there is taken even at the deadline
        assert await queue.get() == 2


def test_no_service_code_calls_wait_for():
    """`asyncio.wait_for` can drop a cancellation on the Python we run; `pagoda.runtime.deadline.within` cannot."""
    repo = Path(__file__).resolve().parents[2]
    calls = [
        f"{path.relative_to(repo)}:{number}"
        for package in ("scheduler_svc", "executor_svc", "pagoda", "client")
        for path in sorted((repo / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bwait_for\(", line)
    ]
    assert not calls, f"use pagoda.runtime.deadline.within instead of asyncio.wait_for: {calls}"
