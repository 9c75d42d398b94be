"""The committed gRPC code is what `make proto` generates from protos/."""

from __future__ import annotations

import pathlib

from scripts.gen_proto import PROTO_ROOT, generate


def test_generated_code_is_current(tmp_path):
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = PROTO_ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run make proto"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale; run make proto"


def test_every_proto_has_generated_code():
    for proto in PROTO_ROOT.rglob("*.proto"):
        stem = proto.with_suffix("")
        assert pathlib.Path(f"{stem}_pb2.py").exists(), f"no generated code for {proto}"
