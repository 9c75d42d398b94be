"""OpenAI request bodies → GenerationRequest, with type checks and clear 400s.

Types are checked here (a string where a number belongs, a list of several
prompts, n > 1, features we do not serve); value ranges are checked once, by
the engine's validation, whose errors the server maps back onto these names.
Unknown fields are ignored, as clients send many optional ones.

Plain parameters come from the table (`pagoda.params`): each row with an
`http` name is read with the type of its proto field, and `http_unset` applies
when the body leaves it out. What OpenAI shapes differently is mapped by hand
below: logprobs / top_logprobs, max_completion_tokens, the completions default
of max_tokens, stop as a string or a list, n, response_format, tools.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pagoda.constraint import Constraint
from pagoda.params import Group, Kind, rows
from scheduler_svc.api.http.errors import bad_request
from scheduler_svc.api.http.tools import ToolSpec, parse_tools
from scheduler_svc.request import ChatMessage, GenerationRequest, PromptInput

# OpenAI's documented default for /v1/completions (chat has none: up to the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Choices per request at most (each is a sequence; they share the prompt's KV through the prefix cache).
MAX_N = 8


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """What a handler needs besides the engine request."""

    generation: GenerationRequest
    model: str | None
    stream: bool
    include_usage: bool
    # Engine field name → the OpenAI parameter the client used (for error messages).
    param_aliases: dict[str, str]
    user: str | None = None
    # Choices asked for (n).
    n: int = 1
    # The chat request's tools and tool_choice (None: no tools).
    tools: ToolSpec | None = None


def read_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    return body


# A JSON value's expected type: a parameter's kind, or an object / an array.
JsonKind = Kind | Literal["dict", "list"]


class Fields:
    """Typed access to a JSON object's fields; JSON null counts as absent."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str, kind: JsonKind, default: Any = None) -> Any:
        """The field as ``kind`` ("int", "float", "bool", "str", "dict" or "list"), or ``default`` when absent."""
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_kind(value, kind):
            raise bad_request(name, f"expected {_KIND_NAMES[kind]}, got {_json_type(value)}")
        return float(value) if kind == "float" else value

    def list_of(self, name: str, kind: Kind) -> tuple[Any, ...] | None:
        """The field as a list of ``kind`` values, or None when absent."""
        values = self.get(name, "list")
        if values is None:
            return None
        if not all(_is_kind(v, kind) for v in values):
            raise bad_request(name, f"expected a list of {_KIND_PLURALS[kind]}")
        return tuple(float(v) for v in values) if kind == "float" else tuple(values)


def _is_kind(value: Any, kind: JsonKind) -> bool:
    if kind in ("int", "float") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES_OF_KIND[kind])


_TYPES_OF_KIND: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "float": (int, float),
    "bool": bool,
    "str": str,
    "dict": dict,
    "list": list,
}
_KIND_NAMES = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "str": "a string",
    "dict": "an object",
    "list": "an array",
}
_KIND_PLURALS = {"int": "integers", "float": "numbers", "bool": "booleans", "str": "strings"}


