"""Batch-invariant serving on the default model: every request's tokens and logprobs, bit for bit, as it gets alone.

SmolLM2-135M-Instruct with ``--batch-invariant``, in bf16 and in int8 weights
+ int8 KV, real processes. Eight probe requests (half greedy, half seeded at
temperature 0.8; prompts of 16..600 token ids with repeats, so n-gram drafts
find matches; 32 tokens each, with the sampled token's logprob) are answered
one at a time on a roomy server: the reference. Then the same probes, each
compared exactly (token ids and logprob floats) with the reference:

- in 64 concurrent requests (the probes among 56 others);
- behind a partial and then a full prefix-cache hit on their own prompt;
- on a KV pool so small that sequences are preempted and recomputed;
- with chunked prefill at 16 and at 512 tokens per step;
- with n-gram speculation (drafts accepted and rejected, verify rows);
- across an executor SIGKILL mid-stream: the sequences move to the other
  executor and are recomputed there from their tokens.

Without the flag these cases differ on this model: a token decoded in one run
is recomputed as a row of a prefill chunk in another (preemption, failover,
speculation), and decode splits a long row's keys over threads only when the
batch is small. docs/durability.md says what holds in which dtype.
"""

from __future__ import annotations

import concurrent.futures
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from support.streams import KillOnce, run_streams

from pagoda.launch.launcher import Launcher
from pagoda_client import Client


def _panel_gemms_here() -> bool:
    """Whether the installed kernels have the fp32 panel GEMMs (AVX-512 or AVX2 + FMA) ``--batch-invariant`` runs
    every linear layer on."""
    from executor_svc.native import loader

    kernels = loader.kernels()
    return kernels is not None and "f32_panels" in kernels.features


def _int8_kernels_here() -> bool:
    """Whether the installed kernels have the int8 GEMMs ``--batch-invariant`` needs for int8 weights."""
    from executor_svc.native import loader

    kernels = loader.kernels()
    return kernels is not None and bool({"avx512_vnni", "amx_int8", "avx2_int8"} & kernels.features)


pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        not _panel_gemms_here(),
        reason="--batch-invariant needs the C++ fp32 panel GEMMs (AVX-512 or AVX2 + FMA builds); on this one the "
        "executor refuses it with that message (tests/executor/test_batch_invariant_layers.py)",
    ),
]

MODES = {
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8"),
}
NUM_PROBES = 8
MAX_TOKENS = 32
Answer = tuple[tuple[int, ...], tuple[float, ...]]
NGRAM_ALWAYS = ["--speculative", "ngram", "--speculative-max-batch", "64", "--speculative-adaptive", "false"]


def _request(seed: int, sampled: bool) -> dict[str, Any]:
    """A prompt of 16..600 ids in which a random segment repeats (n-gram lookup finds it), asking for logprobs."""
    rng = random.Random(seed)
    segment = [rng.randrange(200, 40000) for _ in range(rng.randrange(8, 24))]
    ids: list[int] = []
    target = rng.randrange(16, 600)
    while len(ids) < target:
        ids += segment if rng.random() < 0.4 else [rng.randrange(200, 40000) for _ in range(rng.randrange(4, 40))]
    request: dict[str, Any] = dict(token_ids=ids[:target], max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    request.update(temperature=0.8, seed=seed) if sampled else request.update(temperature=0)
    return request


PROBES = [_request(100 + i, sampled=bool(i % 2)) for i in range(NUM_PROBES)]
OTHERS = [_request(500 + i, sampled=bool(i % 3 == 0)) for i in range(64 - NUM_PROBES)]


def _answer(result: Any) -> Answer:
    return tuple(result.token_ids), tuple(entry.sampled.logprob for entry in result.logprobs)


def _one(target: str, request: dict[str, Any]) -> Answer:
    with Client(target, timeout=600, max_retries=3) as client:
        return _answer(client.generate(**request))


def _together(target: str, requests: list[dict[str, Any]]) -> list[Answer]:
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda request: _one(target, request), requests))


def _differences(reference: list[Answer], answers: list[Answer]) -> list[str]:
    """For each probe that differs: where its tokens or logprobs first part from the reference."""
    out = []
    for i, (ref, got) in enumerate(zip(reference, answers)):
        if got != ref:
            tokens = next((j for j, (a, b) in enumerate(zip(ref[0], got[0])) if a != b), None)
            logprob = next((j for j, (a, b) in enumerate(zip(ref[1], got[1])) if a != b), None)
            out.append(f"probe {i}: first token differing at {tokens}, first logprob at {logprob}")
    return out


def _launch(model: Path, log_dir: Path, mode: str, **options: Any) -> Launcher:
    options.setdefault("kv_cache_memory", "256MiB")
    executor_args = ["--batch-invariant", *options.pop("extra_executor_args", [])]
    return Launcher(
        str(model),
        log_dir=log_dir,
        startup_timeout_s=300,
        extra_executor_args=executor_args,
        **MODES[mode],
        **options,
    )


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from executor_svc.loading.model_cache import prepare_default_model

    return Path(prepare_default_model())


