"""``--quantization`` through the real processes: passed through, reported, served; a bad mode stops the start."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.system import fp32_launcher
from support.tiny_model import write_tokenizer_files

from pagoda_client import Client
from tests.executor.conftest import make_tiny_checkpoint

pytestmark = pytest.mark.integration
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 64, 128, 3, 77]


def _runner_greedy(model_dir, prompt: list[int], max_new: int) -> list[int]:
    """The same model in this process (the executor's code, no gRPC), one sequence, greedy."""
    from executor_svc.runner.model_runner import ModelRunner
    from pagoda import step as t
    from pagoda.params import SamplingParams

    runner = ModelRunner(
        str(model_dir), dtype="float32", block_size=16, kv_cache_memory_bytes=2**20, quantization="int8"
    )
    blocks = tuple(range(-(-(len(prompt) + max_new) // 16)))
    greedy = SamplingParams(temperature=0.0)
    tokens: list[int] = []
    plan = t.StepPlan(0, new_seqs=(t.NewSequence(0, "r", tuple(prompt), len(prompt), greedy, blocks, 0, len(prompt)),))
    for step in range(max_new):
        if step:
            plan = t.StepPlan(step, scheduled_seqs=(t.ScheduledSequence(0, 1),))
        result = runner.execute(plan)
        assert not result.errors
        tokens += [token for out in result.outputs for token in out.token_ids]
    return tokens


def test_int8_is_served_and_reported(tiny_model_dir, tmp_path):
    with fp32_launcher(tiny_model_dir, tmp_path, block_size=16, quantization="int8") as system:
        with Client(system.target, timeout=60) as client:
            assert client.model_info().quantization == "int8"
            executor = client.status().executors[0]
            assert executor.quantization == "int8" and "int8" in executor.kernels["gemm"]
            served = client.generate(token_ids=PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    assert served == _runner_greedy(tiny_model_dir, PROMPT, 16)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quantization", "int4"], "unknown --quantization 'int4'; use one of auto, none, int8"),
        (["--quantization", "int8", "--quantized-activations", "fp8"], "unknown --quantized-activations 'fp8'"),
    ],
)
def test_a_bad_mode_stops_the_executor_with_its_reason(tiny_model_dir, flags, message):
    _assert_refused(tiny_model_dir, flags, message)


def test_a_mode_the_model_cannot_take_stops_the_executor_with_its_reason(tiny_model_dir, tmp_path):
    # GGUF blocks from a checkpoint folder: there are none to keep.
    _assert_refused(tiny_model_dir, ["--quantization", "gguf"], "keeps a GGUF file's blocks; ")
    # Q4_0 blocks are 32 inputs wide; this Gemma 2 has hidden_size 72 (its q/k/v and gate/up take 72 inputs).
    gemma2 = make_tiny_checkpoint(tmp_path, "gemma2")
    write_tokenizer_files(gemma2, 128)
    _assert_refused(gemma2, ["--quantization", "q4_0"], "q4_0 needs in_features divisible by 32, got a [")


def _assert_refused(model_dir, flags: list[str], message: str) -> None:
    """The executor exits 1 at start, before serving, and says ``message``."""
    command = [sys.executable, "-m", "executor_svc.main", "--port", "0", "--model", str(model_dir), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in done.stdout + done.stderr
    assert "executor_ready" not in done.stdout + done.stderr
