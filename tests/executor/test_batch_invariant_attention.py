"""The batch-invariant C++ attention: a query row at position p gives the same bits however its step is made.

Decode alone, decode beside a long sequence or in a batch of 32, a row of a
prefill chunk of any size (1..CONTEXT), a chunk after a cached prefix, and a
short verify span (speculation): all the same row, for a bf16 and an int8
cache (and an fp32 one, whose default prefill is SDPA). The default paths differ (the strict xfails of
test_batch_invariance_kernels.py: decode's split of the keys, and the prefill
kernel's other algorithm).
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention.cpp_backend import CppAttentionBackend, CppStepState, _token_rows
from executor_svc.attention.metadata import AttentionMetadata, PrefillSpan
from executor_svc.attention.registry import get_backend
from executor_svc.kv.cache import LayerKV
from tests.executor.test_batch_invariance_kernels import BLOCK, CONTEXT, HEAD_DIM, POSITIONS, _sequence

SCALE = HEAD_DIM**-0.5


def _meta(table: torch.Tensor, decode_positions: list[int], spans: list[tuple[int, int]]) -> AttentionMetadata:
    """A step over copies of one sequence: decode rows at ``decode_positions``, then prefill spans (start, n)."""
    num_decode = len(decode_positions)
    lens = [p + 1 for p in decode_positions] + [start + n for start, n in spans]
    prefills, query_start = [], num_decode
    for i, (start, n) in enumerate(spans):
        prefills.append(PrefillSpan(num_decode + i, query_start, n, start, -(-(start + n) // BLOCK)))
        query_start += n
    num_seqs = num_decode + len(spans)
    starts = [0, *range(1, num_decode + 1)]
    for _, n in spans:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(query_start, dtype=torch.int64),
        block_tables=table.expand(num_seqs, -1).contiguous(),
        context_lens=torch.tensor(lens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int64),
        num_decode_seqs=num_decode,
        prefills=tuple(prefills),
        block_size=BLOCK,
    )


def _attend(backend: CppAttentionBackend, q_rows: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:
    """The backend's attention over the cache as it is (the step's K/V store is left out: the cache holds them)."""
    state = backend.prepare(meta)
    assert isinstance(state, CppStepState) and not state.split_kv
    tables, lens = state.block_tables, state.context_lens
    scales = (cache.k_scale, cache.v_scale)
    return backend.kernel.paged_decode(q_rows, cache.k, cache.v, tables, lens, SCALE, 0, 0.0, *scales, split_kv=False)


@pytest.fixture
def backend(cpp_kernel) -> CppAttentionBackend:
    backend = get_backend("cpp", torch.device("cpu"), torch.bfloat16, batch_invariant=True)
    assert isinstance(backend, CppAttentionBackend) and backend.batch_invariant
    return backend


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp32"])
def test_unsplit_decode_row_does_not_depend_on_the_batch(cpp_kernel, kv):
    """split_kv=False: beside one long sequence (which made the default split) and in a batch of 32."""
    q, cache, table = _cache(kv)
    bad = []
    for p in range(0, CONTEXT, 7):
        alone = _decode_unsplit(cpp_kernel, q, cache, table, [p])[0]
        for others in ([CONTEXT - 1], [(p * 7 + 13 * i) % CONTEXT for i in range(31)]):
            if not torch.equal(_decode_unsplit(cpp_kernel, q, cache, table, [p, *others])[0], alone):
                bad.append((p, len(others)))
    assert bad == []


def _cache(kv: str):
    """(q, cache, table) of test_batch_invariance_kernels' sequence; fp32: an fp32 model's queries and cache."""
    if kv != "fp32":
        return _sequence(kv)
    q, cache, table = _sequence("bf16")
    return q.float(), LayerKV(cache.k.float(), cache.v.float()), table


def _decode_unsplit(ops, q, cache, table, positions: list[int]) -> torch.Tensor:
    lens = torch.tensor([p + 1 for p in positions], dtype=torch.int64)
    tables = table.expand(len(positions), -1).contiguous()
    scales = (cache.k_scale, cache.v_scale)
    return ops.paged_decode(q[positions].contiguous(), cache.k, cache.v, tables, lens, SCALE, 0, 0.0, *scales, False)


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp32"])
def test_prefill_rows_equal_decode_rows_at_every_chunk_size(backend, kv):
    """Every position as a row of chunks of 1, 16, 100 and CONTEXT queries (each after its cached prefix),
    behind two decode rows, equals that position decoded alone."""
    q, cache, table = _cache(kv)
    alone = torch.stack([_decode_unsplit(backend.kernel, q, cache, table, [p])[0] for p in range(CONTEXT)])
    decode_positions = [CONTEXT - 1, 3]
    for chunk in (1, 16, 100, CONTEXT):
        spans = [(start, min(chunk, CONTEXT - start)) for start in range(0, CONTEXT, chunk)]
        rows = torch.cat([q[decode_positions], q])
        out = _attend(backend, rows, cache, _meta(table, decode_positions, spans))
        assert torch.equal(out[2:], alone), f"chunk {chunk}"
        assert torch.equal(out[:2], alone[decode_positions])


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp32"])
def test_a_verify_span_equals_the_rows_decoded_one_by_one(backend, kv):
    """Speculation verifies 1 + drafts rows as one short span; each equals its position decoded."""
    q, cache, table = _cache(kv)
    for p in POSITIONS[1:]:
        span = [(p - 3, 4)]
        out = _attend(backend, q[p - 3 : p + 1].contiguous(), cache, _meta(table, [], span))
        expected = torch.stack([_decode_unsplit(backend.kernel, q, cache, table, [r])[0] for r in range(p - 3, p + 1)])
        assert torch.equal(out, expected), f"position {p}"


def test_token_rows_give_each_token_its_sequence_table_and_length():
    table = torch.arange(8, dtype=torch.int64).view(1, 8)
    meta = _meta(table, [40], [(0, 3), (16, 2)])
    tables, lens = _token_rows(meta, meta.prefills)
    assert lens.tolist() == [41, 1, 2, 3, 17, 18]
    assert tables.shape == (6, 8) and torch.equal(tables, table.expand(6, -1))


def test_the_torch_backend_cannot_be_batch_invariant():
    with pytest.raises(ValueError, match="batch-invariant attention needs the cpp"):
        get_backend("torch", torch.device("cpu"), torch.bfloat16, batch_invariant=True)
