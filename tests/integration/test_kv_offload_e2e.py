"""The KV offload tier through the real services on the tiny model (docs/kv-offload.md).

An executor restarted with the same --kv-offload-dir serves a prompt from its
tier at once, and so does a whole system started again; a prefix evicted from
a tiny device pool comes back from the tier; an over-subscribed pool swaps
instead of recomputing. Every output equals the one computed without a tier.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal

import pytest
from support.system import fp32_launcher

from pagoda.launch.launcher import LauncherError, OffloadPlan
from pagoda_client import Client

pytestmark = pytest.mark.integration

BS = 16


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(length)]


def _generate(target: str, token_ids: list[int], max_tokens: int = 8):
    with Client(target, timeout=120, max_retries=3) as client:
        return client.generate(token_ids=token_ids, max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _tier_args(path) -> list[str]:
    return ["--kv-offload-dir", str(path), "--kv-offload-size", "64MiB"]


def test_a_restarted_executor_serves_the_prompt_from_its_tier(tiny_model_dir, tmp_path):
    prompt = _prompt(1, 600)
    logs = tmp_path / "logs"
    with fp32_launcher(
        tiny_model_dir, logs, "4MiB", block_size=BS, extra_executor_args=_tier_args(tmp_path / "tier")
    ) as system:
        cold = _generate(system.target, prompt)
        assert cold.usage.cached_tokens == 0
        system.kill_executor(0, signal.SIGTERM)  # drains and stores what is queued
        system.restart_executor(0)
        warm = _generate(system.target, prompt)
        log = system.logs()["executor-0"]
    assert warm.token_ids == cold.token_ids
    assert warm.usage.cached_tokens == warm.usage.cached_tokens_offloaded == 592  # every full block but the last
    assert '"event": "kv_offload_scanned"' in log and '"num_blocks": 37' in log


def test_a_whole_system_started_again_serves_from_the_tier(tiny_model_dir, tmp_path):
    prompt = _prompt(2, 500)
    tier = _tier_args(tmp_path / "tier")
    with fp32_launcher(tiny_model_dir, tmp_path / "a", "4MiB", block_size=BS, extra_executor_args=tier) as system:
        cold = _generate(system.target, prompt)
    with fp32_launcher(tiny_model_dir, tmp_path / "b", "4MiB", block_size=BS, extra_executor_args=tier) as system:
        warm = _generate(system.target, prompt)
        with Client(system.target) as client:
            status = client.status()
    assert warm.token_ids == cold.token_ids and warm.usage.cached_tokens_offloaded == 496
    assert status.offload_hit_tokens_total == 496 and status.executors[0].num_tier_blocks >= 31
    assert "disk" in status.executors[0].kv_offload


def test_a_turn_evicted_from_a_tiny_pool_comes_back_from_the_tier(tiny_model_dir, tmp_path):
    first_turn = _prompt(3, 300)
    others = [_prompt(10 + i, 300) for i in range(6)]
    # 40 blocks of 16 tokens: each 300-token request takes 20, so the others push the first turn out.
    with fp32_launcher(
        tiny_model_dir, tmp_path / "tiny", "320KiB", block_size=BS, extra_executor_args=_tier_args(tmp_path / "t")
    ) as system:
        answer = _generate(system.target, first_turn, 16)
        for other in others:
            _generate(system.target, other, 4)
        second_turn = first_turn + answer.token_ids + _prompt(4, 40)
        second = _generate(system.target, second_turn, 16)
        with Client(system.target) as client:
            assert client.status().executors[0].num_kv_blocks == 40
    with fp32_launcher(tiny_model_dir, tmp_path / "big", "16MiB", block_size=BS) as system:
        reference = _generate(system.target, second_turn, 16)
    assert second.token_ids == reference.token_ids
    assert second.usage.cached_tokens_offloaded >= 288  # the first turn's full blocks, from the tier


def _requests(n: int) -> list[dict]:
    rng = random.Random(5)
    return [
        dict(token_ids=_prompt(100 + i, rng.randrange(16, 64)), max_tokens=rng.randrange(60, 120), ignore_eos=True)
        for i in range(n)
    ]


def _run_all(target: str, requests: list[dict]):
    with Client(target, timeout=600, max_retries=0) as client:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(lambda kw: client.generate(temperature=0, **kw), requests))
        return results, client.status()


def test_an_over_subscribed_pool_swaps_and_changes_no_token(tiny_model_dir, tmp_path):
    requests = _requests(100)
    blocks_needed = sum(-(-(len(r["token_ids"]) + r["max_tokens"]) // BS) for r in requests)
    small = f"{blocks_needed // 5 * 8}KiB"  # 8 KiB per block of 16 tokens
    tier = _tier_args(tmp_path / "tier")
    with fp32_launcher(tiny_model_dir, tmp_path / "s", small, block_size=BS, extra_executor_args=tier) as system:
        swapped, status = _run_all(system.target, requests)
    assert status.num_preemptions_total > 0 and status.num_swaps_total > 0
    with fp32_launcher(tiny_model_dir, tmp_path / "b", "16MiB", block_size=BS) as system:
        roomy, status = _run_all(system.target, requests)
    assert status.num_preemptions_total == 0
    assert [r.token_ids for r in swapped] == [r.token_ids for r in roomy]


def _tier_dir(system) -> str:
    """The directory executor 0 scanned at its (last) start."""
    lines = [line for line in system.logs()["executor-0"].splitlines() if '"kv_offload_scanned"' in line]
    return json.loads(lines[-1])["directory"]


def test_two_systems_side_by_side_never_share_a_tier_and_a_held_one_is_refused(tiny_model_dir, tmp_path):
    shared = OffloadPlan(str(tmp_path / "root"), next_free=True)
    with (
        fp32_launcher(tiny_model_dir, tmp_path / "a", "1MiB", block_size=BS, kv_offload=shared) as a,
        fp32_launcher(tiny_model_dir, tmp_path / "b", "1MiB", block_size=BS, kv_offload=shared) as b,
    ):
        assert _tier_dir(a).startswith(str(tmp_path / "root" / "executor-0") + "/")
        assert _tier_dir(b).startswith(str(tmp_path / "root" / "executor-0.1") + "/")
        explicit = OffloadPlan(str(tmp_path / "root"))
        with pytest.raises(
            LauncherError, match=rf"executor-0 is in use by another process \(pid {a.executor_pids[0]}\)"
        ):
            fp32_launcher(tiny_model_dir, tmp_path / "c", "1MiB", block_size=BS, kv_offload=explicit).start()
        # A killed executor's directory is free at once (the kernel drops its lock): it restarts on it.
        a.kill_executor(0, signal.SIGKILL)
        a.restart_executor(0)
        assert _tier_dir(a).startswith(str(tmp_path / "root" / "executor-0") + "/")


def test_a_restarted_scheduler_finds_the_tier_the_executor_kept(tiny_model_dir, tmp_path):
    prompt = _prompt(6, 400)
    tier = _tier_args(tmp_path / "tier")
    with fp32_launcher(tiny_model_dir, tmp_path / "logs", "4MiB", block_size=BS, extra_executor_args=tier) as system:
        cold = _generate(system.target, prompt)
        executor_pid = system.executor_pids[0]
        system.kill(system.scheduler, signal.SIGTERM)
        system.restart(system.scheduler)
        warm = _generate(system.target, prompt)
        assert system.executor_pids[0] == executor_pid  # the same executor process, its tier kept
    # The new scheduler knows nothing of the executor's device cache: the prefix comes from the tier.
    assert warm.token_ids == cold.token_ids and warm.usage.cached_tokens_offloaded == 384
