"""Render the parameter messages from the table, then generate the Python code of protos/ into pagoda/v1/.

Both are committed; tests check they are current. The fields of ``SamplingParams``
(common.proto) and ``StoppingCriteria`` (generation.proto) live between marker
comments and are rendered from ``pagoda.params``, one per table row: its ``help``
as the comment, then ``proto_type``, name and ``number``. Everything outside the
markers is hand-written.

Usage: python -m scripts.gen_proto [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import textwrap

import grpc_tools
from grpc_tools import protoc

from pagoda.params import PARAM_CLASSES, RANDOM_SEED, ParamField, rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
# protoc writes pagoda/v1/*_pb2*.py under this root, beside the hand-written package.
CODE_ROOT = ROOT
BEGIN = "  // BEGIN fields rendered from pagoda.params by `make proto`: edit the table, not these lines.\n"
END = "  // END fields rendered from pagoda.params.\n"
# message <Name> {, the begin marker, the rendered fields, the end marker.
_RENDERED = re.compile(r"(message (\w+) \{\n" + re.escape(BEGIN) + r")(.*?)(" + re.escape(END) + r")", re.DOTALL)
_GROUP_OF_MESSAGE = {cls.__name__: group for group, cls in PARAM_CLASSES.items()}
COMMENT_WIDTH = 100


def render_field(row: ParamField) -> str:
    """One field: its help (and the value an unset field takes) as a comment, then the declaration."""
    text = row.spec.help[:1].upper() + row.spec.help[1:]
    unset = row.spec.unset
    if row.spec.has_presence and unset is not None and unset != RANDOM_SEED:
        text += f"; unset: {_number(unset)}"
    comment = textwrap.wrap(text + ".", COMMENT_WIDTH - len("  // "))
    lines = [f"  // {line}\n" for line in comment]
    return "".join(lines) + f"  {row.spec.proto_type} {row.name} = {row.spec.number};\n"


def render_proto(text: str) -> str:
    """``text`` with every marked message's fields rendered from the table.

    Raises:
        ValueError: a marked message that is not a table dataclass.
    """

    def fields(match: re.Match[str]) -> str:
        group = _GROUP_OF_MESSAGE.get(match.group(2))
        if group is None:
            raise ValueError(f"message {match.group(2)} is marked but is not a pagoda.params dataclass")
        return match.group(1) + "".join(render_field(row) for row in rows(group)) + match.group(4)

    return _RENDERED.sub(fields, text)


def proto_files(proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Every .proto under ``proto_root``, sorted."""
    return sorted(proto_root.rglob("*.proto"))


def render_protos(proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Rewrites the .proto files whose rendered fields are stale; returns those it changed."""
    changed = []
    for path in proto_files(proto_root):
        text = path.read_text()
        rendered = render_proto(text)
        if rendered != text:
            path.write_text(rendered)
            changed.append(path)
    return changed


def generate(out_dir: pathlib.Path, proto_root: pathlib.Path = PROTO_ROOT) -> None:
    """Run protoc over every .proto under ``proto_root`` into ``out_dir``."""
    protos = [str(p.relative_to(proto_root)) for p in proto_files(proto_root)]
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=CODE_ROOT)
    args = parser.parse_args()
    for path in render_protos():
        print(f"rendered the parameter fields of {path.relative_to(ROOT)}")
    generate(args.out)


if __name__ == "__main__":
    main()
