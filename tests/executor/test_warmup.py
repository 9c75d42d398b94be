"""The start-up warm-up (runner.warmup): one step of each kind, the KV cache and the held sequences as they were."""

from __future__ import annotations

import resource

import pytest
import torch
from protocol.conftest import scrape
from support.services import executor_service
from support.tiny_model import build_tiny_model

from executor_svc.kv.cache import KVCache, KVCacheSpec
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.runner.warmup import layout
from pagoda import step as t
from pagoda.launch.launcher import free_port
from tests.executor.conftest import GREEDY, install_recorder, make_tiny_checkpoint

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
NUM_BLOCKS = 128


def make_runner(path, num_blocks: int = NUM_BLOCKS, **options) -> ModelRunner:
    """The tiny model in fp32 with torch attention, 16-token blocks, ``num_blocks`` of them (the model's alone)."""
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    return ModelRunner(
        str(path),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=num_blocks * spec.bytes_per_block,
        attention_backend="torch",
        max_model_len=MAX_MODEL_LEN,
        **options,
    )


def record_forwards(runner: ModelRunner) -> list[tuple[int, list[tuple[int, int]], int]]:
    """Each forward the runner runs from now on: (decode rows, [(chunk tokens, cached tokens)], longest context)."""
    forwards = []
    forward = runner._forward

    def recorded(batch):
        meta = batch.attn_meta
        chunks = [(span.num_query_tokens, span.num_cached_tokens) for span in meta.prefills]
        forwards.append((meta.num_decode_seqs, chunks, int(meta.context_lens.max())))
        return forward(batch)

    runner._forward = recorded
    return forwards


def block_contents(runner: ModelRunner) -> list[torch.Tensor]:
    caches = [runner.kv_cache] + ([runner.draft.kv_cache] if runner.draft is not None else [])
    return [tensor.clone() for cache in caches for tensor, _ in cache.block_tensors()]


