"""The committed .proto text and gRPC code are what `make proto` renders and generates.

The parameter messages are rendered from the table (pagoda.params): their wire
(names, numbers, types, presence) follows each row, and a stale .proto or pb2
file fails here.
"""

from __future__ import annotations

import pathlib

import pytest

from pagoda import params
from pagoda.params_pb import MESSAGE_OF_CLASS
from scripts.gen_proto import BEGIN, CODE_ROOT, PROTO_ROOT, generate, proto_files, render_field, render_proto

# FieldDescriptor.type of each proto scalar the table uses.
_PROTO_TYPE_NUMBERS = {"float": 2, "int32": 5, "uint64": 4, "bool": 8, "string": 9}


def test_proto_text_is_rendered_from_the_table():
    marked = [path for path in proto_files() if BEGIN in path.read_text()]
    assert {p.name for p in marked} == {"common.proto", "generation.proto"}
    for path in proto_files():
        assert path.read_text() == render_proto(path.read_text()), f"{path.name} is stale; run make proto"


def test_generated_code_is_current(tmp_path):
    """protoc over the rendered .proto files gives the committed pb2 files, byte for byte."""
    protos, out = tmp_path / "protos", tmp_path / "out"
    for path in proto_files():
        rendered = protos / path.relative_to(PROTO_ROOT)
        rendered.parent.mkdir(parents=True, exist_ok=True)
        rendered.write_text(render_proto(path.read_text()))
    out.mkdir()
    generate(out, protos)
    generated = sorted(p.relative_to(out) for p in out.rglob("*.py*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = CODE_ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run make proto"
        assert committed.read_text() == (out / rel).read_text(), f"{rel} is stale; run make proto"


def test_a_stale_or_edited_field_is_rendered_back():
    text = (PROTO_ROOT / "pagoda" / "v1" / "common.proto").read_text()
    edited = text.replace("optional float top_p = 2;", "optional double top_p = 12;")
    assert edited != text
    assert render_proto(edited) == text


def test_a_new_row_renders_as_a_proto_field():
    row = params.ParamField(
        "typical_p",
        "sampling",
        "float",
        params.Param(10, "optional float", "locally typical sampling mass; 1 disables", unset=1.0),
        1.0,
    )
    assert render_field(row) == (
        "  // Locally typical sampling mass; 1 disables; unset: 1.\n  optional float typical_p = 10;\n"
    )


def test_marked_messages_must_be_table_dataclasses():
    text = f"message Other {{\n{BEGIN}  int32 x = 1;\n  // END fields rendered from pagoda.params.\n}}\n"
    with pytest.raises(ValueError, match="Other"):
        render_proto(text)


@pytest.mark.parametrize("cls", [params.SamplingParams, params.StoppingCriteria])
def test_the_wire_of_each_parameter_follows_its_row(cls):
    """Names, numbers, scalar types, presence and lists of the generated messages equal the table's."""
    descriptor = MESSAGE_OF_CLASS[cls].DESCRIPTOR
    assert descriptor.name == cls.__name__
    group = params.group_of(cls)
    assert [f.name for f in descriptor.fields] == list(params.names(group))
    for row in params.rows(group):
        field = descriptor.fields_by_name[row.name]
        spec = row.spec
        assert field.number == spec.number, row.name
        assert field.type == _PROTO_TYPE_NUMBERS[spec.proto_type.rsplit(" ", 1)[-1]], row.name
        assert (field.has_presence, field.is_repeated) == (spec.has_presence, spec.repeated), row.name


def test_fields_without_presence_default_to_their_zero_value():
    """Such a field cannot say "unset", so the table's default must be what the proto reads as unset."""
    zero_of_kind = {"float": 0.0, "int": 0, "bool": False, "str": ""}
    for row in params.fields():
        if not row.spec.has_presence:
            assert row.default == (() if row.spec.repeated else zero_of_kind[row.spec.value_kind]), row.name


def test_every_proto_has_generated_code():
    for proto in PROTO_ROOT.rglob("*.proto"):
        stem = CODE_ROOT / proto.relative_to(PROTO_ROOT).with_suffix("")
        assert pathlib.Path(f"{stem}_pb2.py").exists(), f"no generated code for {proto}"
