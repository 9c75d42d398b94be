"""The bf16 prefill attention kernel (AMX tiles or AVX512-BF16 dot products) against exact attention over the
same paged cache."""

from __future__ import annotations

import pytest
import torch

from tests.executor.conftest import native_ops


@pytest.fixture(scope="module")
def prefill(cpp_kernel):
    return native_ops("bf16", "needs AMX (and a kernel that grants it) or AVX512-BF16")


def _case(gen, spans, num_heads, num_kv_heads, head_dim, block_size):
    """Random bf16 cache and queries; spans (num_query, num_cached); returns the kernel's inputs."""
    total = sum(n for n, _ in spans)
    blocks_per = [-(-(n + c) // block_size) for n, c in spans]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per)
    tables = torch.zeros(len(spans), max_blocks, dtype=torch.int64)
    used = 0
    for i, count in enumerate(blocks_per):
        tables[i, :count] = perm[used : used + count]
        used += count
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).bfloat16()
    wide = torch.randn(total, num_heads + 2 * num_kv_heads, head_dim, generator=gen).bfloat16()
    q = wide[:, :num_heads]  # strided rows, as the model passes them
    rows, start = [], 0
    for i, (n, c) in enumerate(spans):
        rows.append((start, n, c, i))
        start += n
    return q, k_cache, v_cache, tables, torch.tensor(rows, dtype=torch.int64)


def _reference(q, k_cache, v_cache, tables, spans, scale, window=0, softcap=0.0):
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for start, n, cached, seq in spans.tolist():
        ctx = cached + n
        ids = tables[seq, : -(-ctx // block_size)]
        keys = k_cache[:, ids].flatten(1, 2)[:, :ctx].double().repeat_interleave(group, 0)  # [H, ctx, D]
        values = v_cache[:, ids].flatten(1, 2)[:, :ctx].double().repeat_interleave(group, 0)
        queries = q[start : start + n].double().transpose(0, 1)  # [H, n, D]
        scores = queries @ keys.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = (cached + torch.arange(n))[:, None]
        visible = torch.arange(ctx)[None, :] <= query_pos
        if window:
            visible &= torch.arange(ctx)[None, :] > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + n] = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "spans"),
    [
        ((9, 3), 64, 32, [(1, 0), (17, 0), (50, 37), (16, 16)]),
        ((9, 3), 64, 16, [(100, 0), (33, 5)]),
        ((4, 4), 64, 16, [(20, 0), (7, 70)]),  # no GQA
        ((8, 2), 128, 16, [(40, 3)]),  # group of 4: passes of 3 and 1
        ((6, 3), 64, 48, [(65, 0)]),  # group of 2, block size not a power of two
    ],
)
def test_paged_prefill_matches_exact_attention(prefill, heads, head_dim, block_size, spans):
    gen = torch.Generator().manual_seed(sum(n + c for n, c in spans))
    q, k_cache, v_cache, tables, rows = _case(gen, spans, *heads, head_dim, block_size)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    prefill.paged_prefill(q, k_cache, v_cache, tables, rows, scale, out)
    expected = _reference(q, k_cache, v_cache, tables, rows, scale)
    # P is rounded to bf16 before P.V (as FlashAttention does), the output to bf16.
    assert (out.double() - expected).abs().max().item() < 2e-2


@pytest.mark.parametrize(
    ("heads", "head_dim", "spans", "window", "softcap"),
    [
        ((8, 4), 256, [(20, 0), (33, 40)], 0, 0.0),  # Gemma's head_dim
        ((9, 3), 64, [(50, 0), (17, 37), (5, 200)], 24, 0.0),  # windows inside a chunk, before the prefix
        ((9, 3), 64, [(70, 0), (40, 100)], 0, 1.5),  # soft-capped
        ((8, 4), 256, [(45, 30), (64, 0)], 20, 1.5),  # both (Gemma 2's sliding layers)
        ((6, 2), 128, [(33, 95)], 7, 0.0),  # a window narrower than the query block
    ],
)
def test_windows_softcap_and_head_dim_256(prefill, heads, head_dim, spans, window, softcap):
    gen = torch.Generator().manual_seed(sum(n + c for n, c in spans) + window)
    q, k_cache, v_cache, tables, rows = _case(gen, spans, *heads, head_dim, 16)
    q = q * 3  # scores large enough that the cap bends them
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    prefill.paged_prefill(q, k_cache, v_cache, tables, rows, scale, out, window, softcap)
    expected = _reference(q, k_cache, v_cache, tables, rows, scale, window, softcap)
    assert (out.double() - expected).abs().max().item() < 2e-2
    if window or softcap:  # the options change the result: the test would see them ignored
        assert (_reference(q, k_cache, v_cache, tables, rows, scale) - expected).abs().max().item() > 0.1


def test_paged_prefill_leaves_other_rows_and_rejects_bad_spans(prefill):
    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, tables, rows = _case(gen, [(5, 0), (6, 2)], 9, 3, 64, 16)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    prefill.paged_prefill(q, k_cache, v_cache, tables, rows[1:], 0.125, out)
    assert torch.equal(out[:5], torch.full((5, 9, 64), 7.0, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out of range"):
        prefill.paged_prefill(q, k_cache, v_cache, tables, torch.tensor([[0, 20, 0, 0]]), 0.125, out)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        prefill.paged_prefill(q, k_cache, v_cache, tables, torch.tensor([[0, 5, 60, 0]]), 0.125, out)
    bad_tables = tables.clone()
    bad_tables[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="block id"):
        prefill.paged_prefill(q, k_cache, v_cache, bad_tables, rows, 0.125, out)
    with pytest.raises(RuntimeError, match="bf16"):
        prefill.paged_prefill(q.float(), k_cache, v_cache, tables, rows, 0.125, out)
