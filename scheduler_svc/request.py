"""A client request as the engine sees it, and what the engine streams back.

The gRPC edge (and the HTTP edge) fill `GenerationRequest`; unset optional
fields are None and get defaults in `validation.py`.
"""

from __future__ import annotations

import dataclasses

from scheduler_svc.types import FinishReason, LogprobEntry


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclasses.dataclass(frozen=True)
class PromptInput:
    """Exactly one of text, token_ids, messages is set."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """Sampling fields as the client gave them (None: server default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class StoppingOptions:
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One Generate call."""

    request_id: str
    prompt: PromptInput
    sampling: SamplingOptions = SamplingOptions()
    stopping: StoppingOptions = StoppingOptions()
    priority: int = 0
    cache_salt: str = ""
    skip_special_tokens: bool = True
    # Seconds the client allows (None: the server's default request timeout).
    timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class RequestTimings:
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
