"""The output constraint on the client side: library keywords and CLI flags build GenerateRequest.structured."""

from __future__ import annotations

import json

import pytest

from pagoda.constraint import Constraint
from pagoda.constraint_pb import constraint_from_pb
from pagoda_client.cli import build_parser, generation_kwargs
from pagoda_client.core.requests import build_generate_request, resume_request

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"json_schema": SCHEMA}, Constraint("json_schema", text=json.dumps(SCHEMA))),
        ({"json_schema": '{"type": "string"}'}, Constraint("json_schema", text='{"type": "string"}')),
        ({"json_object": True}, Constraint("json_object")),
        ({"regex": "[0-9]+"}, Constraint("regex", text="[0-9]+")),
        ({"grammar": 'start: "a"'}, Constraint("grammar", text='start: "a"')),
        ({"choice": ["yes", "no"]}, Constraint("choice", choices=("yes", "no"))),
        ({"json_object": False}, None),
        ({}, None),
    ],
)
def test_keywords_build_the_constraint(options, expected):
    request = build_generate_request("hi", options)
    assert constraint_from_pb(request.structured) == expected
    assert request.HasField("structured") == (expected is not None)


def test_a_resume_keeps_the_constraint():
    request = build_generate_request("hi", {"regex": "a+"})
    resumed = resume_request(request, "r1", 7, [5, 6])
    assert constraint_from_pb(resumed.structured) == Constraint("regex", text="a+")


def test_two_constraints_are_refused():
    with pytest.raises(ValueError, match="at most one of"):
        build_generate_request("hi", {"regex": "a", "choice": ["b"]})


def test_a_bare_string_is_not_a_choice():
    with pytest.raises(TypeError, match="choice"):
        build_generate_request("hi", {"choice": "abc"})


def test_cli_flags(tmp_path):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMA))
    parser = build_parser()
    kwargs = generation_kwargs(parser.parse_args(["generate", "x", "--json-schema", str(schema_file)]))
    assert json.loads(kwargs["json_schema"]) == SCHEMA and kwargs["regex"] is None
    kwargs = generation_kwargs(parser.parse_args(["generate", "x", "--choice", "a,b,c"]))
    assert kwargs["choice"] == ["a", "b", "c"]
    kwargs = generation_kwargs(parser.parse_args(["chat", "x", "--regex", "[a-z]+", "--json-object"]))
    assert kwargs["regex"] == "[a-z]+" and kwargs["json_object"] is True


def test_cli_refuses_an_unreadable_schema_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--json-schema", str(tmp_path / "missing.json")])
    assert "cannot read" in capsys.readouterr().err
