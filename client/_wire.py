"""Proto conversion, channel options and retry policy shared by both clients.

This is the only module of the client that touches ``*_pb2`` messages.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pagoda.v1 import common_pb2, generation_pb2
from pagoda_client.types import (
    ExecutorStatus,
    FinishReason,
    GenerationDelta,
    LogprobEntry,
    ModelInfo,
    ServerStatus,
    Timings,
    TlsConfig,
    TokenLogprob,
    Usage,
)

Message = Mapping[str, str] | Any
"""A chat message: a mapping with ``role`` and ``content``, or an object with those attributes."""

_FINISH_REASONS = {
    generation_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    generation_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    generation_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}

# Reconnect quickly after the server (re)appears, so retries can succeed.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)

SAMPLING_FIELDS = (
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


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter on UNAVAILABLE, before any response.

    Attempt ``n`` (0-based) waits ``uniform(0.5, 1) * min(max_backoff_s,
    initial_backoff_s * 2**n)`` seconds.
    """

    max_retries: int = 3
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * (2**attempt))
        return ceiling * random.uniform(0.5, 1.0)

    def should_retry(self, code: grpc.StatusCode | None, attempt: int) -> bool:
        """Whether a failure with ``code`` after ``attempt`` retries is retried."""
        return code == grpc.StatusCode.UNAVAILABLE and attempt < self.max_retries


class Deadline:
    """An absolute deadline from a relative timeout (None: no deadline)."""

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        """Seconds left (may be ≤ 0), or None without a deadline."""
        return None if self._end is None else self._end - time.monotonic()

    def expired(self) -> bool:
        """True when the deadline has passed."""
        left = self.remaining()
        return left is not None and left <= 0


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def channel_credentials(tls: bool | TlsConfig) -> grpc.ChannelCredentials | None:
    """Credentials for ``tls`` (None for plaintext)."""
    if tls is False:
        return None
    config = TlsConfig() if tls is True else tls
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.root_certificates),
        private_key=_read(config.private_key),
        certificate_chain=_read(config.certificate_chain),
    )


def channel_options(tls: bool | TlsConfig, extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """Channel options: ours, the TLS name override, then the caller's."""
    options = list(CHANNEL_OPTIONS)
    if isinstance(tls, TlsConfig) and tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return options + list(extra)


def call_metadata(api_key: str | None, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata of one call: API key and request id."""
    metadata: list[tuple[str, str]] = []
    if api_key:
        metadata.append(("authorization", f"Bearer {api_key}"))
    if request_id:
        metadata.append(("x-request-id", request_id))
    return tuple(metadata)


def _chat_input(messages: Sequence[Message], add_generation_prompt: bool | None) -> generation_pb2.ChatInput:
    chat = generation_pb2.ChatInput()
    for message in messages:
        if isinstance(message, Mapping):
            role, content = message["role"], message["content"]
        else:
            role, content = message.role, message.content
        chat.messages.add(role=str(role), content=str(content))
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def build_generate_request(
    prompt: str | None,
    token_ids: Sequence[int] | None,
    messages: Sequence[Message] | None,
    *,
    sampling: Mapping[str, Any],
    max_tokens: int | None,
    stop: Sequence[str] | str | None,
    stop_token_ids: Sequence[int] | None,
    ignore_eos: bool,
    include_stop_str_in_output: bool,
    priority: int,
    cache_salt: str,
    request_id: str | None,
    skip_special_tokens: bool | None,
    add_generation_prompt: bool | None = None,
) -> generation_pb2.GenerateRequest:
    """The ``GenerateRequest`` for one call; exactly one input must be given."""
    num_inputs = sum(x is not None for x in (prompt, token_ids, messages))
    if num_inputs != 1:
        raise ValueError("give exactly one of prompt, token_ids or messages")
    request = generation_pb2.GenerateRequest(request_id=request_id or "", priority=priority, cache_salt=cache_salt)
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.token_ids.extend(int(t) for t in token_ids)
    else:
        request.chat.CopyFrom(_chat_input(messages or (), add_generation_prompt))
    request.sampling.CopyFrom(build_sampling(sampling))
    stopping = request.stopping
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    stopping.stop.extend([stop] if isinstance(stop, str) else list(stop or ()))
    stopping.stop_token_ids.extend(int(t) for t in stop_token_ids or ())
    stopping.ignore_eos = ignore_eos
    stopping.include_stop_str_in_output = include_stop_str_in_output
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request


def build_sampling(sampling: Mapping[str, Any]) -> common_pb2.SamplingParams:
    """``SamplingParams`` with only the fields the caller set."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    params = common_pb2.SamplingParams()
    for name, value in sampling.items():
        if value is not None:
            setattr(params, name, value)
    return params


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


def status_from_pb(pb: generation_pb2.ServerStatus) -> ServerStatus:
    """A ``ServerStatus`` from its proto."""
    return ServerStatus(
        num_running=pb.num_running,
        num_waiting=pb.num_waiting,
        kv_cache_usage=pb.kv_cache_usage,
        executors=tuple(
            ExecutorStatus(
                address=e.address,
                incarnation_id=e.incarnation_id,
                state=e.state,
                num_running=e.num_running,
                num_waiting=e.num_waiting,
                num_kv_blocks=e.num_kv_blocks,
                num_free_kv_blocks=e.num_free_kv_blocks,
                kv_cache_usage=e.kv_cache_usage,
            )
            for e in pb.executors
        ),
        num_requests_total=pb.num_requests_total,
        num_preemptions_total=pb.num_preemptions_total,
        prefix_cache_queries_total=pb.prefix_cache_queries_total,
        prefix_cache_hits_total=pb.prefix_cache_hits_total,
    )


def tokenize_request(
    text: str | None, messages: Sequence[Message] | None, add_special_tokens: bool | None
) -> generation_pb2.TokenizeRequest:
    """A ``TokenizeRequest``; exactly one of text or messages."""
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages")
    request = generation_pb2.TokenizeRequest()
    if text is not None:
        request.text = text
    else:
        request.chat.CopyFrom(_chat_input(messages or (), None))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool | None) -> generation_pb2.DetokenizeRequest:
    """A ``DetokenizeRequest``."""
    request = generation_pb2.DetokenizeRequest(token_ids=[int(t) for t in token_ids])
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request
