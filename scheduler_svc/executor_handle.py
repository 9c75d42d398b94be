"""The scheduler's handle on one executor: connection, scheduler core, step loop.

The loop keeps up to two plans in flight (plan N+1 is sent before result N
arrives), so the executor finds its next plan waiting when it finishes a step.
When the stream breaks, every unfinished sequence is handed back to the engine
to be recomputed elsewhere, and the handle reconnects with backoff.
This is the scheduler's edge of the executor stream: the only place that
converts plans and results to and from protos.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Callable
from typing import Protocol

import grpc
import structlog

from pagoda.runtime.grpc_server import KEEPALIVE_OPTIONS, message_size_options
from pagoda.step import ExecutorInfo, StepPlan, StepResult
from pagoda.step_pb import info_from_pb, plan_to_pb, result_from_pb
from pagoda.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.scheduler import Scheduler, SchedulerConfig, SeqUpdate
from scheduler_svc.sequence import SchedulerSequence

log = structlog.get_logger("scheduler")
MAX_IN_FLIGHT = 2
EXECUTOR_MESSAGE_BYTES = 256 * 2**20
# Plans sent and not answered yet, each with the time it was sent.
InFlight = collections.deque[tuple[StepPlan, float]]
ResultQueue = asyncio.Queue[executor_pb2.StepResult | None]
ExecuteCall = grpc.aio.StreamStreamCall[executor_pb2.StepPlan, executor_pb2.StepResult]


class ExecutorState(enum.Enum):
    """Where the connection to an executor stands."""

    CONNECTING = "CONNECTING"
    READY = "READY"
    DRAINING = "DRAINING"
    DEAD = "DEAD"


class ExecutorListener(Protocol):
    """What the engine does with what a handle learns."""

    def on_executor_ready(self, executor: ExecutorHandle, info: ExecutorInfo) -> bool: ...
    def on_updates(self, executor: ExecutorHandle, updates: list[SeqUpdate], result: StepResult) -> None: ...
    def on_executor_lost(self, executor: ExecutorHandle, seqs: list[SchedulerSequence]) -> None: ...
    def on_step(self, executor: ExecutorHandle, plan: StepPlan, result: StepResult, duration_s: float) -> None: ...


class ExecutorHandle:
    """Drives one executor at `address`: its scheduler core and its Execute stream."""

    def __init__(
        self,
        address: str,
        listener: ExecutorListener,
        make_config: Callable[[ExecutorInfo], SchedulerConfig],
        step_timeout_s: float,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str = "",
    ) -> None:
        self.address = address
        self.state = ExecutorState.CONNECTING
        self.info: ExecutorInfo | None = None
        self.scheduler: Scheduler | None = None
        self.removed = False
        self._listener = listener
        self._make_config = make_config
        self._step_timeout_s = step_timeout_s
        self._credentials = credentials
        self._tls_server_name = tls_server_name  # checked instead of the dialed IP address
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def accepts_new(self) -> bool:
        """READY and not draining."""
        return self.state is ExecutorState.READY and self.scheduler is not None

    def start(self) -> None:
        """Connect and drive the executor in a background task (reconnecting until stopped)."""
        self._task = asyncio.create_task(self._run(), name=f"executor-{self.address}")

    async def stop(self) -> None:
        """Stop driving the executor; its unfinished sequences go back to the engine."""
        self.removed = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def add(self, seq: SchedulerSequence) -> None:
        """Queue a sequence on this executor."""
        assert self.scheduler is not None
        self.scheduler.add(seq)
        self._wakeup.set()

    def wake(self) -> None:
        """Schedule again now (new work, or a finished sequence to drop)."""
        self._wakeup.set()

    def load(self) -> tuple[int, float]:
        """(queued + running sequences, KV usage) for the router."""
        if self.scheduler is None:
            return (1 << 30, 1.0)
        return (self.scheduler.num_running + self.scheduler.num_waiting, self.scheduler.kv_cache_usage)

    def _channel(self) -> grpc.aio.Channel:
        options: list[tuple[str, str | int]] = [*KEEPALIVE_OPTIONS, *message_size_options(EXECUTOR_MESSAGE_BYTES)]
        if self._credentials is not None:
            if self._tls_server_name:
                options.append(("grpc.ssl_target_name_override", self._tls_server_name))
            return grpc.aio.secure_channel(self.address, self._credentials, options=options)
        return grpc.aio.insecure_channel(self.address, options=options)

    async def _run(self) -> None:
        backoff_s = 0.2
        while not self.removed:
            try:
                async with self._channel() as channel:
                    stub = executor_pb2_grpc.ExecutorStub(channel)
                    if await self._connect(stub):
                        backoff_s = 0.2
                        await self._step_loop(stub)
            except asyncio.CancelledError:
                self._lose("scheduler stopping")
                raise
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError) as exc:
                self._lose(_describe_error(exc))
            except Exception:  # a bug must not kill the handle silently
                log.exception("executor_handle_crashed", executor=self.address)
                self._lose("handle error")
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)

    async def _connect(self, stub: executor_pb2_grpc.ExecutorStub) -> bool:
        self.state = ExecutorState.CONNECTING
        info = info_from_pb(await stub.Describe(executor_pb2.DescribeRequest(), timeout=10, wait_for_ready=True))
        if info.draining:
            log.info("executor_draining_skip", executor=self.address)
            await asyncio.sleep(1.0)
            return False
        self.info = info
        self.scheduler = Scheduler(self._make_config(info))
        self.state = ExecutorState.READY
        if not self._listener.on_executor_ready(self, info):
            self.state, self.scheduler = ExecutorState.DEAD, None
            await asyncio.sleep(5.0)
            return False
        log.info(
            "executor_ready",
            executor=self.address,
            incarnation_id=info.incarnation_id,
            num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            model=info.model_name,
            kernels=dict(info.kernels),
        )
        return True

    async def _step_loop(self, stub: executor_pb2_grpc.ExecutorStub) -> None:
        call: ExecuteCall = stub.Execute()
        results: ResultQueue = asyncio.Queue()
        reader = asyncio.create_task(_read_results(call, results))
        in_flight: InFlight = collections.deque()
        try:
            while True:
                for plan in self._schedule_more(in_flight):
                    await call.write(plan_to_pb(plan))
                if not in_flight:
                    await self._wait_for_work(reader)
                    continue
                msg = await asyncio.wait_for(results.get(), timeout=self._step_timeout_s)
                if msg is None:
                    await reader  # raises why the stream ended
                    raise ConnectionError("executor stream ended")
                plan, sent_at = in_flight.popleft()
                self._on_result(plan, result_from_pb(msg), time.monotonic() - sent_at)
        finally:
            reader.cancel()
            call.cancel()

    async def _wait_for_work(self, reader: asyncio.Task[None]) -> None:
        """Sleep until woken, or until the stream breaks (an idle executor can die too)."""
        self._wakeup.clear()
        woken = asyncio.create_task(self._wakeup.wait())
        try:
            await asyncio.wait({woken, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if reader.done():
            await reader
            raise ConnectionError("executor stream ended")

    def _schedule_more(self, in_flight: InFlight) -> list[StepPlan]:
        """Schedule plans until MAX_IN_FLIGHT are out or there is nothing to do."""
        new_plans = []
        while len(in_flight) < MAX_IN_FLIGHT and self.scheduler is not None:
            plan = self.scheduler.schedule()
            if not plan.has_work and not plan.dropped_seq_ids:
                break
            in_flight.append((plan, time.monotonic()))
            new_plans.append(plan)
        return new_plans

    def _on_result(self, plan: StepPlan, result: StepResult, duration_s: float) -> None:
        assert self.info is not None and self.scheduler is not None
        if result.incarnation_id != self.info.incarnation_id:
            raise ConnectionError("executor restarted (new incarnation)")
        if result.step_id != plan.step_id:
            raise ConnectionError(f"result for step {result.step_id}, expected {plan.step_id}")
        if result.draining and self.state is ExecutorState.READY:
            self.state = ExecutorState.DRAINING
            log.info("executor_draining", executor=self.address)
        updates = self.scheduler.update(result)
        self._listener.on_step(self, plan, result, duration_s)
        self._listener.on_updates(self, updates, result)

    def _lose(self, reason: str) -> None:
        """Hand every unfinished sequence back to the engine."""
        was = self.state
        self.state = ExecutorState.DEAD
        seqs = self.scheduler.take_all() if self.scheduler is not None else []
        self.scheduler = None
        if was is not ExecutorState.DEAD:
            log.warning("executor_lost", executor=self.address, reason=reason, num_sequences=len(seqs))
        self._listener.on_executor_lost(self, seqs)


async def _read_results(call: ExecuteCall, queue: ResultQueue) -> None:
    """Move results from the stream to `queue`; None marks the end."""
    try:
        while True:
            msg = await call.read()
            if not isinstance(msg, executor_pb2.StepResult):  # grpc.aio.EOF
                raise ConnectionError("executor closed the stream")
            queue.put_nowait(msg)
    finally:
        queue.put_nowait(None)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "step timed out (watchdog)"
    return str(exc) or type(exc).__name__
