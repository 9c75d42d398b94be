"""The default model's Q4_1 GGUF served from its blocks (``--quantization gguf``): it answers, in less memory.

Two executors on the same file, one serving the blocks as stored and one the
file dequantized at load (``--quantization none``, the same dtype); each
process's RSS is read from /proc once it is ready.
"""

from __future__ import annotations

import pytest

from executor_svc.memory import rss_bytes
from pagoda.launch.launcher import Launcher
from pagoda_client import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _serve(tmp_path, quantization: str, dtype: str) -> Launcher:
    return Launcher(
        "default" if quantization == "gguf" else _gguf_file(),
        dtype=dtype,
        kv_cache_memory="64MiB",
        quantization=quantization,
        log_dir=tmp_path / f"{quantization}-{dtype}",
        startup_timeout_s=300,
    )


def _gguf_file() -> str:
    from executor_svc.model_cache import default_gguf_path

    return str(default_gguf_path())


def _answer_and_rss(launcher: Launcher) -> tuple[str, int, str]:
    with launcher as system, Client(system.target, timeout=120) as client:
        answer = client.generate(messages=QUESTION, max_tokens=24, temperature=0).text
        quantization = client.model_info().quantization
        return answer, rss_bytes(system.executors[0].pid), quantization


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_1_smollm2_served_as_stored_answers_in_less_memory(tmp_path, dtype):
    answer, rss, quantization = _answer_and_rss(_serve(tmp_path, "gguf", dtype))
    assert quantization == "gguf:q8_0+q4_1"
    assert "Paris" in answer
    dense_answer, dense_rss, dense_quantization = _answer_and_rss(_serve(tmp_path, "none", dtype))
    assert dense_quantization == "none" and "Paris" in dense_answer
    print(f"{dtype}: executor RSS {rss / 2**20:.0f} MiB as stored vs {dense_rss / 2**20:.0f} MiB dequantized")
    # The weights are 5.4x (fp32) / 2.7x (bf16) smaller; the ~400 MiB of runtime (torch, gRPC, the tokenizer's
    # matcher, the KV cache) is the same in both (docs/quantization.md has the figures).
    assert dense_rss > rss * (1.8 if dtype == "float32" else 1.3)
