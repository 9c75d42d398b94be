"""The C++ paged decode kernel against dense attention, every code path.

Head dims 64/128 (AVX-512 intrinsics, even/odd bf16 lanes), 16 (intrinsics,
natural lanes), 24 (portable loops); fp32/bf16/fp16 queries and caches; the
bf16 query + bf16 cache span (vdpbf16ps scores and P.V, bf16 probabilities)
and the fp32 cache span (K rows scored in place, all fp32: held to ~1e-6 of a
float64 reference) at every group size and odd tile tails; split-K (few
sequences, long contexts); windows and empty tails; soft-capped scores
(Gemma 2) on every path, head_dim 256 (Gemma) included.
"""

from __future__ import annotations

import math

import pytest
import torch


def _dense(q, k_cache, v_cache, block_table, context_len, window, softcap=0.0):
    """q [H, D]; caches [KVH, NB, BS, D] -> [H, D] in float64."""
    num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    positions = torch.arange(context_len)
    if window:
        positions = positions[max(0, context_len - window) :]
    blocks, offsets = block_table[positions // block_size], positions % block_size
    k = k_cache[:, blocks, offsets].double().repeat_interleave(num_heads // num_kv_heads, dim=0)  # [H, L, D]
    v = v_cache[:, blocks, offsets].double().repeat_interleave(num_heads // num_kv_heads, dim=0)
    scores = torch.einsum("hd,hld->hl", q.double(), k) / math.sqrt(head_dim)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hl,hld->hd", scores.softmax(-1), v)


def _check(
    kernel,
    q_dtype,
    kv_dtype,
    context_lens,
    *,
    head_dim=64,
    block_size=16,
    window=0,
    group=3,
    num_kv_heads=2,
    tol=1e-5,
    q_scale=1.0,
    softcap=0.0,
):
    """The kernel's output for random q and caches against ``_dense``, sequence by sequence."""
    gen = torch.Generator().manual_seed(head_dim * 31 + block_size + len(context_lens))
    num_heads = group * num_kv_heads
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = len(context_lens) * max_blocks + 5
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(kv_dtype)
    q = (torch.randn(len(context_lens), num_heads, head_dim, generator=gen) * q_scale).to(q_dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks].view(-1, max_blocks)
    lens = torch.tensor(context_lens, dtype=torch.long)
    out = kernel.paged_decode(q, k_cache, v_cache, block_tables, lens, 1 / math.sqrt(head_dim), window, softcap)
    assert out.dtype == q_dtype and out.shape == q.shape
    for i, context_len in enumerate(context_lens):
        ref = _dense(q[i], k_cache, v_cache, block_tables[i], context_len, window, softcap)
        assert (out[i].double() - ref).abs().max().item() < tol, (i, context_len)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_fp32_matches_dense(cpp_kernel, head_dim, block_size):
    _check(cpp_kernel, F32, F32, [1, 15, 16, 17, 40, 77], head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("q_dtype", [F32, BF16])
def test_bf16_cache_matches_dense(cpp_kernel, head_dim, q_dtype):
    tol = 1e-5 if q_dtype == F32 else 2e-2  # bf16 output rounding
    _check(cpp_kernel, q_dtype, BF16, [3, 16, 33, 100], head_dim=head_dim, tol=tol)


def test_fp16_cache_matches_dense(cpp_kernel):
    _check(cpp_kernel, F16, F16, [7, 64], block_size=5, tol=5e-3)


@pytest.mark.parametrize("window", [4, 20, 600])
def test_window_matches_dense(cpp_kernel, window):
    _check(cpp_kernel, F32, BF16, [3, 21, 50, 1000], window=window)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128, 256])
@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_softcap_matches_dense(cpp_kernel, head_dim, q_dtype, kv_dtype):
    """Scores large enough (q scaled 4x) that a cap of 2 bends most of them; with a window too."""
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    common = dict(head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, block_size=16, tol=tol, q_scale=4.0)
    _check(cpp_kernel, context_lens=[1, 17, 40, 300], softcap=2.0, **common)
    _check(cpp_kernel, context_lens=[5, 70], softcap=2.0, window=24, **common)


def test_softcap_changes_the_result(cpp_kernel):
    """The cap above is not a no-op: uncapped attention differs from the capped reference."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 16, 64, generator=gen), torch.randn(2, 4, 16, 64, generator=gen)
    q = torch.randn(1, 6, 64, generator=gen) * 4.0
    table, lens = torch.arange(4).view(1, 4), torch.tensor([60])
    capped = cpp_kernel.paged_decode(q, k_cache, v_cache, table, lens, 0.125, 0, 2.0)
    plain = cpp_kernel.paged_decode(q, k_cache, v_cache, table, lens, 0.125, 0)
    # fp32 sums against a float64 reference: fp32's precision (as test_softcap_matches_dense), not float64's.
    dense = _dense(q[0], k_cache, v_cache, table[0], 60, 0, 2.0)
    torch.testing.assert_close(capped[0].double(), dense, rtol=1e-5, atol=1e-5)
    assert (capped - plain).abs().max() > 0.1


@pytest.mark.parametrize("context_len", [513, 1300])
def test_split_context_matches_dense(cpp_kernel, context_len):
    """One or two sequences: the context is split across threads, then merged."""
    torch.set_num_threads(2)
    _check(cpp_kernel, F32, F32, [context_len], num_kv_heads=1)
    _check(cpp_kernel, F32, BF16, [context_len, 300], head_dim=128, block_size=5, num_kv_heads=1, group=4, window=700)


_ODD_LENS = [1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 63, 65, 100, 255]
_FP32_TOL = 3e-6  # fp32 all the way: no bf16 rounding anywhere
# The two spans whose query and cache share one dtype: (dtype, tolerance).
_SPANS = [pytest.param(BF16, 2e-2, id="bf16"), pytest.param(F32, _FP32_TOL, id="fp32")]


@pytest.mark.parametrize(
    "dtype,tol,head_dim",
    [pytest.param(BF16, 2e-2, d, id=f"bf16-{d}") for d in (32, 64, 128)]
    + [pytest.param(F32, _FP32_TOL, d, id=f"fp32-{d}") for d in (64, 128)],
)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_span_matches_dense(cpp_kernel, dtype, tol, head_dim, group):
    """One query and cache dtype: every group size (one or more passes of up to 4 queries) and tile tail."""
    _check(cpp_kernel, dtype, dtype, _ODD_LENS, head_dim=head_dim, group=group, tol=tol)


@pytest.mark.parametrize("dtype,tol", _SPANS)
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_span_block_sizes(cpp_kernel, dtype, tol, block_size):
    _check(cpp_kernel, dtype, dtype, _ODD_LENS, block_size=block_size, tol=tol)


@pytest.mark.parametrize("dtype,tol", _SPANS)
@pytest.mark.parametrize("q_scale", [4.0, 12.0])
def test_span_peaky_scores(cpp_kernel, dtype, tol, q_scale):
    """Large scores: the running max grows often and the softmax is far from flat."""
    # bf16 probabilities round coarser when the softmax is peaked. fp32: a score's rounding grows with its size
    # (|s| up to ~40 at q_scale 12), and an output's error with it: over 12 seeds the portable path reached
    # 3.4-3.5e-6 at q_scale 12 with the compiler's loops and with AVX2 intrinsics alike (mean 2.2-2.4e-6).
    tol = 3e-2 if dtype == BF16 else tol * max(1.0, q_scale / 4)
    _check(cpp_kernel, dtype, dtype, [1, 33, 100, 500], q_scale=q_scale, tol=tol)


@pytest.mark.parametrize("dtype,tol", _SPANS)
@pytest.mark.parametrize("window", [1, 5, 16, 33, 600])
def test_span_window(cpp_kernel, dtype, tol, window):
    _check(cpp_kernel, dtype, dtype, [1, 3, 21, 50, 1000], window=window, tol=tol)


@pytest.mark.parametrize("dtype,tol", _SPANS)
@pytest.mark.parametrize("context_len", [300, 513, 1301, 4099])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_span_split_context(cpp_kernel, dtype, tol, context_len, head_dim):
    """Few sequences with long contexts on two threads: split-K states (bf16: in the paired lane order), merged."""
    torch.set_num_threads(2)
    _check(cpp_kernel, dtype, dtype, [context_len], head_dim=head_dim, num_kv_heads=1, tol=tol)
    _check(cpp_kernel, dtype, dtype, [context_len, 77], head_dim=head_dim, num_kv_heads=3, window=1000, tol=tol)


@pytest.mark.parametrize("q_dtype", [BF16, F16])
def test_fp32_cache_other_queries(cpp_kernel, q_dtype):
    """An fp32 cache with a 16-bit query (widened and scaled into the fp32 span)."""
    _check(cpp_kernel, q_dtype, F32, [1, 17, 100], tol=1e-2)  # 16-bit output rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_threads_agree(cpp_kernel, dtype):
    """The result does not depend on the thread count (work splits, not math, change)."""
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(3, 200, 16, 64, generator=gen).to(dtype)
    v_cache = torch.randn(3, 200, 16, 64, generator=gen).to(dtype)
    q = torch.randn(24, 9, 64, generator=gen).to(dtype)
    block_tables = torch.randperm(200, generator=gen)[:192].view(24, 8)
    lens = torch.randint(1, 129, (24,), generator=gen)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(cpp_kernel.paged_decode(q, k_cache, v_cache, block_tables, lens, 0.125, 0))
    assert torch.equal(outs[0], outs[1])


def test_large_group(cpp_kernel):
    _check(cpp_kernel, BF16, BF16, [90, 31], group=8, num_kv_heads=1, tol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy(cpp_kernel, kv_dtype):
    """The step's K/V rows land where write_kv puts them, converted to the cache dtype."""
    from executor_svc.attention.torch_backend import write_kv
    from executor_svc.kv.cache import LayerKV

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 + 2 * 2, 16, generator=gen)  # strided K/V views, as the model passes them
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.tensor([0, 7, 33, 12, 25])
    caches = [torch.zeros(2, 7, 5, 16, dtype=kv_dtype) for _ in range(4)]
    cpp_kernel.store_kv(k, v, caches[0], caches[1], slots)
    write_kv(k, v, LayerKV(caches[2], caches[3]), slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="out of range"):
        cpp_kernel.store_kv(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 35]))
