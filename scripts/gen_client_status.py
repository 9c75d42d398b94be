"""Render ``client/_status.py``: the client's status types, one frozen dataclass per proto message.

The messages are read from the .proto files through protoc (with their comments), so
the wire and the client's types have one definition. Each message becomes a dataclass
of the same name; each field keeps its name, takes a Python type from its proto type
(a map a dict, a repeated field a tuple, a message the dataclass rendered for it, a
proto3 ``optional`` scalar ``T | None``), defaults to what the proto reads when it is
unset, and has its leading comment as docstring (a field without one is an error).

Usage: python -m scripts.gen_client_status [--check]
(``make proto`` runs it; a test checks the committed file is current.)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import textwrap

import grpc_tools
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_tools import protoc

from scripts.gen_proto import PROTO_ROOT

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "client" / "_status.py"
# The .proto file that declares the rendered messages, and the messages rendered (with those they refer to).
PROTO_FILE = "pagoda/v1/generation.proto"
ROOTS = ("pagoda.v1.ServerStatus",)
WIDTH = 120
_MESSAGE_TYPE, _FIELD = 4, 2  # DescriptorProto's and FileDescriptorProto's field numbers (SourceCodeInfo paths)

# (Python type, its default) of each scalar proto type.
_SCALARS = {
    FieldDescriptor.TYPE_STRING: ("str", '""'),
    FieldDescriptor.TYPE_BYTES: ("bytes", 'b""'),
    FieldDescriptor.TYPE_BOOL: ("bool", "False"),
    FieldDescriptor.TYPE_FLOAT: ("float", "0.0"),
    FieldDescriptor.TYPE_DOUBLE: ("float", "0.0"),
    **dict.fromkeys(
        (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_FIXED32,
            FieldDescriptor.TYPE_FIXED64,
            FieldDescriptor.TYPE_SFIXED32,
            FieldDescriptor.TYPE_SFIXED64,
        ),
        ("int", "0"),
    ),
}

HEADER = '''"""The server's status types (``Client.status()``), one frozen dataclass per proto message.

