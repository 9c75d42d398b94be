"""Responses -> the client's plain result types (no protobuf in the public API)."""

from __future__ import annotations

from pagoda.by_name import copy_by_name
from pagoda.step_pb import logprobs_from_pb
from pagoda.v1 import generation_pb2
from pagoda_client.results import ExecutorStatus, FinishReason, GenerationDelta, ModelInfo, ServerStatus, Timings, Usage

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    generation_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generation_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}


def delta_from_pb(pb: generation_pb2.GenerateResponse) -> GenerationDelta:
    """A ``GenerationDelta`` from one streamed response."""
    finish_reason = _FINISH_REASONS.get(pb.finish_reason)
    has_final = finish_reason is not None
    return GenerationDelta(
        request_id=pb.request_id,
        text=pb.text,
        token_ids=tuple(pb.token_ids),
        logprobs=logprobs_from_pb(pb.logprobs),
        finish_reason=finish_reason,
        stop_reason=pb.stop_reason,
        usage=Usage(
            pb.usage.prompt_tokens, pb.usage.completion_tokens, pb.usage.cached_tokens, pb.usage.cached_tokens_offloaded
        )
        if has_final or pb.HasField("usage")
        else None,
        timings=Timings(pb.timings.queue_ns / 1e9, pb.timings.time_to_first_token_ns / 1e9, pb.timings.total_ns / 1e9)
        if has_final or pb.HasField("timings")
        else None,
        prompt_token_ids=tuple(pb.prompt_token_ids),
        output_index=pb.output_index,
        seed=pb.seed if pb.HasField("seed") else None,
        prompt_logprobs=logprobs_from_pb(pb.prompt_logprobs) if pb.prompt_logprobs else (),
    )


def model_info_from_pb(pb: generation_pb2.ModelInfo) -> ModelInfo:
    """A ``ModelInfo`` from its proto."""
    return copy_by_name(ModelInfo, pb)


def executor_status_from_pb(pb: generation_pb2.ExecutorStatus) -> ExecutorStatus:
    """An ``ExecutorStatus`` from its proto (kernels sorted by name)."""
    return copy_by_name(ExecutorStatus, pb, kernels=dict(sorted(pb.kernels.items())))


def status_from_pb(pb: generation_pb2.ServerStatus) -> ServerStatus:
    """A ``ServerStatus`` from its proto."""
    return copy_by_name(ServerStatus, pb, executors=tuple(executor_status_from_pb(e) for e in pb.executors))


def token_ids_from_pb(pb: generation_pb2.TokenizeResponse) -> list[int]:
    """The token ids of a ``TokenizeResponse``."""
    return list(pb.token_ids)


def text_from_pb(pb: generation_pb2.DetokenizeResponse) -> str:
    """The text of a ``DetokenizeResponse``."""
    return pb.text
