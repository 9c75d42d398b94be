"""Transparent failover, real processes: the scheduler a stream runs on is killed (kill -9 of its pid).

Two independent systems (a scheduler and an executor each, the same tiny
model and settings) stand in for two schedulers; the client is given both
addresses. Mid-stream, the test SIGKILLs one scheduler from outside; every
stream that ran there must resume on the other and read, for the
application, exactly as the fault-free run: token ids, text, logprobs,
nothing repeated. The same through ``pagoda generate --target a,b``.
The time from the kill to the next token of each resumed stream is printed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagoda.launch.launcher import Launcher
from pagoda_client import Client

pytestmark = pytest.mark.integration

NUM_STREAMS = 16
MAX_TOKENS = 120


@dataclasses.dataclass
class Run:
    """What the application saw of one stream."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    num_resumes: int = 0
    # time.monotonic() of the first token from a resumed attempt.
    resumed_token_at: float | None = None


@pytest.fixture
def two_systems(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Launcher, Launcher]]:
    """Two schedulers, each with its own executor, on the same model and settings."""
    settings = {"num_executors": 1, "dtype": "float32", "kv_cache_memory": "2MiB", "startup_timeout_s": 180}
    with (
        Launcher(str(tiny_model_dir), log_dir=tmp_path / "a", **settings) as first,
        Launcher(str(tiny_model_dir), log_dir=tmp_path / "b", **settings) as second,
    ):
        yield first, second


def _request(i: int) -> dict:
    rng = random.Random(700 + i)
    kwargs: dict = {
        "token_ids": [rng.randrange(3, 384) for _ in range(rng.randrange(4, 40))],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if i % 2:  # seeded sampling continues identically on the other scheduler
        kwargs.update(temperature=0.8, seed=1000 + i)
    if i == 6:
        kwargs.update(logprobs=2)
    return kwargs


def _requests(client: Client) -> list[dict]:
    """The streams; one stops at a string from two thirds into its fault-free text (so it spans tokens)."""
    requests = [_request(i) for i in range(NUM_STREAMS)]
    text = client.generate(**requests[5]).text
    start = 2 * len(text) // 3
    requests[5]["stop"] = [text[start : start + 3]]
    assert text.find(text[start : start + 3]) == start, "pick another prompt: the stop string occurs earlier"
    return requests


def _run_all(client: Client, requests: list[dict], on_tokens: Callable[[int], None] | None = None) -> list[Run]:
    received = [0]
    lock = threading.Lock()

    def one(request: dict) -> Run:
        run = Run([], "", [])
        with client.stream(**request) as stream:
            for delta in stream:
                if stream.num_resumes and run.resumed_token_at is None and delta.token_ids:
                    run.resumed_token_at = time.monotonic()
                run.token_ids.extend(delta.token_ids)
                run.text += delta.text
                run.logprobs.extend(entry.sampled.logprob for entry in delta.logprobs)
                with lock:
                    received[0] += len(delta.token_ids)
                    total = received[0]
                if on_tokens is not None:
                    on_tokens(total)
            run.num_resumes = stream.num_resumes
        return run

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def _kill_scheduler(system: Launcher) -> float:
    """SIGKILL the scheduler process from outside, as the kernel's OOM killer would; returns when."""
    killed_at = time.monotonic()
    os.kill(system.scheduler_pid, signal.SIGKILL)
    return killed_at


def test_killing_the_scheduler_mid_stream_loses_and_repeats_nothing(two_systems):
    first, second = two_systems
    with Client(f"{first.target},{second.target}", timeout=180) as client:
        requests = _requests(client)
        expected = _run_all(client, requests)
        total = sum(len(run.token_ids) for run in expected)
        killed_at: list[float] = []

        def kill_once(received: int) -> None:
            if received >= total // 4 and not killed_at:
                killed_at.append(_kill_scheduler(first))

        got = _run_all(client, requests, kill_once)
    assert killed_at, "the scheduler was never killed"
    for i, (run, reference) in enumerate(zip(got, expected)):
        assert (run.token_ids, run.text) == (reference.token_ids, reference.text), f"stream {i}"
        assert run.logprobs == pytest.approx(reference.logprobs, abs=1e-4), f"stream {i}"
    resumed = [run for run in got if run.num_resumes]
    assert len(resumed) >= NUM_STREAMS // 4, "too few streams ran on the killed scheduler mid-stream"
    assert all(run.num_resumes == 1 for run in resumed)
    gaps_s = sorted(run.resumed_token_at - killed_at[0] for run in resumed if run.resumed_token_at is not None)
    print(
        f"\nscheduler kill -> next token on the client, {len(gaps_s)} resumed streams: "
        f"p50 {statistics.median(gaps_s) * 1e3:.0f} ms, max {gaps_s[-1] * 1e3:.0f} ms"
    )
    assert "request_resumed" in second.logs()["scheduler"]


def _pagoda() -> list[str]:
    script = Path(sys.executable).parent / "pagoda"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pagoda_client.cli"]


def _read_all(pipe, chunks: list[bytes], started: threading.Event) -> None:
    while chunk := os.read(pipe.fileno(), 4096):
        chunks.append(chunk)
        started.set()


def test_the_cli_streams_on_through_a_scheduler_kill(two_systems):
    first, second = two_systems
    request = {"token_ids": [9, 8, 7, 300, 42], "max_tokens": 600, "ignore_eos": True, "temperature": 0.8, "seed": 5}
    with Client(first.target, timeout=120) as client:
        expected = client.generate(**request).text
    argv = [*_pagoda(), "generate", "--target", f"{first.target},{second.target}", "--timeout", "120"]
    argv += [
        "--token-ids",
        "9,8,7,300,42",
        "--max-tokens",
        "600",
        "--ignore-eos",
        "--temperature",
        "0.8",
        "--seed",
        "5",
    ]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as cli:
        chunks: list[bytes] = []
        started = threading.Event()
        reader = threading.Thread(target=_read_all, args=(cli.stdout, chunks, started), daemon=True)
        reader.start()
        assert started.wait(60), "the CLI printed nothing within 60 s"
        _kill_scheduler(first)  # the CLI's first call goes to the first address
        try:
            cli.wait(timeout=120)
        finally:
            cli.kill()
        reader.join(10)
        stderr = cli.stderr.read().decode(errors="replace")
    assert cli.returncode == 0, stderr
    assert b"".join(chunks).decode() == expected + "\n"
    assert "request_resumed" in second.logs()["scheduler"], "the kill did not land mid-stream"