Generated from {proto} by ``make proto`` (``python -m scripts.gen_client_status``);
do not edit: a field is documented by its comment in the .proto. The client converts a
message by field name (``pagoda_client.core.convert.message_from_pb``).
``tests/client/test_status_types.py`` checks that this file is current.
"""

from __future__ import annotations

from dataclasses import dataclass, field
'''


class ProtoFile:
    """One .proto file as protoc parses it: its messages (in a pool) and their comments."""

    def __init__(self, name: str, proto_root: pathlib.Path = PROTO_ROOT) -> None:
        files = _descriptor_set(name, proto_root).file
        pool = descriptor_pool.DescriptorPool()
        for file in files:  # imports first, as protoc lists them
            pool.Add(file)
        self.pool = pool
        self.name = name
        source = next(f for f in files if f.name == name)
        # The top-level messages in their order (their index is in the comments' paths).
        self.top_level = [f"{source.package}.{m.name}" for m in source.message_type]
        # SourceCodeInfo path -> leading comment (its lines, without the "//").
        self.comments = {tuple(loc.path): loc.leading_comments for loc in source.source_code_info.location}

    def message(self, full_name: str) -> Descriptor:
        """The message ``full_name`` (it must be declared at the top level of this file)."""
        message = self.pool.FindMessageTypeByName(full_name)
        if message.file.name != self.name or message.containing_type is not None:
            raise ValueError(f"{full_name}: not a top-level message of {self.name}")
        return message

    def comment(self, message: Descriptor, field: FieldDescriptor | None = None) -> str:
        """The leading comment of ``message`` (or of its ``field``), as one paragraph.

        Raises:
            ValueError: it has none.
        """
        path: tuple[int, ...] = (_MESSAGE_TYPE, self.top_level.index(message.full_name))
        if field is not None:
            path += (_FIELD, field.index)
        lines = [line.strip() for line in self.comments.get(path, "").splitlines()]
        text = " ".join(line for line in lines if line)
        if not text:
            what = message.full_name + (f".{field.name}" if field is not None else "")
            raise ValueError(f"{what} has no comment in {self.name}: it is the client's docstring")
        return text


def _descriptor_set(name: str, proto_root: pathlib.Path) -> descriptor_pb2.FileDescriptorSet:
    """protoc's parse of ``name`` and what it imports, with comments."""
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "set.pb"
        args = ["protoc", f"-I{proto_root}", f"-I{include}", "--include_imports", "--include_source_info"]
        if protoc.main([*args, f"--descriptor_set_out={out}", name]) != 0:
            raise RuntimeError(f"protoc failed on {name}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def ordered(proto: ProtoFile, roots: tuple[str, ...]) -> list[Descriptor]:
    """``roots`` and every message their fields refer to, each after those it refers to."""
    done: dict[str, Descriptor] = {}

    def visit(message: Descriptor) -> None:
        if message.full_name in done:
            return
        for f in message.fields:
            target = _map_value(f) if _is_map(f) else f
            if target.message_type is not None:
                visit(proto.message(target.message_type.full_name))
        done[message.full_name] = message

    for name in roots:
        visit(proto.message(name))
    return list(done.values())


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _map_value(f: FieldDescriptor) -> FieldDescriptor:
    value: FieldDescriptor = f.message_type.fields_by_name["value"]
    return value


def _scalar(f: FieldDescriptor) -> tuple[str, str]:
    """(type, default) of one value of ``f``: a scalar, or the dataclass of a message."""
    if f.message_type is not None:
        return f.message_type.name, f"field(default_factory={f.message_type.name})"
    if f.type not in _SCALARS:
        raise ValueError(f"{f.full_name}: proto type {f.type} has no Python type here (enums are not rendered)")
    return _SCALARS[f.type]


def annotation(f: FieldDescriptor) -> tuple[str, str]:
    """(Python type, default) of a field."""
    if _is_map(f):
        key, _ = _scalar(f.message_type.fields_by_name["key"])
        value, _ = _scalar(_map_value(f))
        return f"dict[{key}, {value}]", "field(default_factory=dict)"
    kind, default = _scalar(f)
    if f.is_repeated:
        return f"tuple[{kind}, ...]", "()"
    if f.has_presence and f.message_type is None:
        return f"{kind} | None", "None"
    return kind, default


def docstring(text: str, indent: str) -> list[str]:
    """A docstring of ``text`` wrapped to the line width, as ``ruff format`` leaves it."""
    one_line = f'{indent}"""{text}"""'
    if len(one_line) <= WIDTH:
        return [one_line]
    lines = textwrap.wrap(f'"""{text}"""', WIDTH - len(indent))
    return [indent + line for line in lines]


def render_message(proto: ProtoFile, message: Descriptor) -> list[str]:
    """One frozen dataclass: the message's comment, then each field with its type, default and comment."""
    lines = ["", "", "@dataclass(frozen=True)", f"class {message.name}:"]
    lines += docstring(proto.comment(message), "    ") + [""]
    for f in message.fields:
        kind, default = annotation(f)
        lines.append(f"    {f.name}: {kind} = {default}")
        lines += docstring(proto.comment(message, f), "    ")
    return lines


def render(proto_root: pathlib.Path = PROTO_ROOT, name: str = PROTO_FILE, roots: tuple[str, ...] = ROOTS) -> str:
    """The module's text: the dataclasses of ``roots`` and of what they refer to, from ``name``'s messages."""
    proto = ProtoFile(name, proto_root)
    lines = [HEADER.format(proto=f"protos/{name}").rstrip("\n")]
    for message in ordered(proto, roots):
        lines += render_message(proto, message)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    text = render()
    if parser.parse_args().check:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run make proto", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
