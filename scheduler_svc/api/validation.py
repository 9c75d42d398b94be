"""Turn a client's GenerationRequest into effective, checked parameters.

Sampling and stopping parameters are filled and checked from the table
(`pagoda.params`): an unset field takes its `unset` value (the seed draws a
random one), aliases are mapped (top_k -1), and each value is checked against
its range, whose named bounds come from `Limits`. What is not a range stays
here by hand: max_tokens against the context, stop strings, stop token ids.

Every check raises InvalidRequest naming the field, before anything is
allocated, so a bad request changes nothing else.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from pagoda import grammar
from pagoda.constraint import Constraint
from pagoda.params import RANDOM_SEED, Group, SamplingParams, StoppingCriteria, rows
from scheduler_svc.errors import DeadlineExceeded, InvalidRequest
from scheduler_svc.request import GenerationRequest, GivenParams, PromptInput, ResumeFrom

MAX_PRIORITY = 2**31 - 1
MAX_ID_CHARS = 256
MAX_SALT_CHARS = 256


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and the operator allow (the table's ``Bound.limit`` names these fields)."""

    max_model_len: int
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    default_max_tokens: int
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_logprobs: int = 20

    def value(self, name: str) -> float:
        """The limit called ``name``.

        Raises:
            KeyError: no such limit (a table row names a limit that does not exist).
        """
        if name not in _LIMIT_NAMES:
            raise KeyError(f"no server limit named {name!r}")
        value: int = getattr(self, name)
        return value


_LIMIT_NAMES = frozenset(f.name for f in dataclasses.fields(Limits))


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


def check_prompt_tokens(token_ids: Sequence[int], limits: Limits) -> None:
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


def sampling_params(given: GivenParams, limits: Limits) -> SamplingParams:
    """Effective sampling parameters: the table's defaults for what is unset, every value range-checked."""
    return SamplingParams(**_from_table("sampling", given, limits))


def stopping_criteria(given: GivenParams, num_prompt_tokens: int, limits: Limits) -> StoppingCriteria:
    """Effective stopping criteria; the request must fit the model's context."""
    values = _from_table("stopping", given, limits)
    values["max_tokens"] = _max_tokens(values["max_tokens"], num_prompt_tokens, limits)
    _check_stop_strings(values["stop"], limits)
    _check_stop_token_ids(values["stop_token_ids"], limits)
    return StoppingCriteria(**values)


def _from_table(group: Group, given: GivenParams, limits: Limits) -> dict[str, Any]:
    """Every field of one group: the given value (alias mapped, range checked) or the unset one."""
    table = rows(group)
    unknown = set(given).difference(row.name for row in table)
    if unknown:
        raise InvalidRequest(f"{group}.{min(unknown)}", "no such parameter")
    values: dict[str, Any] = {}
    for row in table:
        if row.name not in given:
            values[row.name] = random.getrandbits(63) if row.unset == RANDOM_SEED else row.unset
            continue
        value = row.spec.resolve_alias(given[row.name])
        problem = row.spec.check(row.name, value, limits.value)
        if problem is not None:
            raise InvalidRequest(f"{group}.{row.name}", problem)
        values[row.name] = tuple(value) if row.spec.repeated else value
    return values


def _max_tokens(max_tokens: int | None, num_prompt_tokens: int, limits: Limits) -> int:
    """Unset: the server's default, cut to the context left; given: it must fit the context."""
    room = limits.max_model_len - num_prompt_tokens
    if max_tokens is None:
        return min(limits.default_max_tokens, limits.max_new_tokens, room)
    if max_tokens > room:
        raise InvalidRequest(
            "stopping.max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
            f"exceeds the model's context of {limits.max_model_len} tokens",
        )
    return max_tokens


def _check_stop_strings(stop: tuple[str, ...], limits: Limits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest("stopping.stop", f"at most {limits.max_stop_strings} stop strings")
    for i, text in enumerate(stop):
        if not text or len(text) > limits.max_stop_string_len:
            raise InvalidRequest(f"stopping.stop[{i}]", f"must have 1 to {limits.max_stop_string_len} characters")


def _check_stop_token_ids(stop_token_ids: tuple[int, ...], limits: Limits) -> None:
    if len(stop_token_ids) > limits.max_stop_strings:
        raise InvalidRequest("stopping.stop_token_ids", f"at most {limits.max_stop_strings} stop token ids")
    for t in stop_token_ids:
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest("stopping.stop_token_ids", f"token id {t} is outside the vocabulary")


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
    if request.resume is not None:
        _check_resume_fields(request)


def _check_resume_fields(request: GenerationRequest) -> None:
    """The resume part's id, and the seed a resume needs to continue the same random stream."""
    assert request.resume is not None
    resume_id = request.resume.request_id
    if not resume_id or len(resume_id) > MAX_ID_CHARS:
        raise InvalidRequest("resume.request_id", f"must have 1 to {MAX_ID_CHARS} characters")
    if resume_id != request.request_id:
        raise InvalidRequest("resume.request_id", f"must equal the request's id {request.request_id!r}")
    if "seed" not in request.sampling:
        raise InvalidRequest("sampling.seed", "required with resume: the seed of the request's first response")


def check_resume(resume: ResumeFrom, num_prompt_tokens: int, stopping: StoppingCriteria, limits: Limits) -> None:
    """Delivered tokens of a resume: bounded, in the vocabulary, within the context and max_tokens."""
    delivered = resume.delivered_token_ids
    field = "resume.delivered_token_ids"
    if len(delivered) > limits.max_new_tokens:
        raise InvalidRequest(field, f"at most {limits.max_new_tokens} token ids, got {len(delivered)}")
    bad = next((t for t in delivered if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if num_prompt_tokens + len(delivered) > limits.max_model_len:
        raise InvalidRequest(
            field,
            f"prompt ({num_prompt_tokens} tokens) + delivered ({len(delivered)} tokens) "
            f"exceeds the model's context of {limits.max_model_len} tokens",
        )
    if len(delivered) > stopping.max_tokens:
        raise InvalidRequest(field, f"{len(delivered)} delivered tokens, more than max_tokens ({stopping.max_tokens})")


def check_structured(structured: Constraint | None) -> None:
    """A constraint the engine compiles (invalid schema, unsupported keyword, bad regex: named by field)."""
    if structured is None:
        return
    problem = grammar.check(structured)
    if problem is not None:
        raise InvalidRequest(structured.field, problem)
