"""The Generation gRPC servicer: the client API's edge over the Engine.

Converts protos, maps engine errors onto gRPC statuses, and carries the request
id (field, `x-request-id` metadata, or a fresh one) into every log line.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from pagoda.by_name import copy_by_name
from pagoda.runtime.grpc_server import Context
from pagoda.step_pb import lora_to_pb
from pagoda.tracing import traceparent_in
from pagoda.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from scheduler_svc.api import convert
from scheduler_svc.api.streams import StreamFailed, StreamMux, generate_outputs, status_of
from scheduler_svc.core.config import DraftSource
from scheduler_svc.engine import Engine
from scheduler_svc.errors import (
    RequestError,
)
from scheduler_svc.fleet.executor_handle import ExecutorHandle
from scheduler_svc.text.tokenizer import Tokenizer

log = structlog.get_logger("scheduler")


def request_id_of(request_id: str, context: Context) -> str:
    """The client's id (field, then metadata), else a new one."""
    if request_id:
        return request_id
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and value:
            return str(value)[:256]
    return uuid.uuid4().hex


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generate, model info, tokenize/detokenize, status, and loading LoRA adapters."""

    def __init__(self, engine: Engine, max_message_bytes: int = 4 * 2**20) -> None:
        """``max_message_bytes``: the server's message size limit (``--max-message-bytes``)."""
        self.engine = engine
        self.max_message_bytes = max_message_bytes

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = request_id_of(request.request_id or request.resume.request_id, context)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            traceparent = traceparent_in(context.invocation_metadata() or ())
            async for out in generate_outputs(self.engine, request, request_id, context.time_remaining(), traceparent):
                yield convert.output_to_pb(out)
        except StreamFailed as exc:
            await context.abort(exc.code, exc.message)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def GenerateStreams(
        self, requests: AsyncIterator[generation_pb2.StreamRequest], context: Context
    ) -> AsyncIterator[generation_pb2.StreamResponses]:
        # At once: a client writes its streams' requests once it has the server's answer (client/multiplex.py).
        await context.send_initial_metadata(())
        async for message in StreamMux(self.engine, requests, self.max_message_bytes).run():
            yield message

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: Context
    ) -> generation_pb2.ModelInfo:
        model, limits = self.engine.model, self.engine.limits
        if model is None or limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor has connected yet")
        # The limits' max_model_len (the effective one) over the executor's; the rest by name from either.
        return copy_by_name(
            generation_pb2.ModelInfo,
            limits,
            model,
            has_chat_template=bool(model.chat_template),
            loras=[lora_to_pb(a) for a in self.engine.lora_adapters()],
        )

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: Context
    ) -> generation_pb2.TokenizeResponse:
        tokenizer = await self._tokenizer(context)
        prompt = convert.prompt_from_pb(request)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            if prompt.messages is not None:
                messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt.add_generation_prompt)
            elif prompt.text is not None:
                ids = tokenizer.encode(prompt.text, add_special_tokens=add_special)
            else:
                raise ValueError("set text or chat")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return generation_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: generation_pb2.DetokenizeRequest, context: Context
    ) -> generation_pb2.DetokenizeResponse:
        tokenizer = await self._tokenizer(context)
        bad = next((t for t in request.token_ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: {bad} is outside the vocabulary")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return generation_pb2.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids), skip))

    async def GetStatus(
        self, request: generation_pb2.GetStatusRequest, context: Context
    ) -> generation_pb2.ServerStatus:
        return status_to_pb(self.engine)

    async def LoadLoraAdapter(
        self, request: generation_pb2.LoadLoraAdapterRequest, context: Context
    ) -> common_pb2.LoraAdapter:
        try:
            adapter = await self.engine.load_lora(request.name, request.path)
        except RequestError as exc:
            log.info("lora_load_refused", name=request.name, status=status_of(exc).name, error=str(exc))
            await context.abort(status_of(exc), str(exc))
        return lora_to_pb(adapter)

    async def UnloadLoraAdapter(
        self, request: generation_pb2.UnloadLoraAdapterRequest, context: Context
    ) -> generation_pb2.UnloadLoraAdapterResponse:
        try:
            await self.engine.unload_lora(request.name)
        except RequestError as exc:
            log.info("lora_unload_refused", name=request.name, status=status_of(exc).name, error=str(exc))
            await context.abort(status_of(exc), str(exc))
        return generation_pb2.UnloadLoraAdapterResponse()

    async def _tokenizer(self, context: Context) -> Tokenizer:
        if self.engine.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor has connected yet")
        return self.engine.tokenizer


# ExecutorStatus fields that are the executor's Describe, as it is (empty until it has described itself).
_DESCRIBED = (
    "incarnation_id",
    "kv_cache_dtype",
    "quantization",
    "draft_model",
    "kv_offload",
    "batch_invariant",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)


def status_to_pb(engine: Engine) -> generation_pb2.ServerStatus:
    """Queues, KV usage and executors (held or only seen), summed over the executors held.

    The totals named alike in the engine's metrics (its plain GetStatus counters) are copied by name; a field
    neither given here nor a metric is an error, so a new one cannot go out unfilled.
    """
    executors = [executor_status_to_pb(engine, executor) for executor in engine.executors.values()]
    total = sum(e.num_kv_blocks for e in executors)
    used = sum(e.num_kv_blocks - e.num_free_kv_blocks for e in executors)
    m = engine.metrics
    return copy_by_name(
        generation_pb2.ServerStatus,
        m,
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        kv_cache_usage=used / total if total else 0.0,
        executors=executors,
        spec_num_drafts_total=m.spec_total(0),
        spec_draft_tokens_total=m.spec_total(1),
        spec_accepted_tokens_total=m.spec_total(2),
        spec_model_num_drafts_total=m.spec_total(0, DraftSource.MODEL),
        spec_model_draft_tokens_total=m.spec_total(1, DraftSource.MODEL),
        spec_model_accepted_tokens_total=m.spec_total(2, DraftSource.MODEL),
        scheduler_id=engine.scheduler_id,
        schedulers=engine.fleet.ownership.live_schedulers(),
    )


def executor_status_to_pb(engine: Engine, executor: ExecutorHandle) -> generation_pb2.ExecutorStatus:
    """One executor: what it described, and its queues and blocks while this scheduler drives it (a field
    left out reads as empty or 0)."""
    holder, epoch = (
        (engine.scheduler_id, executor.epoch) if executor.driving else (executor.view.holder_id, executor.view.epoch)
    )
    fields: dict[str, Any] = {
        "address": executor.address,
        "state": executor.state.value,
        "lease_holder": holder,
        "lease_epoch": epoch,
        # An executor group's ranks, live: as its leader's last heartbeat answer gave them.
        "group_ranks": [copy_by_name(generation_pb2.GroupRankStatus, r) for r in executor.group_ranks],
        "group_last_contact_s": executor.group_last_contact_s,
    }
    if (info := executor.info) is not None:
        fields |= {name: getattr(info, name) for name in _DESCRIBED} | {
            "kernels": dict(info.kernels),
            "loras": list(executor.loras),
        }
    if (s := executor.scheduler) is not None:
        fields |= {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_kv_blocks": s.config.num_blocks,
            "num_free_kv_blocks": s.kv.num_free_blocks,
            "kv_cache_usage": s.kv.usage,
            "num_tier_blocks": len(s.tier) if s.tier is not None else 0,
        }
    return generation_pb2.ExecutorStatus(**fields)
