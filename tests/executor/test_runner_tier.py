"""ModelRunner with an offload tier: saves before the step, loads before the forward, the same logits as computing.

A real tiny checkpoint, a real tier on disk: a prefix computed and saved by one
runner is loaded by another (a restart), and the step after the loads gives the
logits computing the whole prompt gives. A bad block fails only its sequence,
recoverably.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import ExecutorConfig
from executor_svc.kv.cache import KVCacheSpec
from executor_svc.kv.tier.open_tier import lock_dir, open_tier
from executor_svc.kv.tier.step_io import TierStepIO
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from scheduler_svc.kv.kv_cache_manager import hash_block_tokens
from tests.executor.conftest import GREEDY, install_recorder

BS = 4
NUM_BLOCKS = 40
PROMPT = [5, 9, 17, 33, 40, 41, 77, 90, 3, 12, 60, 61, 62, 63]  # 3 full blocks and 2 tokens


def make_runner(checkpoints, tier_dir=None, memory=0):
    spec = KVCacheSpec(2, 2, 16, BS, torch.float32)
    runner = ModelRunner(
        str(checkpoints["llama"]),
        dtype="float32",
        device="cpu",
        block_size=BS,
        kv_cache_memory_bytes=NUM_BLOCKS * spec.bytes_per_block,
        attention_backend="torch",
        max_model_len=64,
    )
    tier = None
    if tier_dir is not None or memory:
        config = ExecutorConfig(kv_offload_dir=str(tier_dir or ""), kv_offload_memory=memory)
        tier = open_tier(config, runner.kv_cache, "model=tiny-llama;dtype=float32", lock_dir(config))
        runner.attach_tier(TierStepIO(tier.store, runner.kv_cache))
    return runner, install_recorder(runner), tier


def hashes(tokens, num_blocks):
    out, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tuple(tokens[i * BS : (i + 1) * BS]), "")
        out.append(parent)
    return out


def new_seq(seq_id, blocks, num_computed=0, loads=()):
    return t.NewSequence(
        seq_id,
        f"r{seq_id}",
        tuple(PROMPT),
        len(PROMPT),
        GREEDY,
        tuple(blocks),
        num_computed,
        len(PROMPT) - num_computed,
        loads=tuple(loads),
    )


def saves_of(blocks):
    return tuple(
        t.BlockSave(b, h, tuple(PROMPT[i * BS : (i + 1) * BS]))
        for i, (b, h) in enumerate(zip(blocks, hashes(PROMPT, 3)))
    )


@pytest.fixture()
def stored(checkpoints, tmp_path):
    """A runner computed PROMPT in blocks 10..13 and saved its 3 full blocks to a tier in tmp_path, then stopped."""
    runner, recorder, tier = make_runner(checkpoints, tmp_path)
    blocks = [10, 11, 12, 13]
    out = runner.execute(t.StepPlan(0, new_seqs=(new_seq(1, blocks),)))
    assert not out.errors
    computed = [runner.kv_cache.storage[:, :, :, b].clone() for b in (10, 11, 12)]
    # The sequence finishes and its blocks are reused in the same step that saves them: saves run first.
    reuse = t.NewSequence(2, "r2", (1, 2, 3, 4, 5), 5, GREEDY, (10, 11), 0, 5)
    runner.execute(t.StepPlan(1, new_seqs=(reuse,), dropped_seq_ids=(1,), saves=saves_of(blocks[:3])))
    tier.close(10)
    assert not torch.equal(runner.kv_cache.storage[:, :, :, 10], computed[0])  # reused by sequence 2
    return runner, recorder.records[0][1].clone(), computed


def test_a_restarted_runner_loads_the_prefix_and_gives_the_same_logits(checkpoints, tmp_path, stored):
    _, cold_logits, cold_blocks = stored
    runner, recorder, tier = make_runner(checkpoints, tmp_path)
    assert sorted(tier.store.hashes()) == sorted(hashes(PROMPT, 3))
    loads = [t.BlockLoad(h, b) for h, b in zip(hashes(PROMPT, 3), (30, 5, 21))]
    out = runner.execute(t.StepPlan(0, new_seqs=(new_seq(7, [30, 5, 21, 2], 12, loads),)))
    assert not out.errors and out.num_scheduled_tokens == 2 and out.timings.load_ns > 0
    for block, expected in zip((30, 5, 21), cold_blocks):
        assert torch.equal(runner.kv_cache.storage[:, :, :, block], expected)  # bit for bit
    torch.testing.assert_close(recorder.records[0][1], cold_logits, rtol=1e-5, atol=1e-5)
    assert out.outputs[0].token_ids == (int(cold_logits.argmax()),)
    tier.close(10)


def test_a_bad_block_fails_only_its_sequence_recoverably(checkpoints, tmp_path, stored):
    runner, _, tier = make_runner(checkpoints, tmp_path)
    victim = hashes(PROMPT, 3)[1]
    path = tier.store.disk.path(victim)
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    loads = [t.BlockLoad(h, b) for h, b in zip(hashes(PROMPT, 3), (30, 5, 21))]
    other = t.NewSequence(8, "r8", (7, 8, 9), 3, GREEDY, (3,), 0, 3)
    out = runner.execute(t.StepPlan(0, new_seqs=(new_seq(7, [30, 5, 21, 2], 12, loads), other)))
    (error,) = out.errors
    assert error.seq_id == 7 and error.missing_block_hashes == (victim,) and "checksum" in error.message
    assert [o.seq_id for o in out.outputs] == [8] and not runner.has_sequence(7)
    assert tier.store.stats.rejected["checksum"] == 1 and victim not in tier.store
    tier.close(10)


def test_a_runner_without_a_tier_refuses_loads_recoverably(checkpoints):
    runner, _, _ = make_runner(checkpoints)
    loads = [t.BlockLoad(h, b) for h, b in zip(hashes(PROMPT, 3), (30, 5, 21))]
    out = runner.execute(t.StepPlan(0, new_seqs=(new_seq(7, [30, 5, 21, 2], 12, loads),), saves=saves_of([1, 2, 3])))
    (error,) = out.errors
    assert error.missing_block_hashes == tuple(hashes(PROMPT, 3)) and "no offload tier" in error.message


@pytest.mark.parametrize(
    ("loads", "num_computed", "message"),
    [
        ([(0, 30), (1, 5)], 12, "block 1 of the table is another"),
        ([(0, 30)], 6, "do not end a prefix"),
        ([(0, 30), (1, 5), (2, 21), (3, 2)], 12, "do not end a prefix"),
    ],
)
def test_loads_that_do_not_match_the_block_table_are_refused(checkpoints, tmp_path, loads, num_computed, message):
    runner, _, tier = make_runner(checkpoints, tmp_path)
    block_hashes = hashes(PROMPT, 4)
    plan_loads = [t.BlockLoad(block_hashes[i], b) for i, b in loads]
    out = runner.execute(t.StepPlan(0, new_seqs=(new_seq(7, [30, 5, 21, 2], num_computed, plan_loads),)))
    (error,) = out.errors
    assert message in error.message and error.missing_block_hashes == ()
    tier.close(10)


def test_a_memory_tier_serves_loads_without_a_disk(checkpoints):
    runner, recorder, tier = make_runner(checkpoints, memory=8 * runner_block_bytes())
    blocks = [10, 11, 12, 13]
    runner.execute(t.StepPlan(0, new_seqs=(new_seq(1, blocks),)))
    cold = recorder.records[0][1].clone()
    runner.execute(t.StepPlan(1, dropped_seq_ids=(1,), saves=saves_of(blocks[:3])))
    assert tier.store.flush(10)
    loads = [t.BlockLoad(h, b) for h, b in zip(hashes(PROMPT, 3), (30, 5, 21))]
    out = runner.execute(t.StepPlan(2, new_seqs=(new_seq(7, [30, 5, 21, 2], 12, loads),)))
    assert not out.errors and tier.store.stats.hits == {"memory": 3}
    torch.testing.assert_close(recorder.records[-1][1], cold, rtol=1e-5, atol=1e-5)
    tier.close(10)


def runner_block_bytes():
    return KVCacheSpec(2, 2, 16, BS, torch.float32).bytes_per_block


def test_quantized_weights_have_a_tier_namespace_of_their_own(checkpoints, tmp_path):
    """int8 weights give a token other KV than bf16 ones: their blocks must never meet in one tier."""
    from executor_svc.main import open_runner_tier

    dirs = []
    for quantization in ("none", "int8"):
        runner = ModelRunner(
            str(checkpoints["llama"]),
            dtype="bfloat16",
            device="cpu",
            block_size=BS,
            kv_cache_memory_bytes=1 << 20,
            quantization=quantization,
            max_model_len=64,
        )
        config = ExecutorConfig(kv_offload_dir=str(tmp_path))
        tier = open_runner_tier(config, runner, str(checkpoints["llama"]), lock_dir(config), None)
        dirs.append(tier.store.disk.dir)
        assert ("quantization=int8" in tier.store.ns.identity) == (quantization == "int8")
        tier.close(10)
    assert dirs[0] != dirs[1] and dirs[0].parent == dirs[1].parent == tmp_path
