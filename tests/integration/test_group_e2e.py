"""Executor groups through the real system: a scheduler and group executors started as processes.

Every tiny architecture of the executor tests, served by one group split by
tensor parallel (T=2), then by pipeline parallel (P=2), and plain Llama by
both at once (2 x 2): the scheduler chunks prompts (16-token steps), answers a
repeated prompt from its prefix cache, preempts sequences (a KV pool of 40
blocks of 4 tokens per rank, too small for two of the five concurrent requests),
and speculates (n-gram and the model drafting for itself, replicated on every
rank). Every output equals transformers' greedy generate in fp32.

Then a rank is SIGKILLed mid-stream: its group goes down at once (the leader
exits 75), the supervisor restarts it whole, the streams complete with the
same tokens through the other group, and the restarted group serves again.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from support.pool import wait_pool_whole
from support.services import wait_until
from support.system import fp32_launcher
from support.tiny_model import hf_greedy, write_tokenizer_files

from pagoda_client import Client
from tests.executor.conftest import ARCHS, make_tiny_checkpoint
from tests.integration.test_speculative_families import NUM_OUTPUT, _generate, _prompts

pytestmark = pytest.mark.integration

VOCAB = 384
BLOCK_SIZE = 4
NUM_BLOCKS = 40
# (architecture, tensor, pipeline): every family split each way; Llama both ways at once.
# Long enough that the streams are still running when the test finds the busy group, on any machine, and within
# the launcher's 256-token context with the longest prompt (19 tokens).
KILL_OUTPUT = 224
SPLITS = [(arch, *split) for arch in sorted(ARCHS) for split in ((2, 1), (1, 2))] + [("llama", 2, 2)]


def _group_flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]


def _rank_block_bytes(folder: Path, tp: int, pp: int) -> int:
    """fp32 K and V of one block on the rank with the most of them: its stage's layers, its KV heads (replicated
    when the group has more ranks than heads), plus the whole draft model's (replicated on every rank)."""
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    per_layer_head = 2 * BLOCK_SIZE * head_dim * 4
    return per_layer_head * (-(-layers // pp) * max(1, kv_heads // tp) + layers * kv_heads)


@pytest.fixture(scope="module", params=SPLITS, ids=[f"{a}-tp{t}-pp{p}" for a, t, p in SPLITS])
def group_system(request, tmp_path_factory):
    """(folder, running system): one group of the architecture, drafting for itself, NUM_BLOCKS KV blocks."""
    arch, tp, pp = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{tp}x{pp}")
    folder = write_tokenizer_files(make_tiny_checkpoint(root, arch, vocab_size=VOCAB), VOCAB)
    with fp32_launcher(
        folder,
        root / "logs",
        kv_cache_memory=str(NUM_BLOCKS * _rank_block_bytes(folder, tp, pp)),
        block_size=BLOCK_SIZE,
        extra_executor_args=[*_group_flags(tp, pp), "--draft-model", str(folder)],
        extra_scheduler_args=[
            "--max-num-batched-tokens",
            "16",
            "--speculative",
            "ngram+draft",
            "--num-speculative-tokens",
            "4",
            "--speculative-adaptive",
            "false",
        ],
        startup_timeout_s=240,
    ) as system:
        yield folder, system


def test_group_greedy_equals_transformers(group_system):
    folder, system = group_system
    prompts = _prompts()
    with Client(system.target, timeout=300) as client:
        first, again = (_generate(client, prompts[:1])[0] for _ in range(2))
        results = _generate(client, prompts, system.executor_pids[0])
        status = client.status()
        wait_pool_whole(client)
    assert status.executors[0].num_kv_blocks == NUM_BLOCKS
    assert status.num_preemptions_total > 0, "the pool was large enough: nothing was preempted"
    assert again.usage.cached_tokens > 0
    assert status.spec_num_drafts_total > 0
    expected = [hf_greedy(folder, p, NUM_OUTPUT) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert first.token_ids == again.token_ids == expected[0]


def _follower_pids(leader_pid: int) -> list[int]:
    """The leader's local ranks (its child processes)."""
    out = subprocess.run(["pgrep", "-P", str(leader_pid)], capture_output=True, text=True, check=False).stdout
    return [int(pid) for pid in out.split()]


def test_a_killed_rank_restarts_its_group_and_no_stream_is_lost(tmp_path):
    folder = write_tokenizer_files(make_tiny_checkpoint(tmp_path, "llama", vocab_size=VOCAB), VOCAB)
    rng_prompts = [[(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(12 + i)] for i in range(8)]
    expected = [hf_greedy(folder, p, KILL_OUTPUT) for p in rng_prompts]
    with fp32_launcher(
        folder,
        tmp_path / "logs",
        kv_cache_memory="4MiB",
        block_size=BLOCK_SIZE,
        num_executors=2,
        restart=True,
        extra_executor_args=_group_flags(2, 1),
        startup_timeout_s=240,
    ) as system:
        with Client(system.target, timeout=300) as client:
            with concurrent.futures.ThreadPoolExecutor(len(rng_prompts)) as pool:
                futures = [
                    pool.submit(client.generate, token_ids=p, max_tokens=KILL_OUTPUT, temperature=0, ignore_eos=True)
                    for p in rng_prompts
                ]
                # The group with running sequences loses its rank 1 while they stream.
                wait_until(lambda: _busy_or_failed(client, system, futures), 60, "sequences running on a group")
                index = _busy_executor(client, system) or 0
                leader = system.executor_pids[index]
                followers = _follower_pids(leader)
                assert len(followers) == 1, followers
                os.kill(followers[0], signal.SIGKILL)
                results = [f.result() for f in futures]
            assert [r.token_ids for r in results] == expected
            new_leader = system.wait_restarted(system.executors[index], leader, timeout_s=180, serving=True)
            assert new_leader != leader
            assert system.executors[index].num_restarts >= 1
            assert len(_follower_pids(new_leader)) == 1
            # The restarted group serves: both groups READY, and requests go through.
            wait_until(
                lambda: sum(e.state == "READY" for e in client.status().executors) == 2, 120, "both groups READY"
            )
            again = client.generate(token_ids=rng_prompts[0], max_tokens=KILL_OUTPUT, temperature=0, ignore_eos=True)
            assert again.token_ids == expected[0]
    assert "group_rank_lost" in system.logs()[system.executors[index].name]


def _busy_or_failed(client: Client, system, futures: list[concurrent.futures.Future]) -> bool:
    """True once a group runs sequences; a request that already failed fails the test with its own error."""
    for future in futures:
        if future.done() and future.exception() is not None:
            raise AssertionError(f"a request failed before the kill: {future.exception()!r}")
    return _busy_executor(client, system) is not None


def _busy_executor(client: Client, system) -> int | None:
    """Index (in the launcher's order) of an executor running sequences, if any."""
    running = {e.address: e.num_running for e in client.status().executors}
    for index, address in enumerate(system.executor_addresses):
        if running.get(address, 0) > 0:
            return index
    return None
