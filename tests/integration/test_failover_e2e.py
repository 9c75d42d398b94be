"""Transparent failover under ``pagoda serve --schedulers 2 --executors 2``, real processes killed from outside.

The system is the supervising launcher that ``pagoda serve`` runs: two
schedulers sharing two executors through leases, every child restarted when it
exits. The client is given both schedulers' addresses and runs on the first.
Mid-stream, the test SIGKILLs that scheduler (``kill -9`` of its pid, as the
kernel's OOM killer would); every stream that ran there must resume on the other
and read, for the application, exactly as the fault-free run: token ids, text,
logprobs, nothing repeated. Then the killed scheduler must be back, hold an
executor again and take requests. The same through ``pagoda generate --target a,b``.
The same with ``AsyncClient(multiplex=True)``, whose streams share one call per scheduler. The time from the kill
to the next token of each resumed stream is printed (``-s``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.streams import (
    KillOnce,
    StreamRecord,
    gaps_after,
    mixed_requests,
    p50_and_max,
    run_streams,
    run_streams_async,
)

from pagoda.launch.launcher import Launcher
from pagoda_client import AsyncClient, Client, PagodaError

pytestmark = pytest.mark.integration

NUM_STREAMS = 16
MAX_TOKENS = 120
# The ownership rule hands an executor back about 2 s after its scheduler returns.
HANDBACK_BOUND_S = 60.0


@pytest.fixture(scope="module")
def system(tiny_model_dir: Path, tmp_path_factory):
    with Launcher(
        str(tiny_model_dir),
        num_schedulers=2,
        num_executors=2,
        dtype="float32",
        kv_cache_memory="2MiB",
        log_dir=tmp_path_factory.mktemp("serve"),
        startup_timeout_s=180,
        restart=True,
    ) as launched:
        yield launched


def _held(target: str) -> set[str]:
    """Addresses of the executors the scheduler at ``target`` drives (READY in its status)."""
    try:
        with Client(target, timeout=5, max_retries=0) as client:
            return {e.address for e in client.status().executors if e.state == "READY"}
    except PagodaError:
        return set()


def _wait_each_holds_one(system: Launcher) -> float:
    """Bounded wait until each scheduler drives one executor; the seconds it took."""
    start = time.monotonic()
    while True:
        system.check()
        held = [_held(target) for target in system.targets]
        if all(len(h) == 1 for h in held) and held[0] != held[1]:
            return time.monotonic() - start
        assert time.monotonic() - start < HANDBACK_BOUND_S, f"executors not split between the schedulers: {held}"
        time.sleep(0.1)


def _requests(client: Client) -> list[dict[str, Any]]:
    """Greedy and seeded streams; one with logprobs, one stopping at a string two thirds into its text."""
    requests = mixed_requests(NUM_STREAMS, MAX_TOKENS, seed=700)
    requests[6]["logprobs"] = 2
    text = client.generate(**requests[5]).text
    start = 2 * len(text) // 3
    requests[5]["stop"] = [text[start : start + 3]]
    assert text.find(text[start : start + 3]) == start, "pick another prompt: the stop string occurs earlier"
    return requests


def _kill_first_scheduler(system: Launcher) -> int:
    """SIGKILL the first scheduler from outside; its pid."""
    pid = system.schedulers[0].pid
    os.kill(pid, signal.SIGKILL)
    return pid


def _check_resumed(got: list[StreamRecord], expected: list[StreamRecord]) -> list[StreamRecord]:
    """Every stream read as in the fault-free run, and enough of them resumed once; those resumed."""
    for i, (run, reference) in enumerate(zip(got, expected)):
        assert (run.token_ids, run.text) == (reference.token_ids, reference.text), f"stream {i}"
        assert run.logprobs == pytest.approx(reference.logprobs, abs=1e-4), f"stream {i}"
    resumed = [run for run in got if run.num_resumes]
    assert len(resumed) >= NUM_STREAMS // 4, "too few streams ran on the killed scheduler mid-stream"
    assert all(run.num_resumes == 1 for run in resumed)
    return resumed


def test_killing_the_scheduler_mid_stream_loses_and_repeats_nothing(system):
    _wait_each_holds_one(system)
    with Client(",".join(system.targets), timeout=180) as client:
        requests = _requests(client)
        expected = run_streams(client, requests)
        killed: list[int] = []
        total = sum(len(record.token_ids) for record in expected)
        # Every stream has a token first: the two schedulers' batches can start a second apart.
        kill = KillOnce(
            total // 4, lambda: killed.append(_kill_first_scheduler(system)), min_streams_started=NUM_STREAMS
        )
        got = run_streams(client, requests, kill)
    assert kill.fired_at is not None and killed, "the scheduler was never killed"
    resumed = _check_resumed(got, expected)
    assert '"request_resumed"' in system.logs()["scheduler-1"]

    # The supervisor restarts the killed scheduler; the ownership rule gives it an executor back.
    system.wait_restarted(system.schedulers[0], killed[0], timeout_s=120, serving=True)
    _wait_each_holds_one(system)
    back_s = time.monotonic() - kill.fired_at
    with Client(system.targets[0], timeout=60, max_retries=0) as back:
        fresh = mixed_requests(4, 16, seed=9000)
        assert [len(back.generate(**request).token_ids) for request in fresh] == [16] * 4
        assert back.status().num_requests_total >= len(fresh)

    gap_p50, gap_max = p50_and_max(gaps_after(resumed, kill.fired_at))
    print(
        f"\nscheduler SIGKILL under pagoda serve --schedulers 2 --executors 2, {len(resumed)} of {NUM_STREAMS} "
        f"streams resumed: kill -> next token p50 {gap_p50 * 1e3:.0f} ms, max {gap_max * 1e3:.0f} ms; "
        f"kill -> the restarted scheduler serves, holding an executor again, {back_s:.1f} s"
    )


def test_multiplexed_streams_resume_through_a_scheduler_kill(system):
    """``AsyncClient(multiplex=True)``: the killed scheduler's call breaks, and each of its streams resumes alone."""
    _wait_each_holds_one(system)
    with Client(",".join(system.targets), timeout=180) as client:
        requests = _requests(client)
        expected = run_streams(client, requests)
    total = sum(len(record.token_ids) for record in expected)
    killed: list[int] = []
    kill = KillOnce(total // 4, lambda: killed.append(_kill_first_scheduler(system)), min_streams_started=NUM_STREAMS)

    async def run() -> list[StreamRecord]:
        async with AsyncClient(",".join(system.targets), timeout=180, multiplex=True) as aclient:
            return await run_streams_async(aclient, requests, kill)

    got = asyncio.run(run())
    assert kill.fired_at is not None and killed, "the scheduler was never killed"
    resumed = _check_resumed(got, expected)
    system.wait_restarted(system.schedulers[0], killed[0], timeout_s=120, serving=True)
    gap_p50, gap_max = p50_and_max(gaps_after(resumed, kill.fired_at))
    print(
        f"\nmultiplexed: {len(resumed)} of {NUM_STREAMS} streams resumed after the scheduler SIGKILL: "
        f"kill -> next token p50 {gap_p50 * 1e3:.0f} ms, max {gap_max * 1e3:.0f} ms"
    )


def _pagoda() -> list[str]:
    script = Path(sys.executable).parent / "pagoda"
    return [str(script)] if script.exists() else [sys.executable, "-m", "pagoda_client.cli"]


def _read_all(pipe, chunks: list[bytes], started: threading.Event) -> None:
    while chunk := os.read(pipe.fileno(), 4096):
        chunks.append(chunk)
        started.set()


def test_the_cli_streams_on_through_a_scheduler_kill(system):
    _wait_each_holds_one(system)
    request = {"token_ids": [9, 8, 7, 300, 42], "max_tokens": 600, "ignore_eos": True, "temperature": 0.8, "seed": 5}
    with Client(system.targets[0], timeout=120) as client:
        expected = client.generate(**request).text
    resumed_before = system.logs()["scheduler-1"].count('"request_resumed"')
    argv = [*_pagoda(), "generate", "--target", ",".join(system.targets), "--timeout", "120"]
    argv += ["--token-ids", "9,8,7,300,42", "--max-tokens", "600", "--ignore-eos", "--temperature", "0.8"]
    argv += ["--seed", "5"]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as cli:
        chunks: list[bytes] = []
        started = threading.Event()
        reader = threading.Thread(target=_read_all, args=(cli.stdout, chunks, started), daemon=True)
        reader.start()
        assert started.wait(60), "the CLI printed nothing within 60 s"
        killed = _kill_first_scheduler(system)  # the CLI's first call goes to the first address
        try:
            cli.wait(timeout=120)
        finally:
            cli.kill()
        reader.join(10)
        stderr = cli.stderr.read().decode(errors="replace")
    assert cli.returncode == 0, stderr
    assert b"".join(chunks).decode() == expected + "\n"
    assert system.logs()["scheduler-1"].count('"request_resumed"') > resumed_before, "the kill missed the stream"
    system.wait_restarted(system.schedulers[0], killed, timeout_s=120, serving=True)
