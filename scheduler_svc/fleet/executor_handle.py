"""The scheduler's handle on one executor: heartbeat, lease, scheduler core, step loop.

Every scheduler polls every executor it discovers (`poll`: a brief Describe,
which is also its heartbeat) and drives those the ownership rule gives it
(scheduler_svc.fleet.ownership): `acquire` asks for the executor's lease and, when
granted, opens the Execute stream with its epoch and runs the step loop;
`release` ends it. The loop keeps up to two plans in flight (plan N+1 is sent
before result N arrives), so the executor finds its next plan waiting when it
finishes a step. When the stream breaks or the lease is released, every
unfinished sequence is handed back to the engine to be recomputed elsewhere.
This is the scheduler's edge of the executor stream: the only place that
converts plans and results to and from protos.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
from collections.abc import Callable
from typing import Protocol

import grpc
import structlog

from pagoda.runtime.deadline import within
from pagoda.runtime.grpc_server import KEEPALIVE_OPTIONS, message_size_options
from pagoda.step import RANK_UNKNOWN, ExecutorInfo, GroupRank, LoraAdapter, StepPlan, StepResult, StepTimings
from pagoda.step_pb import group_ranks_from_pb, info_from_pb, lora_from_pb, plan_to_pb, result_from_pb
from pagoda.v1 import executor_pb2, executor_pb2_grpc
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler, SeqUpdate
from scheduler_svc.core.scheduler_types import SequenceTracer
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.fleet.ownership import ExecutorView

log = structlog.get_logger("scheduler")
MAX_IN_FLIGHT = 2
# An executor that waited longer than this (and a quarter of its step) for a plan was held back by us.
STARVED_IDLE_NS = 200_000
EXECUTOR_MESSAGE_BYTES = 256 * 2**20
# Bounds of the calls outside the stream: the heartbeat, the full Describe, Acquire.
POLL_TIMEOUT_S = 1.0
DESCRIBE_TIMEOUT_S = 10.0
ACQUIRE_TIMEOUT_S = 5.0
# Registering a LoRA adapter reads and checks its files on the executor, between two of its steps.
LOAD_LORA_TIMEOUT_S = 120.0
UNLOAD_LORA_TIMEOUT_S = 10.0
# Execute call metadata naming the lease (as executor_svc.serving.servicer reads it).
SCHEDULER_ID_KEY = "x-pagoda-scheduler-id"
EPOCH_KEY = "x-pagoda-epoch"
# Reconnect within a second of an executor coming back (gRPC's default backoff grows to minutes).
CHANNEL_OPTIONS: list[tuple[str, str | int]] = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Plans sent and not answered yet, each with the time it was sent.
InFlight = collections.deque[tuple[StepPlan, float]]
ResultQueue = asyncio.Queue[executor_pb2.StepResult | None]
ExecuteCall = grpc.aio.StreamStreamCall[executor_pb2.StepPlan, executor_pb2.StepResult]


class ExecutorState(enum.Enum):
    """Where this scheduler stands with an executor."""

    # Not described yet, or acquiring its lease.
    CONNECTING = "CONNECTING"
    # Held by this scheduler (DRAINING: the executor drains; no new sequences).
    READY = "READY"
    DRAINING = "DRAINING"
    # Seen, not held: another scheduler holds it, or nobody does.
    HELD_BY_OTHER = "HELD_BY_OTHER"
    FREE = "FREE"
    # Unreachable, or its stream just broke.
    DEAD = "DEAD"


class ExecutorListener(Protocol):
    """What the engine does with what a handle learns."""

    @property
    def tracer(self) -> SequenceTracer | None:
        """Told by each scheduler core of what it does to traced sequences (None: tracing off)."""
        ...

    def on_executor_described(self, executor: ExecutorHandle, info: ExecutorInfo) -> bool: ...
    def on_executor_ready(self, executor: ExecutorHandle, info: ExecutorInfo) -> None: ...
    def on_updates(self, executor: ExecutorHandle, updates: list[SeqUpdate], result: StepResult) -> None: ...
    def on_executor_lost(self, executor: ExecutorHandle, seqs: list[SchedulerSequence]) -> None: ...
    def on_step(self, executor: ExecutorHandle, plan: StepPlan, result: StepResult, duration_s: float) -> None: ...


class ExecutorHandle:
    """Polls the executor at `address` and, while it holds its lease, drives it: scheduler core and Execute stream."""

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
        # The LoRA adapters it has registered, by name: as its last Describe listed them, and as load_lora and
        # unload_lora changed them since.
        self.loras: dict[str, LoraAdapter] = {}
        # An executor group's ranks (none for a plain executor) and the seconds since they last all met, as its
        # leader's last heartbeat answer said (docs/parallel.md); a rank's health is unknown while it does not answer.
        self.group_ranks: tuple[GroupRank, ...] = ()
        self.group_last_contact_s = 0.0
        self.view = ExecutorView(address, reachable=False)
        self.scheduler: Scheduler | None = None
        # The epoch of the lease held (0: none yet).
        self.epoch = 0
        self.removed = False
        # False when the engine refused what the executor serves (another model).
        self.usable = True
        self._listener = listener
        self._make_config = make_config
        self._step_timeout_s = step_timeout_s
        self._credentials = credentials
        self._tls_server_name = tls_server_name  # checked instead of the dialed IP address
        self._wakeup = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        self._stub: executor_pb2_grpc.ExecutorStub | None = None
        self._task: asyncio.Task[None] | None = None
        self._describing: asyncio.Task[None] | None = None
        self._release_reason = ""
        self._refused_by = ""
        # Whether this scheduler holds the executor back at the result being applied: the result was
        # here before the loop came for it, or the executor waited for its plan (the engine then wakes
        # streams every other step, so that the scheduler's work per token falls when it is the limit).
        self.behind = False

    @property
    def accepts_new(self) -> bool:
        """READY and not draining."""
        return self.state is ExecutorState.READY and self.scheduler is not None

    @property
    def driving(self) -> bool:
        """Whether this scheduler holds (or is acquiring) the executor's lease."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Open the channel that the heartbeat and the stream share."""
        self._channel = self._open_channel()
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)

    async def stop(self) -> None:
        """Stop driving the executor (its unfinished sequences go back to the engine) and close the channel."""
        self.removed = True
        if self._describing is not None:
            self._describing.cancel()
        await self.release("scheduler stopping")
        if self._channel is not None:
            await self._channel.close()

    async def poll(self, scheduler_id: str, draining: bool) -> ExecutorView:
        """One heartbeat: a brief Describe, bounded by POLL_TIMEOUT_S (a new executor is described in full aside)."""
        assert self._stub is not None, "start() first"
        request = executor_pb2.DescribeRequest(scheduler_id=scheduler_id, draining=draining, brief=True)
        try:
            msg = await self._stub.Describe(request, timeout=POLL_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            self._set_view(ExecutorView(self.address, reachable=False), _describe_error(exc))
            self.group_ranks = tuple(dataclasses.replace(r, health=RANK_UNKNOWN) for r in self.group_ranks)
            return self.view
        self.group_ranks, self.group_last_contact_s = group_ranks_from_pb(msg.group_ranks), msg.group_last_contact_s
        described = self.info is not None and self.info.incarnation_id == msg.incarnation_id
        if described and [(a.name, a.fingerprint) for a in msg.loras] != [
            (a.name, a.fingerprint) for a in self.loras.values()
        ]:
            self.loras = {a.name: lora_from_pb(a) for a in msg.loras}
        if not described and (self._describing is None or self._describing.done()):
            # Aside: the full answer carries the tokenizer; the heartbeat round must not wait for it.
            self._describing = asyncio.create_task(self._describe(request))
        view = ExecutorView(
            self.address,
            reachable=True,
            holder_id=msg.lease_holder,
            epoch=msg.lease_epoch,
            schedulers=tuple(msg.schedulers),
            claimants=tuple(msg.lease_claimants),
            draining=msg.draining,
            usable=self.usable and described,
        )
        self._set_view(view)
        return view

    async def _describe(self, request: executor_pb2.DescribeRequest) -> None:
        """The full Describe of a new executor (or incarnation), bounded by DESCRIBE_TIMEOUT_S."""
        assert self._stub is not None
        full = executor_pb2.DescribeRequest(scheduler_id=request.scheduler_id, draining=request.draining)
        try:
            self._described(info_from_pb(await self._stub.Describe(full, timeout=DESCRIBE_TIMEOUT_S)))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            log.warning("executor_describe_failed", executor=self.address, error=_describe_error(exc))

    async def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Registers a LoRA adapter on the executor (bounded by LOAD_LORA_TIMEOUT_S).

        Raises:
            grpc.aio.AioRpcError: its refusal (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS), or unreachable.
        """
        assert self._stub is not None, "start() first"
        request = executor_pb2.LoadLoraRequest(name=name, path=path)
        adapter = lora_from_pb(await self._stub.LoadLora(request, timeout=LOAD_LORA_TIMEOUT_S))
        self.loras[name] = adapter
        return adapter

    async def unload_lora(self, name: str) -> None:
        """Unregisters a LoRA adapter on the executor (its running sequences finish with it first).

        Raises:
            grpc.aio.AioRpcError: NOT_FOUND, or unreachable.
        """
        assert self._stub is not None, "start() first"
        self.loras.pop(name, None)
        request = executor_pb2.UnloadLoraRequest(name=name)
        await self._stub.UnloadLora(request, timeout=UNLOAD_LORA_TIMEOUT_S)

    def acquire(self, scheduler_id: str) -> None:
        """Ask for the lease and, granted, drive the executor until the stream ends or `release`."""
        if not self.driving and not self.removed and self._stub is not None:
            self.state = ExecutorState.CONNECTING
            self._release_reason = ""
            self._task = asyncio.create_task(self._drive(scheduler_id), name=f"executor-{self.address}")

    async def release(self, reason: str) -> None:
        """End the stream (the executor frees the lease); the sequences on it go back to the engine."""
        task = self._task
        if task is not None and not task.done():
            self._release_reason = reason
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

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
        return (self.scheduler.num_running + self.scheduler.num_waiting, self.scheduler.kv.usage)

    def _open_channel(self) -> grpc.aio.Channel:
        options = [*KEEPALIVE_OPTIONS, *message_size_options(EXECUTOR_MESSAGE_BYTES), *CHANNEL_OPTIONS]
        if self._credentials is not None:
            if self._tls_server_name:
                options.append(("grpc.ssl_target_name_override", self._tls_server_name))
            return grpc.aio.secure_channel(self.address, self._credentials, options=options)
        return grpc.aio.insecure_channel(self.address, options=options)

    def _described(self, info: ExecutorInfo) -> None:
        self.info = info
        self.loras = {adapter.name: adapter for adapter in info.loras}
        self.usable = self._listener.on_executor_described(self, info)
        log.info(
            "executor_described",
            executor=self.address,
            incarnation_id=info.incarnation_id,
            num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            model=info.model_name,
            kernels=dict(info.kernels),
            kv_offload=info.kv_offload,
            num_tier_blocks=len(info.tier_hashes),
            usable=self.usable,
        )

    def _set_view(self, view: ExecutorView, error: str = "") -> None:
        old = self.view
        if (view.reachable, view.holder_id) != (old.reachable, old.holder_id):
            log.info(
                "executor_seen", executor=self.address, reachable=view.reachable, holder_id=view.holder_id, error=error
            )
        self.view = view
        if not self.driving:
            self.state = _idle_state(view)

    async def _drive(self, scheduler_id: str) -> None:
        assert self._stub is not None
        try:
            request = executor_pb2.AcquireRequest(scheduler_id=scheduler_id)
            lease = await self._stub.Acquire(request, timeout=ACQUIRE_TIMEOUT_S)
            if not lease.granted:
                self._refused(lease)
                return
            self.epoch, self._refused_by = lease.epoch, ""
            log.info("lease_acquired", executor=self.address, scheduler_id=scheduler_id, epoch=lease.epoch)
            await self._step_loop(self._stub, scheduler_id)
        except asyncio.CancelledError:
            self._lose(self._release_reason or "scheduler stopping", released=True)
            raise
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError) as exc:
            self._lose(_describe_error(exc))
        except Exception:  # a bug must not kill the handle silently
            log.exception("executor_handle_crashed", executor=self.address)
            self._lose("handle error")

    def _refused(self, lease: executor_pb2.Lease) -> None:
        """Acquire not granted: another scheduler holds the lease (logged once per holder)."""
        if lease.holder_id != self._refused_by:
            log.info("lease_not_granted", executor=self.address, holder_id=lease.holder_id, epoch=lease.epoch)
        self._refused_by = lease.holder_id
        self.state = ExecutorState.HELD_BY_OTHER

    async def _step_loop(self, stub: executor_pb2_grpc.ExecutorStub, scheduler_id: str) -> None:
        assert self.info is not None  # described before any acquire
        call: ExecuteCall = stub.Execute(metadata=((SCHEDULER_ID_KEY, scheduler_id), (EPOCH_KEY, str(self.epoch))))
        config = self._make_config(self.info)
        self.scheduler = Scheduler(config, tier_hashes=self.info.tier_hashes, tracer=self._listener.tracer)
        self.state = ExecutorState.READY
        self._listener.on_executor_ready(self, self.info)
        results: ResultQueue = asyncio.Queue()
        reader = asyncio.create_task(_read_results(call, results))
        in_flight: InFlight = collections.deque()
        try:
            while True:
                for plan in self._schedule_more(in_flight):
                    await call.write(plan_to_pb(plan, compact=self.info.compact_steps))
                if not in_flight:
                    await self._wait_for_work(reader)
                    continue
                queued = not results.empty()
                async with within(self._step_timeout_s):
                    msg = await results.get()
                if msg is None:
                    await reader  # raises why the stream ended
                    raise ConnectionError("executor stream ended")
                plan, sent_at = in_flight.popleft()
                result = result_from_pb(msg)
                self.behind = queued or _starved(result.timings)
                self._on_result(plan, result, time.monotonic() - sent_at)
        finally:
            self.behind = False
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
        """Schedule plans until MAX_IN_FLIGHT are out (one while speculating) or there is nothing to do."""
        new_plans = []
        while len(in_flight) < MAX_IN_FLIGHT and self.scheduler is not None:
            if in_flight and not self.scheduler.may_plan_ahead:
                break
            plan = self.scheduler.schedule()
            if not plan.has_work and not plan.dropped_seq_ids and not plan.saves:
                break
            plan = dataclasses.replace(plan, epoch=self.epoch)
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

    def _lose(self, reason: str, released: bool = False) -> None:
        """Hand every unfinished sequence back to the engine (the lease is gone or given up)."""
        was = self.state
        self.state = ExecutorState.FREE if released else ExecutorState.DEAD
        seqs = self.scheduler.take_all() if self.scheduler is not None else []
        self.scheduler = None
        if released and was in (ExecutorState.READY, ExecutorState.DRAINING):
            log.info("lease_released", executor=self.address, epoch=self.epoch, reason=reason, num_sequences=len(seqs))
        elif was in (ExecutorState.READY, ExecutorState.DRAINING, ExecutorState.CONNECTING):
            log.warning(
                "executor_lost", executor=self.address, epoch=self.epoch, reason=reason, num_sequences=len(seqs)
            )
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


def _starved(timings: StepTimings) -> bool:
    """Whether the executor waited for this step's plan for more than a quarter of the step (plus noise)."""
    return timings.idle_ns > STARVED_IDLE_NS + timings.step_ns // 4


def _idle_state(view: ExecutorView) -> ExecutorState:
    """The state of an executor this scheduler does not drive, from its last Describe."""
    if not view.reachable:
        return ExecutorState.DEAD
    return ExecutorState.HELD_BY_OTHER if view.holder_id else ExecutorState.FREE


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "step timed out (watchdog)"
    return str(exc) or type(exc).__name__
