"""A client request as the engine sees it, and what the engine streams back.

The gRPC edge (and the HTTP edge) fill `GenerationRequest`. Its sampling and
stopping parameters are what the client gave, by table name (`pagoda.params`):
a field the client left unset is absent, and `api/validation.py` applies the
table's default and checks the rest.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from pagoda.constraint import Constraint
from pagoda.step import FinishReason, LogprobEntry

# Parameter values a client set, by name (one group of pagoda.params' table).
GivenParams = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One message of a chat prompt."""

    role: str
    content: str
    # An assistant message's tool calls, OpenAI's list as JSON text ("" for none).
    tool_calls_json: str = ""
    # A tool message's answer to this call id.
    tool_call_id: str = ""

    def template_fields(self) -> dict[str, Any]:
        """The message as a chat template reads it (Hugging Face's shape: tool_calls, tool_call_id)."""
        fields: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls_json:
            fields["tool_calls"] = [_with_parsed_arguments(call) for call in json.loads(self.tool_calls_json)]
        if self.tool_call_id:
            fields["tool_call_id"] = self.tool_call_id
        return fields


def _with_parsed_arguments(call: Any) -> Any:
    """A tool call whose function arguments, JSON text in OpenAI's shape, are an object (templates print them)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


@dataclasses.dataclass(frozen=True)
class PromptInput:
    """Exactly one of text, token_ids, messages is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True
    # Tool definitions for the chat template (OpenAI's `tools`, JSON text; "" for none).
    tools_json: str = ""


@dataclasses.dataclass(frozen=True)
class ResumeFrom:
    """Continue the request `request_id`, whose output so far is `delivered_token_ids`."""

    request_id: str
    delivered_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One Generate call."""

    request_id: str
    prompt: PromptInput
    # What the client gave of pagoda.params.SamplingParams / StoppingCriteria.
    sampling: GivenParams = dataclasses.field(default_factory=dict)
    stopping: GivenParams = dataclasses.field(default_factory=dict)
    priority: int = 0
    cache_salt: str = ""
    skip_special_tokens: bool = True
    # Seconds the client allows (None: the server's default request timeout).
    timeout_s: float | None = None
    # Set when the client resumes a broken stream (the sampling seed is then given too).
    resume: ResumeFrom | None = None
    # What the output must match (None: anything).
    structured: Constraint | None = None
    # W3C trace context the client sent (validated at the edge; empty: none), docs/tracing.md.
    traceparent: str = ""
    # The LoRA adapter to run with, by name (docs/lora.md); "": the base model.
    lora: str = ""


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Of cached_tokens, those loaded from the executor's offload tier.
    cached_tokens_offloaded: int = 0


@dataclasses.dataclass(frozen=True)
class RequestTimings:
    """Where a finished request's time went, from its arrival."""

    queue_ns: int
    time_to_first_token_ns: int
    total_ns: int


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One streamed delta; the last has finish_reason, usage and timings."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] = ()
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the request.
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None
    # Sent once, with the first delta.
    prompt_token_ids: tuple[int, ...] = ()
    # Set when finish_reason is ERROR.
    error: str = ""
    # Index in the request's output of token_ids[0]: tokens sent before, delivered ones included.
    output_index: int = 0
    # The effective sampling seed, sent once with the first delta of every stream.
    seed: int | None = None
    # SamplingParams.prompt_logprobs: prompt tokens 1.. (sent once, with the first delta).
    prompt_logprobs: tuple[LogprobEntry, ...] = ()

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None