@pytest.fixture(scope="module", params=sorted(MODES))
def served(request, smollm2_dir, tmp_path_factory):
    """(mode, the roomy server, the probes' answers alone on it)."""
    mode = request.param
    if mode == "int8" and not _int8_kernels_here():
        pytest.skip("batch-invariant int8 layers need the C++ int8 kernels (AVX512-VNNI or AMX-INT8)")
    with _launch(smollm2_dir, tmp_path_factory.mktemp(f"roomy-{mode}"), mode) as system:
        with Client(system.target, timeout=30) as client:
            info = client.model_info()
        assert info.batch_invariant
        reference = [_one(system.target, probe) for probe in PROBES]
        yield mode, system, reference


def test_64_concurrent_requests(served):
    _, system, reference = served
    answers = _together(system.target, [*PROBES, *OTHERS])
    assert _differences(reference, answers[:NUM_PROBES]) == []


def test_partial_and_full_prefix_cache_hits(served):
    _, system, reference = served
    answers, cached = [], []
    with Client(system.target, timeout=600) as client:
        for probe in PROBES:
            ids = probe["token_ids"]
            client.generate(token_ids=ids[: len(ids) * 3 // 4] + [17, 18, 19], max_tokens=2, temperature=0)
            partial = client.generate(**probe)
            full = client.generate(**probe)
            answers += [_answer(partial), _answer(full)]
            cached += [partial.usage.cached_tokens, full.usage.cached_tokens]
    assert sum(1 for tokens in cached if tokens) >= NUM_PROBES, f"too few prefix-cache hits: {cached}"
    assert _differences([ref for ref in reference for _ in range(2)], answers) == []


@pytest.mark.parametrize(
    "case, options",
    [
        ("preemption", dict(kv_cache_memory="40MiB")),
        ("chunk-16", dict(extra_scheduler_args=["--max-num-batched-tokens", "16"])),
        ("chunk-512", dict(extra_scheduler_args=["--max-num-batched-tokens", "512"])),
        # Drafts at any batch size and never paused, so that this load drafts whatever the machine's speed.
        ("ngram", dict(extra_scheduler_args=NGRAM_ALWAYS)),
    ],
)
def test_a_server_that_steps_otherwise(served, smollm2_dir, tmp_path, case, options):
    mode, _, reference = served
    with _launch(smollm2_dir, tmp_path, mode, **options) as system:
        if case == "preemption":
            answers = _under_pressure(system.target)
        else:
            answers = _together(system.target, [*PROBES, *OTHERS[:8]])
        with Client(system.target, timeout=30) as client:
            status = client.status()
    if case == "preemption":
        assert status.num_preemptions_total > 0, "the pool did not force a preemption"
    if case == "ngram":
        assert status.spec_draft_tokens_total > status.spec_accepted_tokens_total > 0, "drafts accepted and rejected"
    assert _differences(reference, answers[:NUM_PROBES]) == []


# Short prompts, long outputs: eight of them grow to 8 x 9 blocks of 32 tokens, more than the preemption case's
# 40 MiB pool holds (56 blocks in bf16, fewer in int8), so once all eight run, the pool must preempt whatever the
# machine's speed. (The probes and other requests alone left it to timing whether admission had filled the pool
# when running sequences grew: two CI runs saw no preemption in int8, one of them with a 20 MiB pool.)
PRESSURE = [dict(request, token_ids=request["token_ids"][:16], max_tokens=256) for request in OTHERS[:8]]
PRESSURE_RUNNING_WAIT_S = 120.0


def _under_pressure(target: str) -> list[Answer]:
    """The pressure requests first; once all of them run, the probes (admitted after them, so the first preempted).

    Returns the probes' answers."""
    with concurrent.futures.ThreadPoolExecutor(len(PRESSURE)) as pool:
        pressure = [pool.submit(_one, target, request) for request in PRESSURE]
        with Client(target, timeout=30) as client:
            deadline = time.monotonic() + PRESSURE_RUNNING_WAIT_S
            while (running := client.status().num_running) < len(PRESSURE):
                assert time.monotonic() < deadline, f"waited {PRESSURE_RUNNING_WAIT_S} s for the pressure: {running}"
                assert not any(f.done() for f in pressure), "a pressure request ended before all of them ran"
                time.sleep(0.01)
        answers = _together(target, PROBES)
        assert [len(f.result(timeout=600)[0]) for f in pressure] == [256] * len(PRESSURE)
    return answers


def test_an_executor_sigkill_mid_stream(served, smollm2_dir, tmp_path):
    """Two executors; the one holding half the streams is killed after a third of the tokens: its sequences are
    recomputed on the other from their tokens, and their streams go on."""
    mode, _, reference = served
    with _launch(smollm2_dir, tmp_path, mode, num_executors=2) as system:
        kill = KillOnce(
            NUM_PROBES * MAX_TOKENS // 3,
            lambda: system.kill_executor(0, signal.SIGKILL),
            min_streams_started=NUM_PROBES,
        )
        with Client(system.target, timeout=600, max_retries=3) as client:
            records = run_streams(client, PROBES, kill)
    assert kill.fired_at is not None
    answers = [(tuple(r.token_ids), tuple(r.logprobs)) for r in records]
    assert _differences(reference, answers) == []
