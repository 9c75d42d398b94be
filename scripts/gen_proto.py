"""Generate the Python code for protos/ (committed; a test checks it is current).

Usage: python -m scripts.gen_proto [--out DIR]
"""

import argparse
import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc over every .proto under protos/ into out_dir."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