def _json_type(value: Any) -> str:
    for kind, name in (
        (bool, "a boolean"),
        ((int, float), "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def table_params(f: Fields, group: Group) -> dict[str, Any]:
    """The parameters of one group that the body sets under their table ``http`` names.

    A row without an ``http`` name is not read here; one the body leaves out
    takes ``http_unset`` when the table gives one (OpenAI samples by default).
    """
    given: dict[str, Any] = {}
    for row in rows(group):
        spec = row.spec
        if not spec.http:
            continue
        value = f.list_of(spec.http, spec.value_kind) if spec.repeated else f.get(spec.http, spec.value_kind)
        if value is None:
            value = spec.http_unset
        if value is not None:
            given[row.name] = value
    return given


def parse_completion(body: dict[str, Any], request_id: str) -> ParsedRequest:
    """A /v1/completions body."""
    f = Fields(body)
    _refuse_unsupported(f)
    if f.get("echo", "bool", False):
        raise bad_request("echo", "echo is not supported")
    if f.get("best_of", "int", 1) != 1:
        raise bad_request("best_of", "only best_of=1 is supported")
    if f.get("suffix", "str"):
        raise bad_request("suffix", "suffix (insertion) is not supported")
    sampling = table_params(f, "sampling")
    _set_given(sampling, "logprobs", f.get("logprobs", "int"))
    stopping = _stopping(f)
    stopping.setdefault("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    structured, aliases = _constraint(f)
    generation = GenerationRequest(
        request_id,
        _completion_prompt(body.get("prompt")),
        sampling,
        stopping,
        skip_special_tokens=f.get("skip_special_tokens", "bool", True),
        structured=structured,
    )
    stream, include_usage = _stream_flags(f)
    return ParsedRequest(
        generation, f.get("model", "str"), stream, include_usage, aliases, f.get("user", "str"), n=_n(f)
    )


def parse_chat(body: dict[str, Any], request_id: str) -> ParsedRequest:
    """A /v1/chat/completions body."""
    f = Fields(body)
    _refuse_unsupported(f)
    if f.get("functions", "list"):
        raise bad_request("functions", "the legacy functions parameter is not supported; use tools")
    tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    structured, aliases = _chat_constraint(f, tools)
    sampling = table_params(f, "sampling")
    if f.get("logprobs", "bool", False):
        sampling["logprobs"] = f.get("top_logprobs", "int", 0)
        aliases["logprobs"] = "top_logprobs"
    elif f.get("top_logprobs", "int") is not None:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs set to true")
    stopping = _stopping(f)
    if _set_given(stopping, "max_tokens", f.get("max_completion_tokens", "int")):
        aliases["max_tokens"] = "max_completion_tokens"
    prompt = PromptInput(
        messages=parse_messages(body.get("messages")),
        add_generation_prompt=f.get("add_generation_prompt", "bool", True),
        tools_json=tools.tools_json if tools is not None else "",
    )
    generation = GenerationRequest(
        request_id,
        prompt,
        sampling,
        stopping,
        skip_special_tokens=f.get("skip_special_tokens", "bool", True),
        structured=structured,
    )
    stream, include_usage = _stream_flags(f)
    user = f.get("user", "str")
    return ParsedRequest(generation, f.get("model", "str"), stream, include_usage, aliases, user, _n(f), tools)


def _chat_constraint(f: Fields, tools: ToolSpec | None) -> tuple[Constraint | None, dict[str, str]]:
    """The output constraint of a chat body (response_format, structured_outputs or a forced tool call)."""
    structured, aliases = _constraint(f)
    if tools is not None and tools.constraint is not None:
        if structured is not None:
            raise bad_request("tool_choice", "a forced tool call cannot be combined with another output constraint")
        return tools.constraint, {tools.constraint.field: "tool_choice"}
    return structured, aliases


def _constraint(f: Fields) -> tuple[Constraint | None, dict[str, str]]:
    """response_format (OpenAI) or structured_outputs (vLLM's extension: json, regex, choice, grammar), and the
    name of the parameter it came from, for the engine's errors."""
    by_format, by_extension = _response_format(f), _structured_outputs(f)
    if by_format is not None and by_extension is not None:
        raise bad_request("structured_outputs", "cannot be combined with a response_format other than text")
    if by_format is not None:
        return by_format, {by_format.field: "response_format"}
    if by_extension is not None:
        name = "json" if by_extension.kind == "json_schema" else by_extension.kind
        return by_extension, {by_extension.field: f"structured_outputs.{name}"}
    return None, {}


def _structured_outputs(f: Fields) -> Constraint | None:
    """vLLM's ``structured_outputs``: exactly one of json (a schema), regex, choice, grammar."""
    spec = f.get("structured_outputs", "dict")
    if not spec:
        return None
    given = Fields(spec)
    found = [key for key in ("json", "regex", "choice", "grammar") if spec.get(key) is not None]
    if len(found) != 1:
        raise bad_request("structured_outputs", "set exactly one of json, regex, choice, grammar")
    key = found[0]
    if key == "json":
        return Constraint("json_schema", text=json.dumps(given.get("json", "dict")))
    if key == "choice":
        return Constraint("choice", choices=given.list_of("choice", "str") or ())
    return Constraint("regex" if key == "regex" else "grammar", text=given.get(key, "str"))


def _set_given(given: dict[str, Any], name: str, value: Any) -> bool:
    """Sets ``given[name]`` when the body gave ``value`` (not None); says whether it did."""
    if value is None:
        return False
    given[name] = value
    return True


def _refuse_unsupported(f: Fields) -> None:
    """Parameters whose meaning we cannot honour get a 400, not silence."""
    if f.get("logit_bias", "dict"):
        raise bad_request("logit_bias", "logit_bias is not supported")


def _n(f: Fields) -> int:
    n: int = f.get("n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise bad_request("n", f"must be in [1, {MAX_N}], got {n}")
    return n


def _response_format(f: Fields) -> Constraint | None:
    """text (None), json_object, or json_schema ({name, schema, strict}; the schema is always enforced)."""
    response_format = f.get("response_format", "dict")
    kind = Fields(response_format or {}).get("type", "str", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise bad_request("response_format.type", f"expected text, json_object or json_schema, got {kind!r}")
    spec = Fields(response_format or {}).get("json_schema", "dict")
    schema = Fields(spec or {}).get("schema", "dict")
    if schema is None:
        raise bad_request("response_format.json_schema.schema", "expected a JSON schema object")
    Fields(spec or {}).get("strict", "bool")  # type-checked; the schema is enforced either way
    return Constraint("json_schema", text=json.dumps(schema))


def _stopping(f: Fields) -> dict[str, Any]:
    """The table's stopping parameters, plus stop as one string or a list of them."""
    stopping = table_params(f, "stopping")
    stop = f.body.get("stop")
    if isinstance(stop, str):
        stopping["stop"] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stopping["stop"] = tuple(stop)
    elif stop is not None:
        raise bad_request("stop", "expected a string or an array of strings")
    return stopping


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.get("stream", "bool", False)
    options = f.get("stream_options", "dict")
    if options is not None and not stream:
        raise bad_request("stream_options", "stream_options is only allowed when stream is true")
    include_usage = Fields(options or {}).get("include_usage", "bool", False)
    return stream, include_usage


def _completion_prompt(prompt: Any) -> PromptInput:
    """A string, a token-id list, or a one-element list of either."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("prompt", f"got {len(prompt)} prompts; send one prompt per request (no batching)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return PromptInput(text=prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return PromptInput(token_ids=tuple(prompt))
    if prompt is None:
        raise bad_request("prompt", "prompt is required")
    raise bad_request("prompt", "expected a string or an array of token ids")


def parse_messages(messages: Any) -> tuple[ChatMessage, ...]:
    """A chat body's ``messages`` (OpenAI's shape); a 400 naming the message at fault."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "expected a non-empty array of {role, content} objects")
    return tuple(_message(i, m) for i, m in enumerate(messages))


def _message(index: int, message: Any) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(param, "expected an object with role and content")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise bad_request(f"{param}.role", "expected a non-empty string")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = _text_parts(param, content)
    if not isinstance(content, str):
        raise bad_request(f"{param}.content", "expected a string or an array of text parts")
    fields = Fields(message)
    tool_calls = fields.get("tool_calls", "list") if role == "assistant" else None
    tool_call_id = fields.get("tool_call_id", "str", "") if role == "tool" else ""
    calls_json = json.dumps(tool_calls) if tool_calls else ""
    return ChatMessage(role=role, content=content, tool_calls_json=calls_json, tool_call_id=tool_call_id)


def _text_parts(param: str, parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.content", "only text content parts ({type: text, text}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)
