"""Under supervision, SIGKILL of an executor mid-stream loses nothing, and the executor comes back.

The kill comes from outside (``os.kill`` of the pid, as the kernel's OOM killer
or an operator would send it); the launcher only notices the exit and restarts
the process. The figures (kill to next token, kill to READY) are printed; run
with ``-s`` to see them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest
from support.streams import KillOnce, gaps_after, mixed_requests, p50_and_max, run_streams

from pagoda.launch.launcher import Launcher
from pagoda_client import Client

pytestmark = pytest.mark.integration

NUM_STREAMS = 16
MAX_TOKENS = 192


@pytest.fixture(scope="module")
def supervised(tiny_model_dir, tmp_path_factory):
    with Launcher(
        str(tiny_model_dir),
        num_executors=2,
        dtype="float32",
        kv_cache_memory="2MiB",
        log_dir=tmp_path_factory.mktemp("logs"),
        startup_timeout_s=180,
        restart=True,
    ) as system:
        yield system


def _wait_ready_again(client: Client, address: str, old_incarnation: str, timeout_s: float = 120) -> float:
    """Poll status until ``address`` is READY under a new incarnation; the time it was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        executor = next((e for e in client.status().executors if e.address == address), None)
        if executor is not None and executor.state == "READY" and executor.incarnation_id != old_incarnation:
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{address} not READY under a new incarnation within {timeout_s}s")


def _most_running_during(target: str, address: str, work):
    """Run ``work()`` while polling status; its result and the most sequences seen running on ``address``."""
    done = threading.Event()
    most = [0]

    def poll() -> None:
        with Client(target, timeout=10) as poller:
            while not done.is_set():
                running = [e.num_running for e in poller.status().executors if e.address == address]
                most[0] = max([most[0], *running])
                time.sleep(0.05)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        return work(), most[0]
    finally:
        done.set()
        thread.join(timeout=10)


def _num_moved(scheduler_log: str) -> int:
    """Sequences the scheduler handed back when it lost the executor (its ``executor_lost`` line).

    Reconnect attempts that time out while the executor restarts log the line too, with none.
    """
    lost = [json.loads(line) for line in scheduler_log.splitlines() if '"executor_lost"' in line]
    return max((line["num_sequences"] for line in lost), default=0)


def test_sigkill_of_an_executor_under_supervision(supervised, caplog):
    caplog.set_level(logging.INFO, logger="pagoda.launch")
    requests = mixed_requests(NUM_STREAMS, MAX_TOKENS)
    executor = supervised.executors[0]
    with Client(supervised.target, timeout=180, max_retries=0) as client:
        incarnations = {e.address: e.incarnation_id for e in client.status().executors}
        expected = run_streams(client, requests)
        old_pid = executor.pid
        kill = KillOnce(NUM_STREAMS * MAX_TOKENS // 4, lambda: os.kill(old_pid, signal.SIGKILL))
        got = run_streams(client, requests, kill)
        assert kill.fired_at is not None
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert [r.text for r in got] == [r.text for r in expected]

        # Polled from the end of the streams, seconds before the restarted executor can be back.
        ready_at = _wait_ready_again(client, executor.address, incarnations[executor.address])
        supervised.wait_restarted(executor, old_pid, timeout_s=120)
        assert executor.num_restarts == 1
        exits = [r.fields for r in caplog.records if getattr(r, "event", None) == "child_exited"]
        assert exits == [{"child": "executor-0", "pid": old_pid, "signal": "SIGKILL", "restart": 1, "delay_s": "1"}]

        # New prompts: the old ones are cached on the other executor, and the router prefers a cached prefix.
        fresh = mixed_requests(NUM_STREAMS, MAX_TOKENS, seed=5000)
        again, most_running = _most_running_during(
            supervised.target, executor.address, lambda: run_streams(client, fresh)
        )
        assert [len(r.token_ids) for r in again] == [MAX_TOKENS] * NUM_STREAMS
        assert most_running > 0, "the restarted executor took no new request"

    gaps = gaps_after(got, kill.fired_at)
    num_moved = _num_moved(supervised.logs()["scheduler"])
    assert 0 < num_moved <= len(gaps) <= NUM_STREAMS  # every moved stream went on after the kill
    all_p50, all_max = p50_and_max(gaps)
    moved_p50, moved_max = p50_and_max(gaps[-num_moved:])  # the moved streams waited longest: a re-prefill
    print(
        f"\nexecutor SIGKILL, {NUM_STREAMS} streams ({num_moved} moved): kill -> next token "
        f"p50 {all_p50 * 1000:.0f} ms max {all_max * 1000:.0f} ms (moved: p50 {moved_p50 * 1000:.0f} ms "
        f"max {moved_max * 1000:.0f} ms); kill -> restarted executor READY {ready_at - kill.fired_at:.2f} s"
    )
