"""Real processes: a scheduler and executors started by the launcher."""

from __future__ import annotations

import pytest
from support.system import fp32_launcher
from support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a trained tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_system(tiny_model_dir, tmp_path_factory):
    """One executor (fp32, 64 KV blocks of 16) and a scheduler on the tiny model."""
    with fp32_launcher(tiny_model_dir, tmp_path_factory.mktemp("logs"), block_size=16) as system:
        yield system
