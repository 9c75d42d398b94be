"""Request building: options -> ``*_pb2`` requests, walking the ``pagoda.params`` table.

A sampling or stopping parameter is set on the ``GenerateRequest`` message of
its group (``sampling`` or ``stopping``, the request's field of that name)
under its own name, so a row added to the table is sent without a change here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.message import Message as ProtoMessage

from pagoda import params
from pagoda.channel import auth_metadata
from pagoda.constraint import KINDS, Constraint
from pagoda.constraint_pb import constraint_to_pb
from pagoda.v1 import generation_pb2
from pagoda_client.core.kinds import kind_of
from pagoda_client.options import CALL_OPTION_NAMES, INPUT_NAMES, Message

Metadata = tuple[tuple[str, str], ...]


def check_option_names(names: Sequence[str] | Mapping[str, object]) -> None:
    """Raise ``TypeError`` naming every option that is neither a table row nor a call option or input."""
    known = set(params.names()) | CALL_OPTION_NAMES | set(INPUT_NAMES)
    unknown = sorted(set(names) - known)
    if unknown:
        raise TypeError(f"unknown generation options: {', '.join(unknown)}")


def build_generate_request(prompt: str | None, options: Mapping[str, object]) -> generation_pb2.GenerateRequest:
    """The ``GenerateRequest`` of one call; options left out or None are not sent.

    Raises:
        TypeError: an unknown option name, or a value of the wrong type (both named).
        ValueError: not exactly one of ``prompt``, ``token_ids`` and ``messages``.
    """
    check_option_names(options)
    request = generation_pb2.GenerateRequest()
    _set_input(request, prompt, options)
    _set_call_options(request, options)
    for row in params.fields():
        value = options.get(row.name)
        if value is not None:
            _set_param(getattr(request, row.group), row, value)
    return request


def _set_input(request: generation_pb2.GenerateRequest, prompt: str | None, options: Mapping[str, Any]) -> None:
    token_ids, messages = options.get("token_ids"), options.get("messages")
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, token_ids or messages")
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.token_ids.extend(int(t) for t in token_ids)
    else:
        request.chat.CopyFrom(chat_input(messages or (), options.get("add_generation_prompt")))


def _set_call_options(request: generation_pb2.GenerateRequest, options: Mapping[str, Any]) -> None:
    request.request_id = options.get("request_id") or ""
    request.priority = options.get("priority") or 0
    request.cache_salt = options.get("cache_salt") or ""
    request.lora = options.get("lora") or ""
    if options.get("skip_special_tokens") is not None:
        request.skip_special_tokens = options["skip_special_tokens"]
    structured = constraint_to_pb(constraint_of(options))
    if structured is not None:
        request.structured.CopyFrom(structured)


def constraint_of(options: Mapping[str, Any]) -> Constraint | None:
    """The output constraint the options give (json_schema, json_object, regex, grammar, choice), or None.

    Raises:
        ValueError: more than one of them.
        TypeError: a value of the wrong type (named).
    """
    given = [kind for kind in KINDS if options.get(kind) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(KINDS)}; got {', '.join(given)}")
    kind, value = given[0], options[given[0]]
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        if isinstance(value, str) or not all(isinstance(c, str) for c in value):
            raise TypeError(f"choice must be a sequence of strings, got {value!r}")
        return Constraint("choice", choices=tuple(value))
    if kind == "json_schema" and isinstance(value, Mapping):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be a string, got {value!r}")
    return Constraint(kind, text=value)


def _set_param(message: ProtoMessage, row: params.ParamField, value: Any) -> None:
    """Set one table parameter on its group's message (a bare string is one element of a list)."""
    kind = kind_of(row)
    try:
        if kind.repeated:
            items = [value] if isinstance(value, str) else list(value)
            getattr(message, row.name).extend(items)
        else:
            setattr(message, row.name, value)
    except (TypeError, ValueError) as error:
        expected = kind.annotation.replace(" | None", "")
        raise TypeError(f"{row.name} must be {expected}, got {value!r}") from error


def resume_request(
    original: generation_pb2.GenerateRequest, request_id: str, seed: int, delivered_token_ids: Sequence[int]
) -> generation_pb2.GenerateRequest:
    """The request that continues ``original`` after ``delivered_token_ids``: same input and parameters,
    the effective ``seed`` of its first response, and the ``resume`` part."""
    request = generation_pb2.GenerateRequest()
    request.CopyFrom(original)
    request.request_id = request_id
    request.sampling.seed = seed
    request.resume.request_id = request_id
    request.resume.delivered_token_ids.extend(delivered_token_ids)
    return request


def chat_input(messages: Sequence[Message], add_generation_prompt: bool | None) -> generation_pb2.ChatInput:
    """A ``ChatInput`` from mappings or objects with ``role`` and ``content``."""
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
        request.chat.CopyFrom(chat_input(messages or (), None))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool | None) -> generation_pb2.DetokenizeRequest:
    """A ``DetokenizeRequest``."""
    request = generation_pb2.DetokenizeRequest(token_ids=[int(t) for t in token_ids])
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request


def call_metadata(api_key: str | None, request_id: str | None = None) -> Metadata:
    """gRPC metadata of one call: API key and request id."""
    return auth_metadata(api_key) + ((("x-request-id", request_id),) if request_id else ())
