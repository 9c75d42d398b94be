"""Fixtures of the security tests: a tiny model and throwaway certificates."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for scripts/

from support.tiny_model import build_tiny_model

from scripts.make_certs import CertPaths, issue, make_ca, write_certs


@dataclasses.dataclass(frozen=True)
class Certs:
    """The system's CA and certificates, plus a client certificate from another CA."""

    paths: CertPaths
    rogue_client_cert: Path
    rogue_client_key: Path

    def read(self, name: str) -> bytes:
        return Path(getattr(self.paths, name)).read_bytes()


@pytest.fixture(scope="session")
def security_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (vocab 384) with tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("security-tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    """A fresh CA with server and client certificates, and a rogue client certificate."""
    folder = tmp_path_factory.mktemp("certs")
    paths = write_certs(folder)
    rogue = issue(make_ca("Rogue CA"), "intruder", server=False, client=True)
    (folder / "rogue.pem").write_bytes(rogue.cert_pem)
    (folder / "rogue-key.pem").write_bytes(rogue.key_pem)
    return Certs(paths, folder / "rogue.pem", folder / "rogue-key.pem")
