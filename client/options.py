"""The options of a generation, as one typed structure.

``ParamOptions`` (generated from ``pagoda.params``, one key per sampling or
stopping parameter) plus ``CallOptions`` (what belongs to the call, not to the
table) make ``RequestOptions``; ``GenerateOptions`` adds the two keyword
inputs. Every ``Client``/``AsyncClient`` generation method takes them as
keyword arguments (``**options: Unpack[GenerateOptions]``), so a call reads
``client.generate("Hi", max_tokens=8, temperature=0)`` and a type checker
knows each key. Any key may be None or left out: the server's default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from pagoda_client._param_options import ParamOptions

Message = Mapping[str, str] | Any
"""A chat message: a mapping with ``role`` and ``content``, or an object with those attributes."""


class CallOptions(TypedDict, total=False):
    """Options of one generation that are not sampling or stopping parameters."""

    # Lower is served first; first come, first served inside a priority (server default 0).
    priority: int | None
    # Mixed into the prefix-cache hashes: requests with different salts share no cached blocks.
    cache_salt: str | None
    # The LoRA adapter to run with, by name (``ModelInfo.loras``); None or empty: the base model.
    lora: str | None
    # The request's id (the server makes one when unset); also sent as x-request-id metadata.
    request_id: str | None
    # Drop special tokens (e.g. EOS) from the returned text (server default true).
    skip_special_tokens: bool | None
    # Chat input only: append the assistant turn header (server default true).
    add_generation_prompt: bool | None
    # Seconds for the whole call including retries; overrides the client's default.
    timeout: float | None
    # Constrain the output (at most one of these): a JSON schema (a mapping, or its JSON text) ...
    json_schema: Mapping[str, Any] | str | None
    # ... any JSON object ...
    json_object: bool | None
    # ... a regex the whole output matches ...
    regex: str | None
    # ... a Lark grammar (llguidance's dialect) ...
    grammar: str | None
    # ... or exactly one of these strings.
    choice: Sequence[str] | None
    # W3C trace context of the call, sent as traceparent metadata (default: the application's
    # current OpenTelemetry span when it uses OpenTelemetry, else none); docs/tracing.md.
    traceparent: str | None


class RequestOptions(ParamOptions, CallOptions, total=False):
    """Every option of a generation: the table's parameters and the call's own."""


class GenerateOptions(RequestOptions, total=False):
    """``RequestOptions`` plus the keyword inputs (give exactly one input, counting ``prompt``)."""

    # The prompt as token ids.
    token_ids: Sequence[int] | None
    # Chat messages; the server applies the model's chat template.
    messages: Sequence[Message] | None


class TokenizeOptions(TypedDict, total=False):
    """Keyword options of ``tokenize``."""

    # Chat messages to tokenize through the chat template, instead of text.
    messages: Sequence[Message] | None
    # Add the tokenizer's special tokens (BOS) to plain text (server default true).
    add_special_tokens: bool | None
    # Seconds for the whole call including retries; overrides the client's default.
    timeout: float | None


CALL_OPTION_NAMES = frozenset(CallOptions.__annotations__)
INPUT_NAMES = ("token_ids", "messages")
