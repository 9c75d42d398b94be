"""The Executor gRPC servicer: a thin edge around a Runner (the model runner, or the simulated one).

Each Execute message is converted, run on the model thread (so health checks
and the next plan's arrival proceed meanwhile), and answered with one
StepResult. All torch work runs on that one thread: torch's OpenMP thread team
belongs to the thread that calls it, so alternating between pool threads would
keep two teams spinning on the same cores.
One scheduler at a time drives the executor, through the lease it got from
Acquire (executor_svc.serving.lease): an Execute stream or a plan of any other epoch is
refused with FAILED_PRECONDITION, and the lease ends with its stream. Each new
stream starts from an empty executor: the scheduler that holds the lease sends
what it wants computed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from executor_svc.loading.tokenizer_files import TokenizerFiles
from executor_svc.lora.errors import LoraAdapterError, LoraRegistryError
from executor_svc.serving.lease import LeaseRefused, LeaseTable
from executor_svc.serving.metrics import ExecutorMetrics
from executor_svc.serving.sequence_table import Runner
from executor_svc.serving.step_tracing import StepTracer
from pagoda.by_name import copy_by_name
from pagoda.step import RANK_OK, ExecutorInfo, GroupRank, LoraAdapter, StepPlan, StepResult
from pagoda.step_pb import info_to_pb, lora_to_pb, plan_from_pb, result_to_pb
from pagoda.v1 import common_pb2, executor_pb2, executor_pb2_grpc

if TYPE_CHECKING:
    from executor_svc.kv.tier.store import TierStore

log = structlog.get_logger("executor")
# Execute call metadata naming the lease the stream belongs to.
SCHEDULER_ID_KEY = "x-pagoda-scheduler-id"
EPOCH_KEY = "x-pagoda-epoch"


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Describe and Execute over one Runner.

    Registered before the server starts (health answers during model loading);
    both RPCs answer UNAVAILABLE until `attach` hands over the loaded runner.
    """

    def __init__(self, metrics: ExecutorMetrics | None = None) -> None:
        self.runner: Runner | None = None
        self.incarnation_id = uuid.uuid4().hex
        self.draining = False
        self._metrics = metrics
        self._lock = asyncio.Lock()
        self.leases = LeaseTable()
        self._active_streams = 0
        self._info: ExecutorInfo | None = None
        # The kernel paths the attached runner runs (executor_svc.native.active), empty until then.
        self.kernels: dict[str, str] = {}
        # seq_id -> request_id of the sequences held, for log lines.
        self._request_ids: dict[int, str] = {}
        self._model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        # Spans of traced sequences and their steps (docs/tracing.md); None when tracing is off.
        self.tracer: StepTracer | None = None
        # The runner's offload tier (docs/kv-offload.md): what Describe and each result report of it.
        self.tier: TierStore | None = None

    @property
    def metrics(self) -> ExecutorMetrics | None:
        return self._metrics

    async def run_model(self, fn, *args):
        """Runs fn(*args) on the model thread (every torch call goes there)."""
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, functools.partial(fn, *args))

    def attach(
        self,
        runner: Runner,
        tokenizer: TokenizerFiles,
        model_name: str,
        kernels: Mapping[str, str],
        tier: TierStore | None = None,
        kv_offload: str = "",
    ) -> None:
        """Start serving `runner` (weights loaded, warm-up done), which runs the kernel paths `kernels`
        and stores blocks in `tier` (described as `kv_offload`)."""
        self.tier = tier
        self.kernels = dict(kernels)
        if self._metrics is not None:
            self._metrics.set_kernels(self.kernels)
        self._info = dataclasses.replace(
            runner.info,
            incarnation_id=self.incarnation_id,
            model_name=model_name,
            eos_token_ids=tuple(tokenizer.eos_token_ids or runner.info.eos_token_ids),
            tokenizer_json=tokenizer.tokenizer_json,
            chat_template=tokenizer.chat_template or "",
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            kernels=tuple(sorted(self.kernels.items())),
            kv_offload=kv_offload,
            **_group_of(runner),
        )
        self.runner = runner

    @property
    def has_active_stream(self) -> bool:
        """Whether a scheduler is connected."""
        return self._active_streams > 0

    async def Describe(self, request, context) -> executor_pb2.ExecutorInfo:
        await self._check_ready(context)
        assert self._info is not None  # set with the runner
        self.leases.seen(request.scheduler_id, request.draining)
        info = dataclasses.replace(
            self._info,
            draining=self.draining,
            lease_holder=self.leases.holder_id if self.leases.held else "",
            lease_epoch=self.leases.epoch,
            schedulers=self.leases.live_schedulers(),
            lease_claimants=self.leases.claimants(),
            loras=tuple(_adapter(info) for info in self.runner.lora_adapters()),
            compact_steps=True,  # Execute reads compact plans (pagoda/step_pb.py)
        )
        if info.group_ranks:  # the runner is the group's leader: how recently every rank met, as of now
            info = dataclasses.replace(info, group_last_contact_s=self.runner.last_contact_s())
        if request.brief:
            info = dataclasses.replace(info, tokenizer_json="", chat_template="")
        elif self.tier is not None:
            info = dataclasses.replace(info, tier_hashes=tuple(self.tier.hashes()))
        return info_to_pb(info)

    async def Acquire(self, request, context) -> executor_pb2.Lease:
        await self._check_ready(context)
        if not request.scheduler_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scheduler_id: must not be empty")
        lease = self.leases.acquire(request.scheduler_id)
        return executor_pb2.Lease(granted=lease.granted, epoch=lease.epoch, holder_id=lease.holder_id)

    async def LoadLora(self, request, context) -> common_pb2.LoraAdapter:
        """Registers an adapter on the model thread, between steps (docs/lora.md)."""
        await self._check_ready(context)
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and path: both must be set")
        if not await asyncio.to_thread(os.path.isdir, request.path):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.name!r}: no folder {request.path}")
        try:
            async with self._lock:
                info = await self.run_model(self.runner.add_lora, request.name, request.path)
        except LoraRegistryError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except LoraAdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"LoRA adapter {request.name!r}: {exc}")
        return lora_to_pb(_adapter(info))

    async def UnloadLora(self, request, context) -> executor_pb2.UnloadLoraResponse:
        """Unregisters an adapter; sequences that run with it finish first."""
        await self._check_ready(context)
        try:
            async with self._lock:
                running = await self.run_model(self.runner.remove_lora, request.name)
        except LoraRegistryError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return executor_pb2.UnloadLoraResponse(num_running=running)

    async def Execute(self, request_iterator, context):
        await self._check_ready(context)
        scheduler_id, epoch = await _lease_of(context)
        try:
            self.leases.attach(scheduler_id, epoch)
        except LeaseRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self._active_streams += 1
        peer = context.peer()
        log.info("scheduler_connected", peer=peer, scheduler_id=scheduler_id, epoch=epoch)
        try:
            async with self._lock:
                await self.run_model(self.runner.reset)
                self._request_ids.clear()
            finished_at = time.perf_counter_ns()
            first = True
            async for plan in request_iterator:
                try:
                    self.leases.check_plan(epoch, plan.epoch)
                except LeaseRefused as exc:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                received_at = time.perf_counter_ns()
                try:
                    step = plan_from_pb(plan)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {plan.step_id}: {exc}")
                result = await self._run_step(step, plan.compact_results, received_at - finished_at, received_at, first)
                first = False
                finished_at = time.perf_counter_ns()
                yield result
        finally:
            if self.tracer is not None:
                self.tracer.end_all("stream ended")
            self._active_streams -= 1
            self.leases.release(epoch)
            log.info("scheduler_disconnected", peer=peer, scheduler_id=scheduler_id, epoch=epoch)

    async def _check_ready(self, context) -> None:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is still loading its model")

    async def _run_step(
        self, step: StepPlan, compact: bool, idle_ns: int, started_ns: int, first: bool
    ) -> executor_pb2.StepResult:
        """Runs one plan; `compact`: the scheduler reads compact results."""
        wall_start_ns = time.time_ns() if self.tracer is not None else 0
        if self.tracer is not None:  # before the log lines below, which then carry the trace id
            self.tracer.on_plan(step, wall_start_ns)
        for seq_id in step.dropped_seq_ids:
            self._request_ids.pop(seq_id, None)
        for seq in step.new_seqs:
            self._request_ids[seq.seq_id] = seq.request_id
            log.info(
                "sequence_added",
                request_id=seq.request_id,
                seq_id=seq.seq_id,
                num_tokens=len(seq.token_ids),
                num_computed_tokens=seq.num_computed_tokens,
            )
        async with self._lock:
            out = await self.run_model(self.runner.execute, step)
        for err in out.errors:
            log.error(
                "sequence_failed",
                request_id=self._request_ids.pop(err.seq_id, ""),
                seq_id=err.seq_id,
                error=err.message,
            )
        step_ns = time.perf_counter_ns() - started_ns
        if self._metrics is not None:
            self._metrics.observe_step(out, step_ns, idle_ns, self.runner.num_sequences())
        if self.tracer is not None:
            self.tracer.on_step(step, out, wall_start_ns, time.time_ns())
        return result_to_pb(self._stamp(out, step_ns, idle_ns, first), compact=compact)

    def _stamp(self, out: StepResult, step_ns: int, idle_ns: int, first: bool) -> StepResult:
        """The runner's result with what only the server knows: who it is, whether it drains, its timings,
        and what the offload tier gained and lost (all it holds in the first result of a stream)."""
        timings = dataclasses.replace(out.timings, step_ns=step_ns, idle_ns=idle_ns)
        out = dataclasses.replace(out, incarnation_id=self.incarnation_id, timings=timings, draining=self.draining)
        if self.tier is None:
            return out
        if first:
            return dataclasses.replace(out, tier_added=tuple(self.tier.snapshot()), tier_reset=True)
        added, removed = self.tier.take_deltas()
        return dataclasses.replace(out, tier_added=added, tier_removed=removed) if added or removed else out


