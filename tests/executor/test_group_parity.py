"""Executor groups on gloo: every family, split by tensor and pipeline parallel, gives transformers' tokens.

Each configuration starts its ranks as processes (torch.multiprocessing), one
thread each; every rank builds its shard of every tiny checkpoint and follows
the same plans (the leader's runner calls are mirrored so: executor_svc.parallel.group),
a minimal scheduler with chunked prefill (7-token chunks, three sequences in
each step). Rank 0's greedy tokens must equal transformers' generate in fp32.
The real system with the scheduler's prefix cache, preemption and speculation
is tests/integration/test_group_e2e.py.
"""

from __future__ import annotations

import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.executor.conftest import ARCHS, load_hf
from tests.executor.test_model_hf_parity import _generate, greedy_prompts

NUM_NEW = 24
CONFIGS = [(2, 1), (1, 2), (2, 2)]  # (tensor, pipeline)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, tp: int, pp: int, port: int, folders: dict, backend: str, results) -> None:
    """One rank: its shard of each checkpoint, the plans of ``_generate``; rank 0 puts what it generated."""
    torch.set_num_threads(1)
    try:
        from executor_svc.parallel.collectives import GroupComm
        from executor_svc.parallel.shard import Placement
        from executor_svc.runner.model_runner import ModelRunner

        comm = GroupComm(Placement(rank, tp, pp), f"127.0.0.1:{port}", 120, torch.device("cpu"))
        out = {}
        for arch, folder in folders.items():
            runner = ModelRunner(
                folder,
                dtype="float32",
                device="cpu",
                block_size=4,
                kv_cache_memory_bytes=2**20,
                attention_backend=backend,
                group=comm,
            )
            out[arch] = (runner.shard.describe(), _generate(runner, greedy_prompts(), NUM_NEW, chunk=7))
        if rank == 0:
            results.put(out)
        comm.close()
    except BaseException:
        results.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def run_group(tp: int, pp: int, folders: dict, backend: str = "torch") -> dict:
    """What rank 0 of a (tp x pp) group generated for each checkpoint."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, tp, pp, port, folders, backend, results)) for rank in range(tp * pp)
    ]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert "error" not in out, out.get("error")
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return out


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens for each checkpoint and prompt."""
    out = {}
    for arch, folder in checkpoints.items():
        hf = load_hf(folder)
        with torch.no_grad():
            out[arch] = [
                hf.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False)[0, len(p) :].tolist()
                for p in greedy_prompts()
            ]
    return out


@pytest.mark.parametrize(("tp", "pp"), CONFIGS, ids=[f"tp{t}-pp{p}" for t, p in CONFIGS])
def test_every_family_split_generates_transformers_tokens(tp, pp, checkpoints, expected):
    backend = "auto" if (tp, pp) == (2, 1) else "torch"  # the C++ kernels per shard (built), and the torch path
    got = run_group(tp, pp, {arch: str(folder) for arch, folder in checkpoints.items()}, backend)
    assert set(got) == set(ARCHS)
    for arch, (shard, generated) in got.items():
        assert [generated[i] for i in range(3)] == expected[arch], f"{arch} ({shard})"
    # The shards are real: rank 0 of a split holds part of the heads or of the layers.
    shard = got["llama"][0]
    if tp == 2:
        assert "q heads 0-1," in shard, shard  # 4 heads: rank 0 the first two
    if pp == 2:
        assert shard.startswith("layers 0-0,"), shard  # 2 layers: stage 0 the first