def test_the_kv_cache_is_resident_once_allocated():
    """The warm-up writes no pass over the pool: allocating it zeroed faults every page in already."""
    spec = KVCacheSpec(4, 2, 64, 32, torch.int8)
    cache = KVCache(spec, 64 * 2**20 // spec.bytes_per_block, torch.device("cpu"))
    num_pages = cache.num_bytes // 4096
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for tensor, _ in cache.block_tensors():
        tensor.fill_(1)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < num_pages // 100


def test_the_layout_fits_the_pool_and_the_context():
    default = layout(1456, 32, 8192)  # SmolLM2 in bf16 with 1 GiB of KV cache
    assert (default.prefill_tokens, default.chunk_tokens, default.chunk_start) == (2048, 512, 1536)
    assert (default.batch_sizes, default.mixed_rows, default.num_blocks) == ((1, 64, 8), 8, 64 + 16 + 64)
    assert [default.context_len(n) for n in (1, 8, 64)] == [2016, 512, 64]
    # A small pool: the prefill in half of it, decode batches cut to the blocks left.
    small = layout(40, 4, 64)
    assert (small.prefill_tokens, small.chunk_tokens, small.chunk_start) == (63, 15, 48)
    assert (small.batch_sizes, small.mixed_rows, small.num_blocks) == ((1, 20, 8), 8, 16 + 4 + 20)
    tiny = layout(3, 16, 2048)
    assert (tiny.prefill_tokens, tiny.batch_sizes, tiny.mixed_rows, tiny.num_blocks) == (12, (1,), 1, 3)
    assert layout(1, 16, 2048) is None


def test_warmup_runs_each_kind_of_step(checkpoints):
    runner = make_runner(checkpoints["llama"])
    forwards = record_forwards(runner)
    report = runner.warmup()
    plan = layout(NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN)
    assert (plan.prefill_tokens, plan.chunk_tokens, plan.chunk_start, plan.batch_sizes) == (511, 127, 384, (1, 64, 8))
    assert forwards == [
        (0, [(511, 0)], 511),  # the chunk at the step budget (here the context limit)
        (8, [(127, 384)], 511),  # decode rows beside a chunk after a cached prefix
        (1, [], 481),  # decode only: one row over most of the chunk's tokens
        (64, [], 65),
        (8, [], 481),
    ]
    assert [(s.kind, s.num_seqs, s.num_tokens) for s in report.steps] == [
        ("prefill", 1, 511),
        ("mixed", 9, 135),
        ("decode", 1, 1),
        ("decode", 64, 64),
        ("decode", 8, 8),
    ]
    assert report.summary() == "prefill 511 tok, mixed 135 tok, decode 1/64/8 rows"
    assert runner.num_sequences() == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_warmup_leaves_the_kv_cache_and_the_held_sequences_as_they_were(checkpoints, kv_cache_dtype):
    """A sequence held across the warm-up, in blocks the warm-up writes, decodes the bits it decodes without it."""
    prompt, block_ids = [5, 9, 17, 33, 40, 41, 77, 90, 3, 12, 8, 100, 64, 2, 7, 7, 19], (1, 0)
    runners = [make_runner(checkpoints["llama"], kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    recorders = [install_recorder(r) for r in runners]
    for runner in runners:
        new = t.NewSequence(1, "r1", tuple(prompt), len(prompt), GREEDY, block_ids, 0, len(prompt))
        assert not runner.execute(t.StepPlan(1, new_seqs=(new,))).errors
    warmed = runners[0]
    before = block_contents(warmed)
    del recorders[0].records[:]
    report = warmed.warmup()
    assert len(report.steps) == 5 and len(recorders[0].records) == 1 + 9 + 1 + 64 + 8
    assert all(torch.equal(a, b) for a, b in zip(block_contents(warmed), before))
    assert warmed.num_sequences() == 1 and warmed.has_sequence(1)
    del recorders[0].records[:], recorders[1].records[:]
    for runner in runners:
        out = runner.execute(t.StepPlan(2, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
        assert not out.errors and len(out.outputs) == 1
    (tokens, logits), (twin_tokens, twin_logits) = recorders[0].records[0], recorders[1].records[0]
    assert tokens == twin_tokens and torch.equal(logits, twin_logits)


def test_warmup_runs_the_draft_model_and_restores_its_cache(checkpoints, tmp_path):
    draft = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=1)
    runner = make_runner(checkpoints["llama"], draft_model_path=str(draft))
    assert runner.draft is not None
    new = t.NewSequence(1, "r1", (5, 9, 17), 3, GREEDY, (0,), 0, 3)
    assert not runner.execute(t.StepPlan(1, new_seqs=(new,))).errors
    proposed = []
    propose = runner.draft.propose
    runner.draft.propose = lambda states: (proposed.append([s.num_model_draft_tokens for s in states]), propose(states))
    before, valid = block_contents(runner), runner.draft.block_state()
    report = runner.warmup()
    assert proposed == [[2] * 8]  # the last decode step's rows, two drafts each
    assert report.steps[-1].kind == "draft" and report.steps[-1].num_tokens == 8 * 3  # each row and its drafts
    assert all(torch.equal(a, b) for a, b in zip(block_contents(runner), before))
    assert runner.draft.block_state() == valid and runner.num_sequences() == 1


def test_a_pool_too_small_for_the_steps_gets_no_warmup(checkpoints):
    runner = make_runner(checkpoints["llama"], num_blocks=1)
    forwards = record_forwards(runner)
    report = runner.warmup()
    assert report.steps == () and forwards == [] and report.summary() == ""


@pytest.mark.integration
def test_the_ready_line_and_the_metrics_report_the_warmup(tmp_path):
    metrics_port = free_port()
    model_dir = build_tiny_model(tmp_path / "tiny-llama")
    executor = executor_service("executor", model_dir, tmp_path, ["--metrics-port", str(metrics_port)]).start()
    try:
        executor.wait_serving()
        (ready,) = executor.events("executor_ready")
        metrics = scrape(metrics_port)
    finally:
        executor.stop()
    # 2 MiB of fp32 KV: 64 blocks of 64 tokens; the chunk at the context limit (1,024), 44 decode rows at most.
    assert ready["warmup_s"] > 0 and ready["warmup"] == "prefill 1023 tok, mixed 263 tok, decode 1/44/8 rows"
    assert metrics["pagoda_executor_warmup_seconds"] == pytest.approx(ready["warmup_s"], abs=1e-3)
