"""The default model's Q4_1 GGUF served from its blocks (``--quantization gguf``): it answers, in less memory.

Two executors on the same file, one serving the blocks as stored and one the
file dequantized at load (``--quantization none``, the same dtype); each
process's RSS is read from /proc once it has answered, and what its load added
from its log (the ready line's ``rss_bytes`` less the ``model_loading`` line's, taken
before the model: torch, gRPC and the kernels' ~250 MiB are the same in both).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor_svc.loading.memory import rss_bytes
from executor_svc.native import loader
from pagoda.launch.launcher import Launcher
from pagoda_client import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# A question whose greedy answer does not hang on a near tie: for "What is the capital of France?" the dense
# model's first token is "The" at p = 0.152 against "L" at 0.140, so any change of arithmetic (int8 activations
# on one CPU kind, a different attention kernel on another) could turn the answer into "L'Étoile, ...". Here
# each token up to "Paris" leads the next by 4.2x or more (transformers, fp32).
QUESTION = [{"role": "user", "content": "Name the capital of France."}]


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
    from executor_svc.loading.model_cache import default_gguf_path

    return str(default_gguf_path())


def _answer_and_rss(launcher: Launcher) -> tuple[str, int, int, str]:
    """(answer, executor RSS, the RSS its model load added, effective quantization)."""
    with launcher as system, Client(system.target, timeout=120) as client:
        answer = client.generate(messages=QUESTION, max_tokens=24, temperature=0).text
        quantization = client.model_info().quantization
        rss = rss_bytes(system.executors[0].pid)
    assert launcher.log_dir is not None
    return answer, rss, _load_rss(launcher.log_dir / "executor-0.log"), quantization


def _load_rss(log: Path) -> int:
    """The ready line's rss_bytes less the model_loading line's (torch imported, no weight read yet)."""
    events = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            events.setdefault(entry.get("event"), entry)
    return events["executor_ready"]["rss_bytes"] - events["model_loading"]["rss_bytes"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_1_smollm2_served_as_stored_answers_in_less_memory(tmp_path, dtype):
    answer, rss, load, quantization = _answer_and_rss(_serve(tmp_path, "gguf", dtype))
    assert quantization == "gguf:q8_0+q4_1"
    assert "Paris" in answer
    dense_answer, dense_rss, dense_load, dense_quantization = _answer_and_rss(_serve(tmp_path, "none", dtype))
    assert dense_quantization == "none" and "Paris" in dense_answer
    print(
        f"{dtype}: executor RSS {rss / 2**20:.0f} MiB as stored vs {dense_rss / 2**20:.0f} MiB dequantized "
        f"({dense_rss / rss:.2f}x); the load added {load / 2**20:.0f} vs {dense_load / 2**20:.0f} MiB "
        f"({dense_load / load:.2f}x)"
    )
    # make run's load (float32) takes 2.5x what the blocks as stored take, the 64 MiB KV cache included; the
    # whole process 2x (docs/quantization.md has the figures). bf16 weights are 2.7x the blocks, not 5.4x; in
    # bf16 the process's ~530 MiB without weights (torch, kernels, KV cache) puts the whole-process ratio at
    # 1.29-1.31, too close to any bound, so the saving is asserted in MiB: the dense weights' ~270 MiB against
    # the blocks' ~90 MiB (measured: 182 MiB apart).
    kernels = loader.kernels()
    if kernels is None or not {"avx512_vnni", "avx2_int8"} & kernels.features:
        # No C++ block kernels (no AVX2 + FMA, or no kernel build): torch multiplies by each layer's blocks
        # dequantized for that call, and the scratch of the largest (the tied LM head, 49,152 x 576: 108 MiB in
        # fp32) stays with the allocator. Measured on a Zen 3 before its AVX2 block kernel: fp32 load 2.40-2.61x,
        # process 1.59x; bf16 load 1.53-1.61x, 77-108 MiB.
        if dtype == "float32":
            assert dense_load > 2.2 * load and dense_rss > 1.4 * rss
        else:
            assert dense_load > 1.4 * load and dense_rss - rss > 50 * 2**20
    elif dtype == "float32":
        assert dense_load > 2.5 * load and dense_rss > 1.8 * rss
    else:
        assert dense_load > 1.5 * load and dense_rss - rss > 120 * 2**20
