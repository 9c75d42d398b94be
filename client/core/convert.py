"""Responses -> the client's plain result types (no protobuf in the public API)."""

from __future__ import annotations

import sys
from typing import Any, TypeVar

from google.protobuf.message import Message

from pagoda.by_name import copy_by_name
from pagoda.step_pb import logprobs_from_pb, lora_from_pb
from pagoda.v1 import generation_pb2
from pagoda_client.results import FinishReason, GenerationDelta, ModelInfo, ServerStatus, Timings, Usage

T = TypeVar("T")

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
    return copy_by_name(ModelInfo, pb, loras=tuple(lora_from_pb(a) for a in pb.loras))


def status_from_pb(pb: generation_pb2.ServerStatus) -> ServerStatus:
    """A ``ServerStatus`` from its proto (each executor's kernels sorted by name)."""
    return message_from_pb(ServerStatus, pb)


def message_from_pb(cls: type[T], pb: Message) -> T:
    """A dataclass rendered from ``pb``'s message (``scripts/gen_client_status.py``), field by field by name.

    A map becomes a dict sorted by key, a repeated field a tuple, an unset proto3 ``optional`` scalar None, and
    a message the dataclass of its name in ``cls``'s module (where the generator renders it).
    """
    module = sys.modules[cls.__module__]
    given = {f.name: _value(module, pb, f) for f in pb.DESCRIPTOR.fields if f.message_type or f.has_presence}
    return copy_by_name(cls, pb, **given)


def _value(module: Any, pb: Message, f: Any) -> Any:
    """The Python value of ``pb``'s field ``f`` (a FieldDescriptor, of either protobuf backend) that is a message,
    a map or a scalar with presence."""
    value = getattr(pb, f.name)
    if f.message_type is None:
        return value if pb.HasField(f.name) else None
    if f.message_type.GetOptions().map_entry:
        inner = f.message_type.fields_by_name["value"].message_type
        if inner is None:
            return dict(sorted(value.items()))
        return {k: message_from_pb(getattr(module, inner.name), v) for k, v in sorted(value.items())}
    if f.is_repeated:
        return tuple(message_from_pb(getattr(module, f.message_type.name), m) for m in value)
    return message_from_pb(getattr(module, f.message_type.name), value)


def token_ids_from_pb(pb: generation_pb2.TokenizeResponse) -> list[int]:
    """The token ids of a ``TokenizeResponse``."""
    return list(pb.token_ids)


def text_from_pb(pb: generation_pb2.DetokenizeResponse) -> str:
    """The text of a ``DetokenizeResponse``."""
    return pb.text
