"""Proto <-> engine dataclasses for the client API (the edge only)."""

from __future__ import annotations

from pagoda.v1 import common_pb2, generation_pb2
from scheduler_svc.request import (
    ChatMessage,
    GenerationRequest,
    PromptInput,
    RequestOutput,
    SamplingOptions,
    StoppingOptions,
)
from scheduler_svc.types import FinishReason

_FINISH_TO_PB = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generation_pb2.FINISH_REASON_ABORT,
}


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def prompt_from_pb(msg) -> PromptInput:
    """The oneof input of GenerateRequest / TokenizeRequest."""
    which = msg.WhichOneof("input")
    if which == "text":
        return PromptInput(text=msg.text)
    if which == "token_ids":
        return PromptInput(token_ids=tuple(msg.token_ids.token_ids))
    if which == "chat":
        messages = tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        add = msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True
        return PromptInput(messages=messages, add_generation_prompt=add)
    return PromptInput()


def request_from_pb(msg: generation_pb2.GenerateRequest, request_id: str, timeout_s: float | None) -> GenerationRequest:
    """Convert a GenerateRequest; unset optional fields stay None."""
    s, st = msg.sampling, msg.stopping
    sampling = SamplingOptions(
        *(
            _opt(s, n)
            for n in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "seed",
                "logprobs",
            )
        )
    )
    stopping = StoppingOptions(
        max_tokens=_opt(st, "max_tokens"),
        stop=tuple(st.stop),
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        include_stop_str_in_output=st.include_stop_str_in_output,
    )
    skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
    return GenerationRequest(
        request_id, prompt_from_pb(msg), sampling, stopping, msg.priority, msg.cache_salt, skip, timeout_s
    )


def output_to_pb(out: RequestOutput) -> generation_pb2.GenerateResponse:
    """One streamed delta."""
    msg = generation_pb2.GenerateResponse(
        request_id=out.request_id,
        text=out.text,
        token_ids=out.token_ids,
        prompt_token_ids=out.prompt_token_ids,
        logprobs=[
            common_pb2.LogprobEntry(
                sampled=common_pb2.TokenLogprob(token_id=e.sampled.token_id, logprob=e.sampled.logprob),
                top=[common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in e.top],
            )
            for e in out.logprobs
        ],
    )
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[out.finish_reason]
        msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
    if out.usage is not None:
        msg.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=out.usage.prompt_tokens,
                completion_tokens=out.usage.completion_tokens,
                cached_tokens=out.usage.cached_tokens,
            )
        )
    if out.timings is not None:
        msg.timings.CopyFrom(
            generation_pb2.Timings(
                queue_ns=out.timings.queue_ns,
                time_to_first_token_ns=out.timings.time_to_first_token_ns,
                total_ns=out.timings.total_ns,
            )
        )
    return msg
