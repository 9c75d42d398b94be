"""A constraint as the grammar engine's grammar, and whether the engine accepts it.

The engine is llguidance (docs/structured-outputs.md says why): the scheduler
validates here, without a tokenizer; the executor builds its matchers from the
same ``grammar_of``, so what one accepts the other runs. llguidance is a Rust
extension that imports neither torch nor numpy.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance

from pagoda.constraint import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (no free whitespace between tokens): a model cannot pad an object
# with whitespace until max_tokens, and outputs are as OpenAI's.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint.

    Raises:
        ValueError: the JSON schema is not JSON (llguidance's message).
    """
    kind = constraint.kind
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(constraint.text)
    return llguidance.LLMatcher.grammar_from_regex("|".join(_literal(c) for c in constraint.choices))


def _literal(text: str) -> str:
    """``text`` as a regex that matches it exactly (ASCII punctuation and spaces as \\x{..} escapes)."""
    return "(?:" + "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):02X}}}" for c in text) + ")"


def check(constraint: Constraint) -> str | None:
    """Why the engine refuses ``constraint`` (invalid, unsupported, does not compile), or None."""
    problem = constraint.problem()
    if problem is not None:
        return problem
    return _engine_check(constraint)


@functools.lru_cache(maxsize=1024)
def _engine_check(constraint: Constraint) -> str | None:
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.text)
        except ValueError as exc:
            return f"not valid JSON: {exc}"
        if not isinstance(schema, (dict, bool)):
            return "a JSON schema is an object or a boolean"
    try:
        grammar = grammar_of(constraint)
    except ValueError as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return error or None
