"""The engine: admits requests, places them on executors, streams outputs.

It owns the per-request state and the recovery rule: sequences of a lost (or
released) executor are placed again, with what they generated so far, on one
this scheduler drives. Its Fleet holds one ExecutorHandle (and so one
scheduler core and block pool) per executor address and decides, with the
other schedulers, which executors this one drives. A request with no executor
here ends with UNAVAILABLE after ORPHAN_TIMEOUT_S when other schedulers are
live (its client resumes it there); alone, it waits. Both client edges (gRPC,
HTTP) call `generate`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import socket
import time
from collections.abc import AsyncGenerator, Callable

import grpc
import structlog

from pagoda.runtime.deadline import within
from pagoda.runtime.shared_settings import lora_specs
from pagoda.step import ExecutorInfo, FinishReason, LoraAdapter, StepPlan, StepResult
from scheduler_svc.api import validation
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import SeqUpdate
from scheduler_svc.core.sequence import SchedulerSequence
from scheduler_svc.errors import DeadlineExceeded, InvalidRequest, Overloaded, Unavailable
from scheduler_svc.fleet.executor_handle import ExecutorHandle
from scheduler_svc.fleet.fleet import Fleet
from scheduler_svc.fleet.loras import LoraCatalog, check_name
from scheduler_svc.fleet.ownership import ORPHAN_TIMEOUT_S
from scheduler_svc.fleet.router import choose_executor
from scheduler_svc.obs.metrics import SchedulerMetrics
from scheduler_svc.obs.request_trace import RequestTracer
from scheduler_svc.request import GenerationRequest, PromptInput, RequestOutput
from scheduler_svc.text.output_processor import RequestState
from scheduler_svc.text.tokenizer import Tokenizer

log = structlog.get_logger("scheduler")


class Engine:
    """Requests in, token streams out, over any number of executors."""

    def __init__(
        self,
        config: SchedulerServiceConfig,
        metrics: SchedulerMetrics | None = None,
        executor_credentials: grpc.ChannelCredentials | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.config = config
        # Spans of sampled requests (docs/tracing.md); None when tracing is off: every hook is skipped.
        self.tracer = tracer
        self.metrics = metrics or SchedulerMetrics()
        self.metrics.bind_gauges(self)
        self.fleet = Fleet(config, self, self._scheduler_config, executor_credentials)
        self.fleet.on_tick = self._on_heartbeat
        self.executors: dict[str, ExecutorHandle] = self.fleet.executors
        # LoRA adapters: which executor has which; those to load on every executor (docs/lora.md).
        self.loras = LoraCatalog(
            self.executors, lora_specs(config.lora), on_loaded=self._place_orphans, in_use=self._loras_in_use
        )
        self.model: ExecutorInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.limits: validation.Limits | None = None
        self.draining = False
        self.on_health_change: Callable[[bool], None] = lambda serving: None
        self._requests: dict[int, RequestState] = {}
        # Streams not woken for their executor's last step (released at its next one).
        self._held: dict[ExecutorHandle, list[RequestState]] = {}
        # Sequences without an executor here -> since when (monotonic seconds).
        self._orphans: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._seq_ids = itertools.count(1)
        self._model_ready = asyncio.Event()
        self._serving = False

    # ----- lifecycle -------------------------------------------------------

    @property
    def scheduler_id(self) -> str:
        """This scheduler's id in the executors' leases."""
        return self.fleet.scheduler_id

    async def start(self, scheduler_id: str = "") -> None:
        """Discover the executors and start heartbeats (id: `scheduler_id`, else the config's, else host:port)."""
        default_id = f"{socket.gethostname()}:{self.config.port}"
        await self.fleet.start(scheduler_id or self.config.scheduler_id or default_id)

    async def stop(self) -> None:
        """Release every executor (what still runs there goes back to the orphans)."""
        await self.fleet.stop()

    async def drain(self, timeout_s: float) -> None:
        """Admit nothing new; wait for in-flight requests up to timeout_s; end the rest with UNAVAILABLE."""
        self.draining = self.fleet.draining = True
        self._update_health()
        deadline = time.monotonic() + timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for state in list(self._requests.values()):
            self.abort(state)
            state.fail(FinishReason.ABORT, "the scheduler is shutting down; resume on another scheduler")

    def _scheduler_config(self, info: ExecutorInfo) -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self._max_model_len(info),
            enable_prefix_caching=self.config.enable_prefix_caching,
            eos_token_ids=tuple(info.eos_token_ids),
            speculative=self._speculative(info),
            num_speculative_tokens=self.config.num_speculative_tokens,
            speculative_max_batch=self.config.speculative_max_batch,
            speculative_adaptive=self.config.speculative_adaptive,
            kv_offload=self.config.kv_offload and bool(info.kv_offload),
            rope_switch_len=info.rope_switch_len,
            max_loras=info.max_loras,
        )

    def _speculative(self, info: ExecutorInfo) -> str:
        """The speculation method for an executor: without a draft model, what of --speculative is left."""
        method = self.config.speculative
        if method not in ("draft", "ngram+draft") or info.draft_model:
            return method
        fallback = "ngram" if method == "ngram+draft" else "off"
        log.warning(
            "executor_without_draft_model",
            incarnation_id=info.incarnation_id,
            speculative=method,
            using=fallback,
            hint="start the executor with --draft-model",
        )
        return fallback

    def _max_model_len(self, info: ExecutorInfo) -> int:
        cap = self.config.max_model_len
        return min(info.max_model_len, cap) if cap else info.max_model_len

    # ----- health ----------------------------------------------------------

    @property
    def is_serving(self) -> bool:
        """At least one executor accepts work and we are not draining."""
        return not self.draining and any(e.accepts_new for e in self.executors.values())

    def _check_can_serve(self) -> None:
        """UNAVAILABLE at once when this scheduler drives no executor and another scheduler is live."""
        if not any(e.accepts_new for e in self.executors.values()) and self.fleet.ownership.others_live():
            raise Unavailable(f"scheduler {self.scheduler_id} holds no executor now; try another scheduler")

    def _on_heartbeat(self) -> None:
        """After each heartbeat round: wanted LoRA adapters to executors that lack them; end old orphans when
        another scheduler can take them; health."""
        self.loras.tick()
        if self._orphans and self.fleet.ownership.others_live():
            now = time.monotonic()
            for seq_id, since in list(self._orphans.items()):
                state = self._requests.get(seq_id)
                if now - since >= ORPHAN_TIMEOUT_S and state is not None:
                    del self._orphans[seq_id]
                    log.warning("request_orphan_ended", request_id=state.request_id, waited_s=round(now - since, 1))
                    state.fail(FinishReason.ABORT, "no executor here; resume on another scheduler")
        self._update_health()

    def _update_health(self) -> None:
        serving = self.is_serving
        if serving != self._serving:
            self._serving = serving
            log.info("health_changed", serving=serving)
            self.on_health_change(serving)

    # ----- requests --------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Validate, admit and stream one request; cancelling the iterator aborts it."""
        validation.check_request_fields(request)
        if self.draining:
            raise Unavailable("the server is shutting down")
        self._check_can_serve()
        arrival_ns = time.monotonic_ns()
        deadline = time.monotonic() + (request.timeout_s or self.config.request_timeout_s)
        await self._wait_for_model(deadline)
        state = self._admit(request, arrival_ns)
        self._log_admitted(state, resumed=request.resume is not None)
        # One timer for the whole request, not one per response.
        timer = asyncio.get_running_loop().call_later(max(deadline - time.monotonic(), 0.0), state.pending.expire)
        try:
            while True:
                try:
                    out = await state.next_output()
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"request timed out after {request.timeout_s or self.config.request_timeout_s}s"
                    ) from None
                yield out
                if out.finished:
                    return
        finally:
            timer.cancel()
            self._release(state)

    async def _wait_for_model(self, deadline: float) -> None:
        if self._model_ready.is_set():
            return
        try:
            async with within(deadline - time.monotonic()):
                await self._model_ready.wait()
        except asyncio.TimeoutError:
            raise Unavailable("no executor has connected yet") from None

    def _admit(self, request: GenerationRequest, arrival_ns: int) -> RequestState:
        assert self.limits is not None and self.tokenizer is not None and self.model is not None
        token_ids = self._tokenize(request.prompt)
        validation.check_prompt_tokens(token_ids, self.limits)
        sampling = validation.sampling_params(request.sampling, self.limits)
        stopping = validation.stopping_criteria(request.stopping, len(token_ids), self.limits)
        validation.check_structured(request.structured)
        if request.lora:
            self.loras.check_known(request.lora)
        delivered: tuple[int, ...] = ()
        if request.resume is not None:
            validation.check_resume(request.resume, len(token_ids), stopping, self.limits)
            delivered = request.resume.delivered_token_ids
        if self.num_waiting >= self.config.max_waiting_requests:
            self.metrics.rejected.inc()
            raise Overloaded(f"{self.num_waiting} requests are waiting (limit {self.config.max_waiting_requests})")
        seq = SchedulerSequence(
            seq_id=next(self._seq_ids),
            request_id=request.request_id,
            prompt_token_ids=list(token_ids),
            sampling=sampling,
            stopping=stopping,
            priority=request.priority,
            cache_salt=request.cache_salt,
            arrival_time_s=arrival_ns / 1e9,
            output_token_ids=delivered,
            structured=request.structured,
            lora_name=request.lora,
        )
        self._check_fits(seq)
        if self.tracer is not None:
            self.tracer.start(request, seq)
        state = RequestState(seq, self.tokenizer, request.skip_special_tokens, arrival_ns)
        self._requests[seq.seq_id] = state
        self.metrics.on_admitted(len(token_ids))
        if state.replay(tuple(self.model.eos_token_ids), self.limits.max_model_len):
            self.metrics.on_finished(state, seq.finish_reason or FinishReason.STOP)
        else:
            self._place(state)
        return state

    def _log_admitted(self, state: RequestState, resumed: bool) -> None:
        seq = state.seq
        fields = {"request_id": seq.request_id, "seq_id": seq.seq_id, "num_prompt_tokens": seq.num_prompt_tokens}
        if not resumed:
            log.info("request_admitted", max_tokens=seq.stopping.max_tokens, **fields)
            return
        scheduler = state.executor.scheduler if state.executor is not None else None
        cached = (
            scheduler.peek_prefix_hit_tokens(seq.token_ids, seq.cache_salt, seq.lora_fingerprint)
            if scheduler is not None
            else 0
        )
        log.info(
            "request_resumed",
            num_delivered=len(seq.output_token_ids),
            num_cached_tokens=cached,
            finished=state.finished,
            **fields,
        )

    def _tokenize(self, prompt: PromptInput) -> list[int]:
        assert self.tokenizer is not None
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.text is not None:
            return self.tokenizer.encode(prompt.text, add_special_tokens=True)
        messages = [m.template_fields() for m in prompt.messages or ()]
        tools = json.loads(prompt.tools_json) if prompt.tools_json else None
        try:
            return self.tokenizer.apply_chat_template(messages, prompt.add_generation_prompt, tools)
        except ValueError as exc:
            raise InvalidRequest("chat", str(exc)) from None

    def _check_fits(self, seq: SchedulerSequence) -> None:
        live = [e.scheduler for e in self.executors.values() if e.scheduler is not None]
        if live and not any(s.can_fit(seq.num_prompt_tokens, seq.stopping.max_tokens) for s in live):
            raise InvalidRequest(
                "stopping.max_tokens",
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.stopping.max_tokens}) needs more KV cache than an executor has",
            )

    def _place(self, state: RequestState) -> None:
        """Queue the sequence on the best executor, or keep it until one is ready."""
        seq = state.seq
        try:
            executors = list(self.executors.values())
            pack = _behind(executors)
            if seq.lora_name:  # only executors with its adapter, with the same weights
                executors, seq.lora_fingerprint = self.loras.holders(seq.lora_name, seq.lora_fingerprint)
                if not executors and seq.lora_name not in self.loras.wanted:
                    self._orphans.pop(seq.seq_id, None)
                    state.fail(FinishReason.ERROR, f"LoRA adapter {seq.lora_name!r} was unloaded: no executor has it")
                    return
            executor, hit = choose_executor(executors, seq.token_ids, seq.cache_salt, pack, seq.lora_fingerprint)
        except LookupError:
            state.executor = None
            self._orphans.setdefault(state.seq.seq_id, time.monotonic())
            return
        self._orphans.pop(state.seq.seq_id, None)
        try:
            executor.add(state.seq)
        except ValueError as exc:  # executors with smaller pools than the one it was admitted for
            state.executor = None
            state.fail(FinishReason.ERROR, str(exc))
            return
        state.executor = executor
        log.debug("request_routed", request_id=state.request_id, executor=executor.address, prefix_hit_tokens=hit)

    def abort(self, state: RequestState) -> None:
        """Stop computing for a request (cancelled, timed out, or shutting down)."""
        self._orphans.pop(state.seq.seq_id, None)
        executor = state.executor
        if executor is not None and executor.scheduler is not None:
            executor.scheduler.abort(state.seq.seq_id)
            executor.wake()

    def _release(self, state: RequestState) -> None:
        if not state.finished:
            self.abort(state)
            state.finished = True
            self.metrics.on_finished(state, FinishReason.ABORT)
            log.info("request_aborted", request_id=state.request_id)
        self._requests.pop(state.seq.seq_id, None)
        if self.tracer is not None:
            self.tracer.end(state.seq, state.finish_reason or FinishReason.ABORT)

    # ----- LoRA adapters ---------------------------------------------------

    def lora_adapters(self) -> tuple[LoraAdapter, ...]:
        """The adapters requests may name now, by name."""
        return self.loras.adapters()

    async def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Registers a PEFT adapter on every executor (and on those that come later); see LoraCatalog.load."""
        check_name(name, self.model.model_name if self.model is not None else "")
        return await self.loras.load(name, path)

    async def unload_lora(self, name: str) -> None:
        """Unregisters an adapter everywhere; requests admitted with it finish first. NotFound: unknown."""
        self.loras.unload(name)

    def _loras_in_use(self) -> set[str]:
        return {state.seq.lora_name for state in self._requests.values() if state.seq.lora_name}

    @property
    def num_waiting(self) -> int:
        """Requests not yet running anywhere (queued or without an executor)."""
        queued = sum(e.scheduler.num_waiting for e in self.executors.values() if e.scheduler is not None)
        return queued + len(self._orphans)

    @property
    def num_running(self) -> int:
        return sum(e.scheduler.num_running for e in self.executors.values() if e.scheduler is not None)

    # ----- ExecutorListener --------------------------------------------------

    def on_executor_described(self, executor: ExecutorHandle, info: ExecutorInfo) -> bool:
        """Learn the model from the first executor described; refuse executors that serve another one."""
        self.metrics.on_executor_described(executor.address, info.incarnation_id)
        if self.model is None:
            self._set_model(info)
        elif (info.model_name, info.vocab_size) != (self.model.model_name, self.model.vocab_size):
            log.error(
                "executor_model_mismatch",
                executor=executor.address,
                model=info.model_name,
                expected=self.model.model_name,
            )
            return False
        elif info.batch_invariant != self.model.batch_invariant:
            # Served, but a request that moves between the two (failover, rebalancing) may change its tokens.
            log.warning(
                "executor_batch_invariance_differs",
                executor=executor.address,
                batch_invariant=info.batch_invariant,
                first_executor=self.model.batch_invariant,
                hint="start every executor with the same --batch-invariant",
            )
        return True

    def on_executor_ready(self, executor: ExecutorHandle, info: ExecutorInfo) -> None:
        self._place_orphans()
        self._update_health()

    def _place_orphans(self) -> None:
        """Tries again to place each request that waits for an executor (one came, or got an adapter)."""
        for seq_id in list(self._orphans):
            state = self._requests.get(seq_id)
            if state is not None:
                self._place(state)

    def _set_model(self, info: ExecutorInfo) -> None:
        self.model = info
        self.tokenizer = Tokenizer.from_info(
            info.tokenizer_json, info.chat_template or None, info.bos_token or None, info.eos_token or None
        )
        max_len = self._max_model_len(info)
        self.limits = validation.Limits(
            max_model_len=max_len,
            vocab_size=info.vocab_size,
            max_prompt_tokens=min(self.config.max_prompt_tokens or max_len - 1, max_len - 1),
            max_new_tokens=self.config.max_new_tokens,
            default_max_tokens=self.config.default_max_tokens,
            max_stop_strings=self.config.max_stop_strings,
            max_stop_string_len=self.config.max_stop_string_len,
            max_logprobs=self.config.max_logprobs,
        )
        self._model_ready.set()
        log.info("model_known", model=info.model_name, max_model_len=max_len, vocab_size=info.vocab_size)

    def on_step(self, executor: ExecutorHandle, plan: StepPlan, result: StepResult, duration_s: float) -> None:
        now = time.monotonic_ns()
        for new in plan.new_seqs:
            state = self._requests.get(new.seq_id)
            if state is not None and state.first_scheduled_ns is None:
                state.first_scheduled_ns = now
        if executor.scheduler is not None:
            self.metrics.on_step(plan, result, duration_s, executor.scheduler)
        if self.tracer is not None:
            self.tracer.on_step(executor.address, plan, duration_s)
        if result.draining:
            self._update_health()

    def on_updates(self, executor: ExecutorHandle, updates: list[SeqUpdate], result: StepResult) -> None:
        """One step's tokens to their streams; the step's token metrics at once.

        When the executor's next result is already waiting (this scheduler is its bottleneck), a
        stream that has its first response is not woken for this step's tokens: they leave with the
        next step's, one response instead of two (docs/durability.md section 5). What was held at the
        last step is released now, so nothing waits more than one step.
        """
        held = self._held.pop(executor, ())
        hold = executor.behind and not held
        tokens = self.metrics.step_tokens()
        holding = []
        for update in updates:
            state = self._requests.get(update.seq.seq_id)
            if state is None or state.finished:
                continue
            num_queued = state.num_queued_tokens
            stop = state.on_update(update, hold)
            if state.pending.holding:
                holding.append(state)
            if stop is not None and executor.scheduler is not None:
                executor.scheduler.finish(update.seq.seq_id, FinishReason.STOP)
            tokens.add(state, state.num_queued_tokens - num_queued)
            if state.finished:
                reason = FinishReason.STOP if stop is not None else update.seq.finish_reason or FinishReason.STOP
                if reason is FinishReason.ERROR:
                    log.error("sequence_failed", request_id=state.request_id, error=update.seq.error_message)
                self.metrics.on_finished(state, reason)
        tokens.observe()
        for state in held:
            state.pending.release()
        if holding:
            self._held[executor] = holding
        if updates:
            executor.wake()

    def on_executor_lost(self, executor: ExecutorHandle, seqs: list[SchedulerSequence]) -> None:
        for held in self._held.pop(executor, ()):
            held.pending.release()
        if self.tracer is not None:
            self.tracer.on_executor_lost(executor.address, seqs)
        moved = 0
        for seq in seqs:
            state = self._requests.get(seq.seq_id)
            if state is not None and not state.finished:
                self._place(state)
                moved += 1
        if moved:
            log.warning(
                "sequences_moved",
                from_executor=executor.address,
                num_sequences=moved,
                num_without_executor=len(self._orphans),
            )
        self._update_health()


def _behind(executors: list[ExecutorHandle]) -> bool:
    """Whether this scheduler holds back most of the executors it drives (new requests are then packed)."""
    driven = [e for e in executors if e.accepts_new]
    return len(driven) > 1 and 2 * sum(e.behind for e in driven) > len(driven)
