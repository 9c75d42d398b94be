"""ModelRunner follows the plan: paging, sequence state, per-sequence errors."""

from __future__ import annotations

import pytest
import torch

from executor_svc.kv.cache import KVCacheSpec
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import GREEDY, install_recorder, load_hf

BLOCK_SIZE = 4
NUM_BLOCKS = 40


@pytest.fixture()
def runner(checkpoints) -> ModelRunner:
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    r = ModelRunner(
        str(checkpoints["llama"]),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=NUM_BLOCKS * spec.bytes_per_block,
        attention_backend="torch",
        max_model_len=64,
    )
    install_recorder(r)
    return r


def _new(seq_id, tokens, blocks, num_scheduled, num_computed=0):
    return t.NewSequence(
        seq_id, f"r{seq_id}", tuple(tokens), len(tokens), GREEDY, tuple(blocks), num_computed, num_scheduled
    )


def test_info_reports_budgeted_blocks(runner):
    assert runner.info.num_kv_blocks == NUM_BLOCKS
    assert (runner.info.block_size, runner.info.max_model_len, runner.info.vocab_size) == (BLOCK_SIZE, 64, 128)
    assert runner.info.architecture == "LlamaForCausalLM" and runner.info.dtype == "float32"
    assert runner.info.eos_token_ids == (2,) and runner.config.bos_token_id == 1


def test_kv_written_exactly_at_slot_mapping(runner, checkpoints):
    """Layer 0 K/V of each token sit at block_table[pos // bs] * bs + pos % bs; other slots stay zero."""
    tokens = [5, 9, 17, 33, 40, 41, 77, 90, 3, 12]
    blocks = [31, 7, 19]
    out = runner.execute(t.StepPlan(1, new_seqs=(_new(1, tokens, blocks, len(tokens)),)))
    assert not out.errors and out.outputs[0].seq_id == 1
    hf = load_hf(checkpoints["llama"])
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    hf_keys, hf_values = cache.layers[0].keys[0], cache.layers[0].values[0]  # [KVH, T, Dh]
    written = set()
    for pos in range(len(tokens)):
        slot = blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        written.add(slot)
        k, v = runner.kv_cache.token_kv(0, slot)
        torch.testing.assert_close(k, hf_keys[:, pos], atol=1e-5, rtol=0)
        torch.testing.assert_close(v, hf_values[:, pos], atol=1e-5, rtol=0)
    storage = runner.kv_cache.storage.view(2, 2, 2, NUM_BLOCKS * BLOCK_SIZE, 16)  # [L, KV, KVH, slots, Dh]
    nonzero_slots = set(storage.abs().sum(dim=(0, 1, 2, 4)).nonzero().flatten().tolist())
    assert nonzero_slots == written


def test_sampled_token_is_appended_and_decoded_next(runner):
    runner.execute(t.StepPlan(1, new_seqs=(_new(1, [5, 6, 7], [0], 3),)))
    out = runner.execute(t.StepPlan(2, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
    assert not out.errors and len(out.outputs) == 1
    state = runner._seqs[1]
    assert state.num_computed_tokens == 4 and len(state.token_ids) == 5
    # A fifth token needs a second block: without it the plan is refused.
    bad = runner.execute(t.StepPlan(3, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
    assert bad.errors[0].seq_id == 1 and "cannot hold 5 tokens" in bad.errors[0].message
    assert not runner.has_sequence(1)


def test_plan_errors_hit_only_their_sequence(runner):
    runner.execute(t.StepPlan(1, new_seqs=(_new(1, [5, 6], [0], 2), _new(2, [8, 9], [1], 2))))
    out = runner.execute(
        t.StepPlan(
            2,
            new_seqs=(
                _new(3, [1, 2, 3], [NUM_BLOCKS], 3),  # block id out of range
                _new(4, [1, 2, 3], [5], 3),  # fine
                _new(5, list(range(10)), [6, 7, 8], 10),  # fine, full
            ),
            scheduled_seqs=(
                t.ScheduledSequence(1, 2),  # more tokens than known
                t.ScheduledSequence(2, 1),  # fine
                t.ScheduledSequence(99, 1),  # unknown
            ),
        )
    )
    errors = {e.seq_id: e.message for e in out.errors}
    assert set(errors) == {1, 3, 99}
    assert "out of range" in errors[3] and "unknown sequence 99" in errors[99] and "has 3 tokens" in errors[1]
    assert {o.seq_id for o in out.outputs} == {2, 4, 5}
    assert out.num_scheduled_tokens == 1 + 3 + 10
    assert [runner.has_sequence(i) for i in (1, 2, 3, 4, 5)] == [False, True, False, True, True]


def test_max_model_len_and_duplicates_are_refused(runner):
    out = runner.execute(t.StepPlan(1, new_seqs=(_new(1, list(range(70)), range(18), 65),)))
    assert "max_model_len 64" in out.errors[0].message
    out = runner.execute(
        t.StepPlan(2, new_seqs=(_new(2, [1, 2], [0], 2),), scheduled_seqs=(t.ScheduledSequence(2, 1),))
    )
    assert [e.seq_id for e in out.errors] == [2] and "twice" in out.errors[0].message


def test_drop_and_replace(runner):
    runner.execute(t.StepPlan(1, new_seqs=(_new(1, [5, 6], [0], 2), _new(2, [7], [1], 1))))
    assert runner.num_sequences() == 2
    out = runner.execute(
        t.StepPlan(2, dropped_seq_ids=(2, 77), new_seqs=(_new(1, [5, 6, 9, 9], [3, 4], 1, num_computed=3),))
    )
    assert not out.errors and runner.num_sequences() == 1
    assert runner._seqs[1].block_table == [3, 4] and runner._seqs[1].num_computed_tokens == 4
    runner.reset()
    assert runner.num_sequences() == 0


def test_warmup_leaves_no_state(runner):
    runner.execute(t.StepPlan(1, new_seqs=(_new(1, [5, 6, 7], [0], 3),)))
    before = runner.kv_cache.storage.clone()
    runner.warmup()
    assert torch.equal(runner.kv_cache.storage, before)
    assert runner.num_sequences() == 1


def test_timings_filled(runner):
    out = runner.execute(t.StepPlan(1, new_seqs=(_new(1, [5, 6, 7], [0], 3),)))
    assert out.timings.prepare_ns > 0 and out.timings.forward_ns > 0 and out.timings.sample_ns > 0


def test_out_of_range_sampling_fails_only_its_sequence(runner):
    """The executor checks each new sequence's parameters against the table's ranges, not only the scheduler."""
    import dataclasses

    bad = dataclasses.replace(_new(2, [5, 6, 7], [1], 3), sampling=dataclasses.replace(GREEDY, top_p=0.0))
    out = runner.execute(t.StepPlan(1, new_seqs=(_new(1, [5, 6, 7], [0], 3), bad)))
    assert [o.seq_id for o in out.outputs] == [1]
    assert [(e.seq_id, e.message) for e in out.errors] == [(2, "sampling: top_p must be in (0, 1], got 0.0")]
    assert not runner.has_sequence(2)
