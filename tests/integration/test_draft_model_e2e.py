"""The draft model through the real system (tiny random Llama and a smaller random draft of its vocabulary).

An executor started with a bad ``--draft-model`` (no such folder, no tokenizer,
another vocabulary) exits at once with a message naming the flag and the
problem, before loading any weights.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from support.services import executor_service
from support.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_model_dir, tmp_path_factory):
    """A one-layer random Llama with the tiny model's tokenizer (other weights)."""
    folder = tmp_path_factory.mktemp("draft") / "tiny-draft"
    return build_tiny_model(folder, seed=7, num_layers=1, tokenizer_from=tiny_model_dir)


def _start_fails(model_dir, log_dir, name: str, draft: str) -> str:
    """The log of an executor that must exit with status 1 when started with ``--draft-model draft``."""
    service = executor_service(name, model_dir, log_dir, ["--draft-model", draft]).start()
    try:
        assert service.process is not None
        returncode = service.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        service.stop()
        pytest.fail(f"{name} did not exit:\n{service.log_text()[-3000:]}")
    assert returncode == 1, service.log_text()[-3000:]
    return service.log_text()


def test_a_bad_draft_model_stops_the_executor_with_a_clear_error(tiny_model_dir, tiny_draft_dir, tmp_path):
    missing = tmp_path / "no-such-draft"
    log = _start_fails(tiny_model_dir, tmp_path, "missing", str(missing))
    assert f"--draft-model '{missing}': model '{missing}' not found" in log
    untokenized = tmp_path / "untokenized"
    shutil.copytree(tiny_draft_dir, untokenized)
    (untokenized / "tokenizer.json").unlink()
    log = _start_fails(tiny_model_dir, tmp_path, "untokenized", str(untokenized))
    assert "no tokenizer.json; a draft model needs the model's tokenizer" in log
    other = build_tiny_model(tmp_path / "other-vocab", vocab_size=256, num_layers=1)
    log = _start_fails(tiny_model_dir, tmp_path, "other", str(other))
    # A byte-level BPE trained for 256 tokens keeps its whole alphabet: 259.
    assert "its tokenizer is not the model's (259 tokens instead of 384)" in log
    assert "executor_ready" not in log
