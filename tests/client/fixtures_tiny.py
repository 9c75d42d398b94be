"""Fixtures of the client tests: a tiny model folder and a real system on it.

The folder (random Llama in safetensors, byte-level BPE tokenizer trained with
``tokenizers`` whose vocabulary is the model's, chat template, EOS, generation
config) comes from ``support.tiny_model``, shared with the integration tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.system import fp32_launcher
from support.tiny_model import build_tiny_model

TINY_VOCAB_SIZE = 384
TINY_EOS_ID = 0


@pytest.fixture(scope="session")
def client_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint folder with tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("client-tiny") / "tiny-llama", vocab_size=TINY_VOCAB_SIZE)


@pytest.fixture(scope="module")
def client_tiny_system(client_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One fp32 executor and a scheduler on the tiny model, started by ``Launcher``."""
    logs = tmp_path_factory.mktemp("client-logs")
    with fp32_launcher(client_tiny_model_dir, logs, "512KiB", startup_timeout_s=180) as system:
        yield system
