"""The client's status types are rendered from their proto messages, and converted back by field name."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
import textwrap

import pytest

import pagoda_client
from pagoda.v1 import generation_pb2
from pagoda_client import _status
from pagoda_client.core.convert import message_from_pb, status_from_pb
from scripts.gen_client_status import OUT, render
from scripts.gen_proto import generate

# A message of every shape the generator renders, in a file of its own.
SHAPES_PROTO = """
syntax = "proto3";
package shapes.v1;

// A point.
message Point {
  // Across.
  double x = 1;
  // Down, or unknown.
  optional int32 y = 2;
}

// Every shape.
message Shapes {
  // A name.
  string name = 1;
  // Raw bytes, with a comment long enough to wrap: it goes on past the line width of the generated module, which
  // is one hundred and twenty characters.
  bytes blob = 2;
  // Points by name.
  map<string, Point> by_name = 3;
  // Counts by name.
  map<string, int64> counts = 4;
  // Points in order.
  repeated Point points = 5;
  // The one point.
  Point origin = 6;
  // Tags.
  repeated string tags = 7;
  // A flag.
  bool on = 8;
}
"""


def test_generated_status_types_are_current():
    assert OUT.read_text() == render(), "client/_status.py is stale: run make proto"


@pytest.mark.parametrize("name", ["ServerStatus", "ExecutorStatus"])
def test_each_status_type_has_its_messages_fields_by_name_in_order(name):
    cls, message = getattr(pagoda_client, name), getattr(generation_pb2, name)
    assert cls is getattr(_status, name)
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in message.DESCRIPTOR.fields]
    assert message_from_pb(cls, message()) == cls()  # the defaults are what an unset field reads


def test_status_fields_keep_their_docstrings():
    source = pathlib.Path(_status.__file__).read_text()
    assert '"""This scheduler\'s id in the executors\' leases."""' in source
    assert "Draft tokens the draft models proposed." in source
    assert '{"attention": "cpp", "gemm": "amx-panel"}' in source


def test_status_from_pb_converts_nested_messages_maps_and_lists():
    pb = generation_pb2.ServerStatus(
        num_running=2,
        executors=[generation_pb2.ExecutorStatus(address="a:1", kernels={"gemm": "amx", "attention": "cpp"})],
        schedulers=["s1", "s2"],
        spec_model_accepted_tokens_total=5,
    )
    status = status_from_pb(pb)
    assert status == pagoda_client.ServerStatus(
        num_running=2,
        executors=(pagoda_client.ExecutorStatus(address="a:1", kernels={"attention": "cpp", "gemm": "amx"}),),
        schedulers=("s1", "s2"),
        spec_model_accepted_tokens_total=5,
    )
    assert list(status.executors[0].kernels) == ["attention", "gemm"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.num_running = 3  # type: ignore[misc]


@pytest.fixture
def shapes(tmp_path, monkeypatch):
    """(the generated messages, the rendered dataclasses) of SHAPES_PROTO, both imported."""
    protos, out = tmp_path / "protos", tmp_path / "out"
    (protos / "shapes" / "v1").mkdir(parents=True)
    (protos / "shapes" / "v1" / "shapes.proto").write_text(SHAPES_PROTO)
    out.mkdir()
    generate(out, protos)
    monkeypatch.syspath_prepend(str(out))
    messages = importlib.import_module("shapes.v1.shapes_pb2")
    rendered = tmp_path / "shapes_status.py"
    rendered.write_text(render(protos, "shapes/v1/shapes.proto", ("shapes.v1.Shapes",)))
    spec = importlib.util.spec_from_file_location("shapes_status", rendered)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses looks its module up there
    spec.loader.exec_module(module)
    yield messages, module, rendered.read_text()
    for name in [n for n in sys.modules if n == "shapes" or n.startswith("shapes.")]:
        del sys.modules[name]


def test_every_field_shape_renders_its_python_type_and_default(shapes):
    _, module, text = shapes
    types = {f.name: f.type for f in dataclasses.fields(module.Shapes)}
    assert types == {
        "name": "str",
        "blob": "bytes",
        "by_name": "dict[str, Point]",
        "counts": "dict[str, int]",
        "points": "tuple[Point, ...]",
        "origin": "Point",
        "tags": "tuple[str, ...]",
        "on": "bool",
    }
    assert {f.name: f.type for f in dataclasses.fields(module.Point)} == {"x": "float", "y": "int | None"}
    assert module.Shapes() == module.Shapes("", b"", {}, {}, (), module.Point(0.0, None), (), False)
    assert text.index("class Point") < text.index("class Shapes")  # what a message refers to comes first
    assert '    """Down, or unknown."""' in text
    assert max(len(line) for line in text.splitlines()) <= 120
    assert module.Shapes.__doc__ == "Every shape."


def test_every_field_shape_converts_from_its_message(shapes):
    messages, module, _ = shapes
    pb = messages.Shapes(
        name="n",
        blob=b"\x00\x01",
        by_name={"b": messages.Point(x=2.0), "a": messages.Point(x=1.0, y=0)},
        counts={"z": 1, "y": 2},
        points=[messages.Point(x=3.0, y=4)],
        origin=messages.Point(y=-1),
        tags=["t"],
        on=True,
    )
    shapes_value = message_from_pb(module.Shapes, pb)
    Point = module.Point
    assert shapes_value == module.Shapes(
        name="n",
        blob=b"\x00\x01",
        by_name={"a": Point(1.0, 0), "b": Point(2.0, None)},  # y=0 was set: 0, not None
        counts={"y": 2, "z": 1},
        points=(Point(3.0, 4),),
        origin=Point(0.0, -1),
        tags=("t",),
        on=True,
    )
    assert list(shapes_value.by_name) == ["a", "b"] and list(shapes_value.counts) == ["y", "z"]
    assert message_from_pb(module.Shapes, messages.Shapes()) == module.Shapes()


def test_a_field_without_a_comment_is_refused_by_name(tmp_path):
    (tmp_path / "bare.proto").write_text(
        textwrap.dedent(
            """
            syntax = "proto3";
            package bare;
            // A message.
            message Bare {
              // One.
              int32 one = 1;
              int32 two = 2;
            }
            """
        )
    )
    with pytest.raises(ValueError, match=r"bare\.Bare\.two has no comment"):
        render(tmp_path, "bare.proto", ("bare.Bare",))


def test_an_enum_field_is_refused_by_name(tmp_path):
    (tmp_path / "e.proto").write_text(
        textwrap.dedent(
            """
            syntax = "proto3";
            package e;
            // A color.
            enum Color { COLOR_UNSPECIFIED = 0; }
            // A message.
            message M {
              // Its color.
              Color color = 1;
            }
            """
        )
    )
    with pytest.raises(ValueError, match=r"e\.M\.color: proto type"):
        render(tmp_path, "e.proto", ("e.M",))