def _group_of(runner: Runner) -> dict[str, Any]:
    """What Describe reports of an executor group: its sizes and every rank, when ``runner`` is the group's leader
    (``executor_svc.parallel.group.GroupLeader``, which holds each rank's report); nothing for a plain runner,
    which leaves 1, 1 and no ranks."""
    ranks = getattr(runner, "ranks", None)
    if not ranks:
        return {}
    placement = runner.placement  # type: ignore[attr-defined]
    return {
        "tensor_parallel_size": placement.tp_size,
        "pipeline_parallel_size": placement.pp_size,
        "group_ranks": tuple(
            GroupRank(r["rank"], r["host"], r["pid"], r["shard"], r["rss_bytes"], r["kv_cache_bytes"], RANK_OK)
            for r in ranks
        ),
    }


def _adapter(info) -> LoraAdapter:
    """A registered adapter (``executor_svc.lora.registry.LoraInfo``) as the wire carries it."""
    return copy_by_name(LoraAdapter, info)


async def _lease_of(context) -> tuple[str, int]:
    """(scheduler id, epoch) from an Execute call's metadata; INVALID_ARGUMENT when the epoch is not a number."""
    metadata = dict(context.invocation_metadata() or ())
    epoch = str(metadata.get(EPOCH_KEY, "0"))
    if not epoch.isdigit():
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{EPOCH_KEY}: {epoch[:32]!r} is not a lease epoch")
    return str(metadata.get(SCHEDULER_ID_KEY, "")), int(epoch)
