"""Responses -> the client's plain result types (no protobuf in the public API)."""

from __future__ import annotations

from pagoda.v1 import common_pb2, generation_pb2
from pagoda_client.results import (
    ExecutorStatus,
    FinishReason,
    GenerationDelta,
    LogprobEntry,
    ModelInfo,
    ServerStatus,
    Timings,
    TokenLogprob,
    Usage,
)

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    generation_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generation_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


def _logprob(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token_id=pb.token_id, logprob=pb.logprob)


def delta_from_pb(pb: generation_pb2.GenerateResponse) -> GenerationDelta:
    """A ``GenerationDelta`` from one streamed response."""
    finish_reason = _FINISH_REASONS.get(pb.finish_reason)
    has_final = finish_reason is not None
    return GenerationDelta(
        request_id=pb.request_id,
        text=pb.text,
        token_ids=tuple(pb.token_ids),
        logprobs=tuple(
            LogprobEntry(sampled=_logprob(e.sampled), top=tuple(_logprob(t) for t in e.top)) for e in pb.logprobs
        ),
        finish_reason=finish_reason,
        stop_reason=pb.stop_reason,
        usage=Usage(pb.usage.prompt_tokens, pb.usage.completion_tokens, pb.usage.cached_tokens)
        if has_final or pb.HasField("usage")
        else None,
        timings=Timings(pb.timings.queue_ns / 1e9, pb.timings.time_to_first_token_ns / 1e9, pb.timings.total_ns / 1e9)
        if has_final or pb.HasField("timings")
        else None,
        prompt_token_ids=tuple(pb.prompt_token_ids),
    )


def model_info_from_pb(pb: generation_pb2.ModelInfo) -> ModelInfo:
    """A ``ModelInfo`` from its proto."""
    return ModelInfo(
        model_name=pb.model_name,
        architecture=pb.architecture,
        dtype=pb.dtype,
        max_model_len=pb.max_model_len,
        vocab_size=pb.vocab_size,
        eos_token_ids=tuple(pb.eos_token_ids),
        has_chat_template=pb.has_chat_template,
        max_prompt_tokens=pb.max_prompt_tokens,
        max_new_tokens=pb.max_new_tokens,
    )


def executor_status_from_pb(pb: generation_pb2.ExecutorStatus) -> ExecutorStatus:
    """An ``ExecutorStatus`` from its proto."""
    return ExecutorStatus(
        address=pb.address,
        incarnation_id=pb.incarnation_id,
        state=pb.state,
        num_running=pb.num_running,
        num_waiting=pb.num_waiting,
        num_kv_blocks=pb.num_kv_blocks,
        num_free_kv_blocks=pb.num_free_kv_blocks,
        kv_cache_usage=pb.kv_cache_usage,
        kernels=dict(sorted(pb.kernels.items())),
        lease_holder=pb.lease_holder,
        lease_epoch=pb.lease_epoch,
    )


def status_from_pb(pb: generation_pb2.ServerStatus) -> ServerStatus:
    """A ``ServerStatus`` from its proto."""
    return ServerStatus(
        num_running=pb.num_running,
        num_waiting=pb.num_waiting,
        kv_cache_usage=pb.kv_cache_usage,
        executors=tuple(executor_status_from_pb(e) for e in pb.executors),
        num_requests_total=pb.num_requests_total,
        num_preemptions_total=pb.num_preemptions_total,
        prefix_cache_queries_total=pb.prefix_cache_queries_total,
        prefix_cache_hits_total=pb.prefix_cache_hits_total,
        scheduler_id=pb.scheduler_id,
        schedulers=tuple(pb.schedulers),
    )


def token_ids_from_pb(pb: generation_pb2.TokenizeResponse) -> list[int]:
    """The token ids of a ``TokenizeResponse``."""
    return list(pb.token_ids)


def text_from_pb(pb: generation_pb2.DetokenizeResponse) -> str:
    """The text of a ``DetokenizeResponse``."""
    return pb.text
