"""Proto <-> engine dataclasses for the client API (the edge only).

Sampling and stopping parameters are read generically over the table
(`pagoda.params_pb.given_from_pb`): only what the client set, by name.
"""

from __future__ import annotations

from pagoda.constraint_pb import constraint_from_pb
from pagoda.params import SamplingParams, StoppingCriteria
from pagoda.params_pb import given_from_pb
from pagoda.step import FinishReason
from pagoda.step_pb import logprobs_to_pb
from pagoda.v1 import generation_pb2
from scheduler_svc.request import ChatMessage, GenerationRequest, PromptInput, RequestOutput, ResumeFrom

_FINISH_TO_PB = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generation_pb2.FINISH_REASON_ABORT,
}


def prompt_from_pb(msg: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest) -> PromptInput:
    """The oneof input of GenerateRequest / TokenizeRequest."""
    which = msg.WhichOneof("input")
    if which == "text":
        return PromptInput(text=msg.text)
    if which == "token_ids" and isinstance(msg, generation_pb2.GenerateRequest):
        return PromptInput(token_ids=tuple(msg.token_ids.token_ids))
    if which == "chat":
        messages = tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        add = msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True
        return PromptInput(messages=messages, add_generation_prompt=add)
    return PromptInput()


def request_from_pb(msg: generation_pb2.GenerateRequest, request_id: str, timeout_s: float | None) -> GenerationRequest:
    """Convert a GenerateRequest; parameters the client left unset are absent."""
    skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
    return GenerationRequest(
        request_id,
        prompt_from_pb(msg),
        sampling=given_from_pb(msg.sampling, SamplingParams),
        stopping=given_from_pb(msg.stopping, StoppingCriteria),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        skip_special_tokens=skip,
        timeout_s=timeout_s,
        resume=resume_from_pb(msg),
        structured=constraint_from_pb(msg.structured),
        lora=msg.lora,
    )


def resume_from_pb(msg: generation_pb2.GenerateRequest) -> ResumeFrom | None:
    """The resume part, when the request has one."""
    if not msg.HasField("resume"):
        return None
    return ResumeFrom(msg.resume.request_id, tuple(msg.resume.delivered_token_ids))


def output_to_pb(out: RequestOutput) -> generation_pb2.GenerateResponse:
    """One streamed delta."""
    msg = generation_pb2.GenerateResponse()
    fill_output_pb(msg, out)
    return msg


def fill_output_pb(msg: generation_pb2.GenerateResponse, out: RequestOutput) -> None:
    """Set ``msg`` (empty; a field of another message, filled in place) to one streamed delta: only the fields
    that are set, since a delta mostly carries a few tokens and their text."""
    msg.request_id = out.request_id
    msg.text = out.text
    msg.token_ids.extend(out.token_ids)
    msg.output_index = out.output_index
    if out.prompt_token_ids:
        msg.prompt_token_ids.extend(out.prompt_token_ids)
    if out.logprobs:
        msg.logprobs.extend(logprobs_to_pb(out.logprobs))
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_pb(out.prompt_logprobs))
    if out.seed is not None:
        msg.seed = out.seed
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[out.finish_reason]
        msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
    if out.usage is not None:
        msg.usage.CopyFrom(generation_pb2.Usage(**vars(out.usage)))
    if out.timings is not None:
        msg.timings.CopyFrom(generation_pb2.Timings(**vars(out.timings)))
