"""The offload tier's promise on the default model: a 3,000-token prompt after a restart (docs/kv-offload.md).

SmolLM2-135M-Instruct, fp32, real processes. The prompt is answered once cold,
then the executor is stopped with SIGTERM (and, separately, the whole
``pagoda serve``) and started again on the same --kv-offload-dir: the same
prompt must come back with the same greedy tokens, its full blocks reported
as offloaded cached tokens, and a time to first token at least 8x lower (the
cold one computes 3,000 tokens; the warm one reads ~190 blocks and computes
the last few tokens; docs/kv-offload.md has the figures of a quiet machine).

The executor runs one intra-op thread: on a machine shared with other work, a
step of many small parallel regions (the warm one) waits for descheduled
OpenMP threads far more than a long prefill does, so with two threads the
ratio measured how busy the machine was. One thread keeps it a measure of
loading against computing.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time

import pytest
from support.system import fp32_launcher

from pagoda.launch.launcher import OffloadPlan, free_port
from pagoda_client import Client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT_TOKENS = 3000
MIN_SPEEDUP = 8.0
EXECUTOR_ARGS = ["--num-threads", "1"]


@pytest.fixture(scope="module")
def smollm2_dir():
    from executor_svc.loading.model_cache import prepare_default_model

    return prepare_default_model()


def _prompt() -> list[int]:
    rng = random.Random(17)
    return [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]


def _ask(target: str):
    with Client(target, timeout=300, max_retries=3) as client:
        return client.generate(token_ids=_prompt(), max_tokens=12, temperature=0, ignore_eos=True)


def _check_warm(cold, warm, block_size: int) -> None:
    assert warm.token_ids == cold.token_ids
    full_blocks = (PROMPT_TOKENS - 1) // block_size * block_size
    assert cold.usage.cached_tokens == 0
    assert warm.usage.cached_tokens == warm.usage.cached_tokens_offloaded == full_blocks
    speedup = cold.timings.time_to_first_token_s / warm.timings.time_to_first_token_s
    print(f"TTFT cold {cold.timings.time_to_first_token_s:.3f}s warm {warm.timings.time_to_first_token_s:.3f}s")
    assert speedup >= MIN_SPEEDUP, f"warm TTFT only {speedup:.1f}x lower than cold"


def test_a_3000_token_prompt_after_an_executor_restart(smollm2_dir, tmp_path):
    plan = OffloadPlan(str(tmp_path / "tier"))
    with fp32_launcher(
        smollm2_dir,
        tmp_path / "logs",
        "512MiB",
        startup_timeout_s=300,
        kv_offload=plan,
        extra_executor_args=EXECUTOR_ARGS,
    ) as system:
        cold = _ask(system.target)
        system.kill_executor(0, signal.SIGTERM)
        system.restart_executor(0)
        warm = _ask(system.target)
    _check_warm(cold, warm, 16)  # fp32 SmolLM2: 16 tokens a block


def _serve(model, port: int, tmp_path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "pagoda_client.cli", "serve", "--model", str(model), "--port", str(port)]
    argv += ["--dtype", "float32", "--kv-cache-memory", "512MiB", "--log-dir", str(tmp_path / "logs")]
    argv += ["--kv-offload-dir", str(tmp_path / "tier"), "--executor-args", " ".join(EXECUTOR_ARGS)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"pagoda serve exited with {proc.wait()}")
        if "Press Ctrl-C" in line:
            return
    raise AssertionError("pagoda serve not ready in time")


def test_a_3000_token_prompt_after_the_whole_pagoda_serve_restarts(smollm2_dir, tmp_path):
    port = free_port()
    answers = []
    for _ in range(2):
        proc = _serve(smollm2_dir, port, tmp_path)
        try:
            _wait_ready(proc)
            answers.append(_ask(f"127.0.0.1:{port}"))
        finally:
            proc.send_signal(signal.SIGTERM)  # schedulers drain, executors store what is queued
            assert proc.wait(timeout=120) == 0
    log = (tmp_path / "logs" / "executor-0.log").read_text()
    assert len(re.findall(r'"event": "kv_offload_scanned"', log)) == 2
    _check_warm(answers[0], answers[1], 16)
