"""OpenAI tool calling on the chat API: definitions for the template, tool_choice as a constraint, calls parsed.

Tool definitions go to the chat template as ``tools`` (the Hugging Face
convention). ``tool_choice``: ``none`` parses no call; ``auto`` parses the
calls the model writes as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
(the Hermes / Qwen convention); ``required`` and a named function constrain the
whole output to one ``{"name", "arguments"}`` object whose arguments match the
function's parameters schema, so the output is the call.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from pagoda import grammar
from pagoda.constraint import Constraint
from scheduler_svc.api.http.errors import bad_request

MAX_TOOLS = 64
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL_BLOCK = re.compile(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)", re.DOTALL)
_NO_PARAMETERS = {"type": "object", "properties": {}}
Json = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """What a chat request's tools and tool_choice ask for."""

    # The tools as the template gets them (JSON text).
    tools_json: str
    # Function name -> its parameters schema.
    functions: dict[str, Json]
    # required or a named function: the output is one call, constrained.
    forced: bool
    # Calls are parsed from the output (every choice but none).
    parse: bool
    constraint: Constraint | None


def parse_tools(tools: Any, tool_choice: Any) -> ToolSpec | None:
    """The tool part of a chat body (None without tools); a 400 naming the parameter when malformed."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools", "expected a non-empty array of tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    functions: dict[str, Json] = {}
    for i, tool in enumerate(tools):
        name, parameters = _function(i, tool)
        if name in functions:
            raise bad_request(f"tools[{i}].function.name", f"{name!r} is defined twice")
        functions[name] = parameters
    chosen = _tool_choice(tool_choice, functions)
    forced = chosen not in ("auto", "none")
    constraint = None
    if forced:
        names = list(functions) if chosen == "required" else [chosen]
        constraint = Constraint("json_schema", text=json.dumps(_call_schema(names, functions)))
    return ToolSpec(json.dumps(tools), functions, forced, chosen != "none", constraint)


def _function(index: int, tool: Any) -> tuple[str, Json]:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{param}.type", "only function tools ({type: function, function: {...}}) are supported")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{param}.function", "expected an object with name and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{param}.function.name", "expected 1 to 64 letters, digits, '_' or '-'")
    parameters = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters", "expected a JSON schema object")
    problem = grammar.check(Constraint("json_schema", text=json.dumps(parameters)))
    if problem is not None:
        raise bad_request(f"{param}.function.parameters", problem)
    return name, parameters


def _tool_choice(tool_choice: Any, functions: dict[str, Json]) -> str:
    """auto, none, required, or the name of the function the call must be."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("auto", "none", "required"):
        return str(tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise bad_request("tool_choice", "expected auto, none, required or {type: function, function: {name}}")
    if name not in functions:
        raise bad_request("tool_choice", f"function {name!r} is not in tools")
    return name


def _call_schema(names: list[str], functions: dict[str, Json]) -> Json:
    """One call of one of ``names``: {"name": <name>, "arguments": <its parameters>}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": functions[name]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def parse_calls(text: str, spec: ToolSpec) -> tuple[str, list[Json]]:
    """(content, tool calls) of a whole output; the text stays content when it holds no valid call."""
    if not spec.parse:
        return text, []
    if spec.forced:
        call = _call(text, spec)
        return (text, []) if call is None else ("", [call])
    start = text.find(CALL_START)
    if start < 0:
        return text, []
    calls = [_call(block, spec) for block in _CALL_BLOCK.findall(text, start)]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:start].strip(), [c for c in calls if c is not None]


def _call(text: str, spec: ToolSpec) -> Json | None:
    """OpenAI's tool call object of one {"name", "arguments"} JSON text, or None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in spec.functions:
        return None
    arguments = obj.get("arguments", {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolStream:
    """A streamed output's content, with the tool calls held back until they are complete."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        # Text not streamed yet: a call in progress, or what could be the start of one.
        self._held = ""
        self._in_call = spec.forced

    def feed(self, text: str) -> str:
        """The content of ``text`` that can be streamed now."""
        self._held += text
        if self._in_call:
            return ""
        start = self._held.find(CALL_START)
        if start >= 0:
            self._in_call = True
            out, self._held = self._held[:start], self._held[start:]
        else:
            keep = _partial_marker(self._held)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def finish(self) -> tuple[str, list[Json]]:
        """At the end: (the content still held, the calls parsed from it)."""
        held, self._held = self._held, ""
        content, calls = parse_calls(held, self.spec)
        return (content, calls) if calls else (held, [])


def _partial_marker(text: str) -> int:
    """How many trailing characters of ``text`` could begin CALL_START."""
    for size in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-size:]):
            return size
    return 0
