"""Cancellation, deadlines, metrics, health and SIGTERM drain, with real processes."""

from __future__ import annotations

import concurrent.futures
import random
import signal
import subprocess
import threading

import grpc
import pytest
from protocol.conftest import scrape, wait_until
from support.pool import pool_is_whole
from support.system import fp32_launcher

from pagoda.launch.health import ServingStatus, check_health
from pagoda.launch.launcher import Launcher, free_port, service_command
from pagoda_client import Client, PagodaError

pytestmark = pytest.mark.integration


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 384) for _ in range(rng.randrange(4, 40))]


@pytest.fixture(scope="module")
def system(tiny_model_dir, tmp_path_factory):
    executor_metrics, scheduler_metrics = free_port(), free_port()
    with fp32_launcher(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        "1MiB",
        metrics_port=scheduler_metrics,
        extra_executor_args=["--metrics-port", str(executor_metrics)],
        startup_timeout_s=300,
    ) as launched:
        launched.executor_metrics_port = executor_metrics
        launched.metrics_port = scheduler_metrics
        yield launched


def _executor_sequences(system) -> float:
    return scrape(system.executor_metrics_port)["pagoda_executor_num_sequences"]


def test_cancelling_half_the_streams_frees_them_and_keeps_the_rest_unchanged(system):
    keep = list(range(8))
    with Client(system.target, timeout=120) as client:
        expected = {
            i: client.generate(token_ids=_prompt(i), max_tokens=300, temperature=0, ignore_eos=True).token_ids
            for i in keep
        }
        cancelled = threading.Event()
        num_cancelled = [0]
        lock = threading.Lock()

        def run(i: int):
            stream = client.stream(token_ids=_prompt(i), max_tokens=300, temperature=0, ignore_eos=True)
            tokens = []
            for delta in stream:
                tokens.extend(delta.token_ids)
                if i >= 8 and len(tokens) >= 5:
                    stream.close()
                    with lock:
                        num_cancelled[0] += 1
                        if num_cancelled[0] == 8:
                            cancelled.set()
                    return None
            return tokens

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = {i: pool.submit(run, i) for i in range(16)}
            assert cancelled.wait(60)
            wait_until(lambda: client.status().num_running <= 8, 10, message="cancelled requests to leave")
            wait_until(lambda: _executor_sequences(system) <= 8, 10, message="executor to drop cancelled state")
            results = {i: f.result() for i, f in futures.items()}
        for i in keep:
            assert results[i] == expected[i]
        wait_until(lambda: pool_is_whole(client.status()), 30, message="KV pool whole")
        wait_until(lambda: _executor_sequences(system) == 0, 30, message="executor to hold nothing")


def test_client_deadline_aborts_and_frees(system):
    with Client(system.target) as client:
        with pytest.raises(PagodaError) as info:
            client.generate(token_ids=_prompt(1), max_tokens=900, temperature=0, ignore_eos=True, timeout=0.3)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: pool_is_whole(client.status()), 30, message="KV pool whole after deadline")


def test_metrics_count_what_was_sent(system):
    before = scrape(system.metrics_port)
    prompts = [_prompt(100 + i) for i in range(5)]
    with Client(system.target, timeout=60) as client:
        for p in prompts:
            client.generate(token_ids=p, max_tokens=7, temperature=0, ignore_eos=True)
    after = scrape(system.metrics_port)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('pagoda:request_success_total{finished_reason="length"}') == 5
    assert delta("pagoda:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("pagoda:generation_tokens_total") == 35
    assert delta("pagoda:time_to_first_token_seconds_count") == 5
    assert delta("pagoda:e2e_request_latency_seconds_count") == 5
    assert delta("pagoda:inter_token_latency_seconds_count") == 5 * 6
    assert after["pagoda:num_requests_running"] == 0
    assert "pagoda:kv_cache_usage_perc" in after
    executor = scrape(system.executor_metrics_port)
    assert executor["pagoda_executor_steps_total"] > 0
    assert executor["pagoda_executor_kv_blocks"] > 0


def test_health_follows_model_loading_and_executor_loss(tiny_model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "executor.log", "wb")
    executor = subprocess.Popen(
        [
            *service_command("pagoda-executor", "executor_svc.main"),
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--kv-cache-memory",
            "3GiB",
            "--dtype",
            "float32",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        statuses = []
        wait_until(
            lambda: statuses.append(check_health(address, timeout=1.0)) or statuses[-1] == ServingStatus.SERVING,
            120,
            0.01,
            "executor SERVING",
        )
        answered = [s for s in statuses if s in (ServingStatus.SERVING, ServingStatus.NOT_SERVING)]
        assert answered[0] == ServingStatus.NOT_SERVING, "executor said SERVING before its model was loaded"
        sched_port = free_port()
        scheduler = subprocess.Popen(
            [
                *service_command("pagoda-scheduler", "scheduler_svc.main"),
                "--port",
                str(sched_port),
                "--executors",
                address,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        sched_address = f"127.0.0.1:{sched_port}"
        try:
            wait_until(
                lambda: check_health(sched_address, timeout=1.0) == ServingStatus.SERVING, 30, 0.05, "scheduler SERVING"
            )
            executor.send_signal(signal.SIGKILL)
            executor.wait()
            wait_until(
                lambda: check_health(sched_address, timeout=1.0) == ServingStatus.NOT_SERVING,
                20,
                0.05,
                "scheduler NOT_SERVING without executors",
            )
            assert check_health(sched_address, service="liveness", timeout=1.0) == ServingStatus.SERVING
        finally:
            scheduler.terminate()
            assert scheduler.wait(timeout=30) == 0
    finally:
        if executor.poll() is None:
            executor.kill()
        log.close()


def test_sigterm_drains_in_flight_requests(tiny_model_dir, tmp_path):
    with Launcher(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB", log_dir=tmp_path) as system:
        with Client(system.target, timeout=120, max_retries=0) as client:
            streams = [
                client.stream(token_ids=_prompt(i), max_tokens=120, temperature=0, ignore_eos=True) for i in range(4)
            ]
            firsts = [next(iter(s)) for s in streams]
            system.scheduler.process.send_signal(signal.SIGTERM)
            wait_until(
                lambda: check_health(system.target, timeout=1.0) != ServingStatus.SERVING,
                10,
                message="scheduler NOT_SERVING while draining",
            )
            with pytest.raises(PagodaError) as info:
                client.generate(token_ids=[5, 6, 7], max_tokens=3)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            for first, stream in zip(firsts, streams):
                tokens = list(first.token_ids) + [t for d in stream for t in d.token_ids]
                assert len(tokens) == 120
        assert system.scheduler.process.wait(timeout=30) == 0
