"""The Executor gRPC servicer: a thin edge around a Runner (the model runner, or the simulated one).

Each Execute message is converted, run on the model thread (so health checks
and the next plan's arrival proceed meanwhile), and answered with one
StepResult. All torch work runs on that one thread: torch's OpenMP thread team
belongs to the thread that calls it, so alternating between pool threads would
keep two teams spinning on the same cores.
A new Execute stream supersedes the previous one: the executor forgets every
sequence, because the scheduler that opened it resends what it wants computed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
import uuid
from collections.abc import Mapping

import grpc
import structlog

from executor_svc.metrics import ExecutorMetrics
from executor_svc.runner import Runner
from executor_svc.tokenizer_files import TokenizerFiles
from pagoda.step import ExecutorInfo, StepResult
from pagoda.step_pb import info_to_pb, plan_from_pb, result_to_pb
from pagoda.v1 import executor_pb2, executor_pb2_grpc

log = structlog.get_logger("executor")


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
        self._stream_generation = 0
        self._active_streams = 0
        self._info: ExecutorInfo | None = None
        # The kernel paths the attached runner runs (executor_svc.native.active), empty until then.
        self.kernels: dict[str, str] = {}
        # seq_id -> request_id of the sequences held, for log lines.
        self._request_ids: dict[int, str] = {}
        self._model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def run_model(self, fn, *args):
        """Runs fn(*args) on the model thread (every torch call goes there)."""
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, functools.partial(fn, *args))

    def attach(self, runner: Runner, tokenizer: TokenizerFiles, model_name: str, kernels: Mapping[str, str]) -> None:
        """Start serving `runner` (weights loaded, warm-up done), which runs the kernel paths `kernels`."""
        info = runner.info
        self.kernels = dict(kernels)
        if self._metrics is not None:
            self._metrics.set_kernels(self.kernels)
        self._info = ExecutorInfo(
            incarnation_id=self.incarnation_id,
            model_name=model_name,
            architecture=info.architecture,
            dtype=info.dtype,
            kv_cache_dtype=info.kv_cache_dtype,
            device=info.device,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(tokenizer.eos_token_ids or info.eos_token_ids),
            tokenizer_json=tokenizer.tokenizer_json,
            chat_template=tokenizer.chat_template or "",
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            kernels=tuple(sorted(self.kernels.items())),
        )
        self.runner = runner

    @property
    def has_active_stream(self) -> bool:
        """Whether a scheduler is connected."""
        return self._active_streams > 0

    async def Describe(self, request, context) -> executor_pb2.ExecutorInfo:
        await self._check_ready(context)
        assert self._info is not None  # set with the runner
        return info_to_pb(dataclasses.replace(self._info, draining=self.draining))

    async def Execute(self, request_iterator, context):
        await self._check_ready(context)
        self._stream_generation += 1
        generation = self._stream_generation
        self._active_streams += 1
        peer = context.peer()
        log.info("scheduler_connected", peer=peer, generation=generation)
        try:
            async with self._lock:
                await self.run_model(self.runner.reset)
                self._request_ids.clear()
            finished_at = time.perf_counter_ns()
            async for plan in request_iterator:
                if generation != self._stream_generation:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "superseded by a newer Execute stream")
                received_at = time.perf_counter_ns()
                result = await self._run_step(plan, idle_ns=received_at - finished_at, started_ns=received_at)
                finished_at = time.perf_counter_ns()
                yield result
        finally:
            self._active_streams -= 1
            log.info("scheduler_disconnected", peer=peer, generation=generation)

    async def _check_ready(self, context) -> None:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is still loading its model")

    async def _run_step(self, plan: executor_pb2.StepPlan, idle_ns: int, started_ns: int) -> executor_pb2.StepResult:
        step = plan_from_pb(plan)
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
        return result_to_pb(self._stamp(out, step_ns, idle_ns))

    def _stamp(self, out: StepResult, step_ns: int, idle_ns: int) -> StepResult:
        """The runner's result with what only the server knows: who it is, whether it drains, its timings."""
        timings = dataclasses.replace(out.timings, step_ns=step_ns, idle_ns=idle_ns)
        return dataclasses.replace(out, incarnation_id=self.incarnation_id, timings=timings, draining=self.draining)
