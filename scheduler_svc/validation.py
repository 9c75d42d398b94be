"""Turn a client's GenerationRequest into effective, checked parameters.

Every check raises InvalidRequest naming the field, before anything is
allocated, so a bad request changes nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import random

from scheduler_svc.errors import DeadlineExceeded, InvalidRequest
from scheduler_svc.request import GenerationRequest, PromptInput
from scheduler_svc.types import SamplingParams, StoppingCriteria

MAX_SEED = 2**63 - 1
MAX_PRIORITY = 2**31 - 1
MAX_ID_CHARS = 256
MAX_SALT_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and the operator allow."""

    max_model_len: int
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    default_max_tokens: int
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_logprobs: int = 20


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(field, f"must be a finite number, got {value}")
    return value


def check_prompt_input(prompt: PromptInput) -> None:
    """Exactly one non-empty input."""
    given = [p for p in (prompt.text, prompt.token_ids, prompt.messages) if p is not None]
    if len(given) != 1:
        raise InvalidRequest("input", "set exactly one of text, token_ids, chat")
    if prompt.text is not None and not prompt.text:
        raise InvalidRequest("text", "prompt is empty")
    if prompt.token_ids is not None and not prompt.token_ids:
        raise InvalidRequest("token_ids", "prompt is empty")
    if prompt.messages is not None:
        if not prompt.messages:
            raise InvalidRequest("chat.messages", "no messages")
        for i, msg in enumerate(prompt.messages):
            if not msg.role:
                raise InvalidRequest(f"chat.messages[{i}].role", "role is empty")


def check_prompt_tokens(token_ids: list[int] | tuple[int, ...], limits: Limits) -> None:
    """Length and vocabulary range of the tokenized prompt."""
    if not token_ids:
        raise InvalidRequest("input", "prompt is empty after tokenization")
    if len(token_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            "input",
            f"prompt has {len(token_ids)} tokens, more than the limit of {limits.max_prompt_tokens} "
            f"(model context {limits.max_model_len})",
        )
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest("token_ids", f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")


def sampling_params(request: GenerationRequest, limits: Limits) -> SamplingParams:
    """Effective sampling parameters with defaults, range-checked."""
    s = request.sampling
    # Greedy unless asked (as TGI): reproducible answers from a bare request.
    temperature = _finite("sampling.temperature", 0.0 if s.temperature is None else s.temperature)
    if temperature < 0:
        raise InvalidRequest("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = _finite("sampling.top_p", 1.0 if s.top_p is None else s.top_p)
    if not 0 < top_p <= 1:
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = 0 if s.top_k is None or s.top_k == -1 else s.top_k
    if top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be -1, 0 (disabled) or positive, got {s.top_k}")
    min_p = _finite("sampling.min_p", 0.0 if s.min_p is None else s.min_p)
    if not 0 <= min_p <= 1:
        raise InvalidRequest("sampling.min_p", f"must be in [0, 1], got {min_p}")
    rep = _finite("sampling.repetition_penalty", 1.0 if s.repetition_penalty is None else s.repetition_penalty)
    if rep <= 0:
        raise InvalidRequest("sampling.repetition_penalty", f"must be > 0, got {rep}")
    presence = _finite("sampling.presence_penalty", s.presence_penalty or 0.0)
    frequency = _finite("sampling.frequency_penalty", s.frequency_penalty or 0.0)
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2 <= value <= 2:
            raise InvalidRequest(f"sampling.{name}", f"must be in [-2, 2], got {value}")
    seed = random.getrandbits(63) if s.seed is None else s.seed
    if not 0 <= seed <= MAX_SEED:
        raise InvalidRequest("sampling.seed", f"must be in [0, 2^63), got {seed}")
    if s.logprobs is not None and not 0 <= s.logprobs <= limits.max_logprobs:
        raise InvalidRequest("sampling.logprobs", f"must be in [0, {limits.max_logprobs}], got {s.logprobs}")
    return SamplingParams(temperature, top_p, top_k, min_p, rep, presence, frequency, seed, s.logprobs)


def stopping_criteria(request: GenerationRequest, num_prompt_tokens: int, limits: Limits) -> StoppingCriteria:
    """Effective stopping criteria; the request must fit the model's context."""
    st = request.stopping
    max_tokens = limits.default_max_tokens if st.max_tokens is None else st.max_tokens
    if max_tokens <= 0:
        raise InvalidRequest("stopping.max_tokens", f"must be positive, got {max_tokens}")
    if max_tokens > limits.max_new_tokens:
        raise InvalidRequest("stopping.max_tokens", f"{max_tokens} is above the limit of {limits.max_new_tokens}")
    if st.max_tokens is None:
        max_tokens = min(max_tokens, limits.max_model_len - num_prompt_tokens)
    elif num_prompt_tokens + max_tokens > limits.max_model_len:
        raise InvalidRequest(
            "stopping.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
            f"exceeds the model's context of {limits.max_model_len} tokens",
        )
    if len(st.stop) > limits.max_stop_strings:
        raise InvalidRequest("stopping.stop", f"at most {limits.max_stop_strings} stop strings")
    for i, text in enumerate(st.stop):
        if not text or len(text) > limits.max_stop_string_len:
            raise InvalidRequest(f"stopping.stop[{i}]", f"must have 1 to {limits.max_stop_string_len} characters")
    if len(st.stop_token_ids) > limits.max_stop_strings:
        raise InvalidRequest("stopping.stop_token_ids", f"at most {limits.max_stop_strings} stop token ids")
    for t in st.stop_token_ids:
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest("stopping.stop_token_ids", f"token id {t} is outside the vocabulary")
    return StoppingCriteria(
        max_tokens, tuple(st.stop), tuple(st.stop_token_ids), st.ignore_eos, st.include_stop_str_in_output
    )


def check_request_fields(request: GenerationRequest) -> None:
    """Checks that need no model: ids, priority, salt, deadline (DeadlineExceeded)."""
    if len(request.request_id) > MAX_ID_CHARS:
        raise InvalidRequest("request_id", f"at most {MAX_ID_CHARS} characters")
    if not -MAX_PRIORITY <= request.priority <= MAX_PRIORITY:
        raise InvalidRequest("priority", "out of range")
    if len(request.cache_salt) > MAX_SALT_CHARS:
        raise InvalidRequest("cache_salt", f"at most {MAX_SALT_CHARS} characters")
    if request.timeout_s is not None and request.timeout_s <= 0:
        raise DeadlineExceeded("the request's deadline passed before it arrived")
    check_prompt_input(request.prompt)
