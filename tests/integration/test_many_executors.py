"""Several executors: no request is lost when one dies, drains, or all vanish for a while."""

from __future__ import annotations

import concurrent.futures
import random
import signal
import threading
import time
from collections.abc import Callable

import pytest
from support.system import fp32_launcher

from pagoda_client import Client

pytestmark = pytest.mark.integration

NUM_REQUESTS = 32
MAX_TOKENS = 160


def _request(i: int) -> dict:
    rng = random.Random(1000 + i)
    kwargs = dict(
        token_ids=[rng.randrange(3, 384) for _ in range(rng.randrange(4, 60))],
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        temperature=0,
    )
    if i % 4 == 3:  # seeded sampling must continue identically on the other executor
        kwargs.update(temperature=0.9, top_p=0.95, seed=i)
    return kwargs


def _run_all(client: Client, on_progress=None) -> list[list[int]]:
    received = [0]
    lock = threading.Lock()

    def one(i: int) -> list[int]:
        tokens = []
        for delta in client.stream(**_request(i)):
            tokens.extend(delta.token_ids)
            with lock:
                received[0] += len(delta.token_ids)
                total = received[0]
            if on_progress is not None:
                on_progress(total)
        return tokens

    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, range(NUM_REQUESTS)))


def _once_a_quarter_in(action: Callable[[], object]) -> tuple[threading.Event, Callable[[int], None]]:
    """An ``on_progress`` for ``_run_all`` that runs ``action`` once a quarter of all tokens arrived, and its event."""
    done = threading.Event()

    def on_progress(total: int) -> None:
        if total >= NUM_REQUESTS * MAX_TOKENS // 4 and not done.is_set():
            done.set()
            action()

    return done, on_progress


def _executor_states(client: Client) -> list[str]:
    return [e.state for e in client.status().executors]


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two_executors(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    args = ["--drain-timeout-s", "20"]
    with fp32_launcher(
        tiny_model_dir, logs, "2MiB", num_executors=2, extra_executor_args=args, startup_timeout_s=300
    ) as system:
        yield system


def test_sigkill_mid_generation_loses_nothing(two_executors):
    with Client(two_executors.target, timeout=180, max_retries=0) as client:
        expected = _run_all(client)
        killed, kill_once = _once_a_quarter_in(lambda: two_executors.kill_executor(0, signal.SIGKILL))
        got = _run_all(client, kill_once)
        assert killed.is_set()
        assert got == expected
        status = client.status()
        live = [e for e in status.executors if e.state == "READY"]
        assert live and all(e.num_free_kv_blocks == e.num_kv_blocks for e in live)

        # Restart: the executor rejoins with a new incarnation and takes work.
        before = {e.address: e.incarnation_id for e in status.executors}
        two_executors.restart_executor(0)
        _wait(lambda: _executor_states(client).count("READY") == 2, 30, "the restarted executor to rejoin")
        after = {e.address: e.incarnation_id for e in client.status().executors}
        restarted = two_executors.executor_addresses[0]
        assert after[restarted] != before.get(restarted)
        two_executors.kill_executor(1, signal.SIGKILL)
        assert client.generate(**_request(0)).token_ids == expected[0]
        two_executors.restart_executor(1)
        _wait(lambda: _executor_states(client).count("READY") == 2, 30, "both executors READY")


def test_sigterm_drain_under_load_no_client_error(two_executors):
    with Client(two_executors.target, timeout=180, max_retries=0) as client:
        expected = _run_all(client)
        _, drain_once = _once_a_quarter_in(lambda: two_executors.executors[1].process.send_signal(signal.SIGTERM))
        assert _run_all(client, drain_once) == expected
        assert two_executors.executors[1].process.wait(timeout=60) == 0
        two_executors.restart_executor(1)
        _wait(lambda: _executor_states(client).count("READY") == 2, 30, "both executors READY")


def test_all_executors_gone_then_one_returns(two_executors):
    with Client(two_executors.target, timeout=180, max_retries=0) as client:
        expected = [client.generate(**_request(i)).token_ids for i in range(4)]
        two_executors.kill_executor(0)
        two_executors.kill_executor(1)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(lambda i=i: client.generate(**_request(i)).token_ids) for i in range(4)]
            time.sleep(3)
            assert not any(f.done() for f in futures), "requests must wait for an executor, not fail"
            two_executors.restart_executor(1)
            assert [f.result(timeout=120) for f in futures] == expected
        two_executors.restart_executor(0)
        _wait(lambda: _executor_states(client).count("READY") == 2, 30, "both executors READY")
