"""Plain result types of the Pagoda client (no protobuf in the public API)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# The logprob types are the step protocol's own (the same on both hops), re-exported.
from pagoda.step import LogprobEntry as LogprobEntry
from pagoda.step import LoraAdapter as LoraAdapter
from pagoda.step import TokenLogprob as TokenLogprob

# The status types are generated from their proto messages (make proto), re-exported.
from pagoda_client._status import ExecutorStatus as ExecutorStatus
from pagoda_client._status import GroupRankStatus as GroupRankStatus
from pagoda_client._status import ServerStatus as ServerStatus


class FinishReason(str, enum.Enum):
    """Why a generation ended (compares equal to its string value)."""

    STOP = "stop"
    """EOS, a stop string or a stop token id."""
    LENGTH = "length"
    """``max_tokens`` or the model's context length."""
    ABORT = "abort"
    """The server aborted the request."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    cached_tokens_offloaded: int = 0
    """Of ``cached_tokens``, those loaded from the executor's KV offload tier (the rest were in device memory)."""


@dataclass(frozen=True)
class Timings:
    """Server-side timings of one request, in seconds from its arrival."""

    queue_s: float = 0.0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class GenerationDelta:
    """One streamed piece of a generation.

    The last delta of a request carries ``finish_reason``, ``usage`` and
    ``timings``; the first carries ``prompt_token_ids`` and ``seed``. A stream
    the client resumed after a break reads as one: contiguous ``output_index``,
    the prompt and the seed once.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[LogprobEntry, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_token_ids: tuple[int, ...] = ()
    output_index: int = 0
    """Index in the request's output of ``token_ids[0]``: output tokens delivered before this delta."""
    seed: int | None = None
    """The effective sampling seed (the server's draw when none was given); first delta only."""
    prompt_logprobs: tuple[LogprobEntry, ...] = ()
    """With ``prompt_logprobs``: each prompt token's (but the first) logprob given those before it; first delta."""


@dataclass
class GenerationResult:
    """A whole generation, assembled from its deltas."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str = ""
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    """The effective sampling seed: pass it as ``seed`` to reproduce the generation."""
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    """With ``prompt_logprobs``: prompt tokens 1, 2, ... each given the tokens before it."""

    def add(self, delta: GenerationDelta) -> None:
        """Fold one delta into this result."""
        self.request_id = delta.request_id or self.request_id
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_token_ids:
            self.prompt_token_ids = list(delta.prompt_token_ids)
        if delta.prompt_logprobs:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        if delta.seed is not None:
            self.seed = delta.seed
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
        if delta.usage is not None:
            self.usage = delta.usage
        if delta.timings is not None:
            self.timings = delta.timings

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (the CLI's ``--json`` output)."""
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "stop_reason": self.stop_reason,
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "cached_tokens": self.usage.cached_tokens,
                "cached_tokens_offloaded": self.usage.cached_tokens_offloaded,
            },
            "timings": {
                "queue_s": self.timings.queue_s,
                "time_to_first_token_s": self.timings.time_to_first_token_s,
                "total_s": self.timings.total_s,
            },
        }


@dataclass(frozen=True)
class ModelInfo:
    """What the server serves, and its limits."""

    model_name: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_prompt_tokens: int
    max_new_tokens: int
    kv_cache_dtype: str = ""
    """What the KV cache stores: the model dtype, or ``int8`` (quantized rows with scales)."""
    quantization: str = ""
    """The linear weights' quantization: ``none``, ``int8``, or a GGUF file's block types as stored."""
    batch_invariant: bool = False
    """Whether the executors serve batch-invariant: a request's tokens do not depend on the load beside it."""
    loras: tuple[LoraAdapter, ...] = ()
    """The LoRA adapters requests may name (the ``lora`` option), sorted by name."""
