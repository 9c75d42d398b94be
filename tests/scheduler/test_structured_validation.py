"""Output constraints are checked before admission: INVALID_ARGUMENT naming the field, with the engine's reason."""

from __future__ import annotations

import json

import pytest

from pagoda.constraint import MAX_CHOICES, Constraint
from scheduler_svc.api.validation import check_structured
from scheduler_svc.errors import InvalidRequest


def refusal(constraint: Constraint) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        check_structured(constraint)
    return info.value


@pytest.mark.parametrize(
    "constraint",
    [
        None,
        Constraint("json_schema", text=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
        Constraint("json_object"),
        Constraint("regex", text=r"\d{3}-[a-z]+"),
        Constraint("grammar", text='start: "yes" | "no"'),
        Constraint("choice", choices=("red", "green", "a.b|c")),
    ],
)
def test_valid_constraints_pass(constraint):
    check_structured(constraint)


@pytest.mark.parametrize(
    ("constraint", "field", "reason"),
    [
        (Constraint("json_schema", text="{not json"), "structured.json_schema", "not valid JSON"),
        (Constraint("json_schema", text="[1, 2]"), "structured.json_schema", "object or a boolean"),
        (
            Constraint("json_schema", text='{"type": "integer", "minimum": 5, "maximum": 1}'),
            "structured.json_schema",
            "",
        ),
        (Constraint("json_schema", text='{"type": "frobnicate"}'), "structured.json_schema", "frobnicate"),
        (Constraint("json_schema", text=""), "structured.json_schema", "must not be empty"),
        (Constraint("regex", text="(unclosed"), "structured.regex", ""),
        (Constraint("grammar", text="start: undefined_rule"), "structured.grammar", "undefined_rule"),
        (Constraint("choice"), "structured.choice", "at least one"),
        (Constraint("choice", choices=("a", "")), "structured.choice", "non-empty"),
        (Constraint("choice", choices=("x",) * (MAX_CHOICES + 1)), "structured.choice", f"at most {MAX_CHOICES}"),
    ],
)
def test_bad_constraints_name_their_field(constraint, field, reason):
    error = refusal(constraint)
    assert error.field == field
    assert reason in str(error) and str(error).startswith(f"{field}: ")


def test_unsupported_schema_keyword_is_refused_not_ignored():
    """A keyword the engine cannot enforce is an error (strict), not a silently looser constraint."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {"required": ["b"]}}}
    error = refusal(Constraint("json_schema", text=json.dumps(schema)))
    assert error.field == "structured.json_schema" and "dependentSchemas" in str(error)
