"""The int8 KV cache at the kernel level: the quantization, its write path (C++ and torch, the same bits),
and the decode and AMX prefill kernels reading int8 rows with their scales.

The kernels are held to the exact attention over the *dequantized* cache (their arithmetic: as tight as
for a bf16 or fp32 cache); what quantization itself costs against fp32 K/V is the round trip in
test_attention_paged.py (and, end to end, the perplexity in docs/quantization.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.attention.torch_backend import write_kv
from executor_svc.kv.cache import LayerKV, dequantize_rows, quantize_rows
from tests.executor.conftest import native_ops
from tests.executor.test_cpu_prefill import _reference

F32, BF16 = torch.float32, torch.bfloat16


def _random_int8_cache(gen, num_kv_heads, num_blocks, block_size, head_dim):
    """K and V rows quantized from random values (scales of real rows, a few rows of zeros)."""
    parts = []
    for _ in range(2):
        rows = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
        rows *= torch.rand(num_kv_heads, num_blocks, block_size, 1, generator=gen) * 4  # rows of unequal size
        rows[:, 0, 0] = 0.0
        parts.extend(quantize_rows(rows))
    k, k_scale, v, v_scale = parts
    return LayerKV(k, v, k_scale, v_scale)


def test_quantize_rows_bounds_and_error():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(300, 3, 64, generator=gen) * torch.logspace(-6, 3, 300)[:, None, None]
    rows[7, 1] = 0.0
    q, scale = quantize_rows(rows)
    assert q.dtype == torch.int8 and scale.dtype == F32 and scale.shape == (300, 3)
    assert q.abs().max().item() == 127 and (q == -128).sum().item() == 0
    assert torch.equal(q.abs().amax(-1)[scale > 0], torch.full_like(q[..., 0][scale > 0], 127))  # max maps to 127
    assert scale[7, 1].item() == 0.0 and not q[7, 1].any()
    error = (dequantize_rows(q, scale, F32) - rows).abs()
    assert (error <= scale.unsqueeze(-1) * 0.5001).all()  # half a step of the row's own scale


@pytest.mark.parametrize("source", [F32, BF16])
def test_store_kv_int8_is_bit_identical_to_write_kv(cpp_kernel, source):
    """The C++ store and the torch write (CUDA, the torch backend) quantize to the same bits and scales."""
    gen = torch.Generator().manual_seed(5)
    num_tokens = 4000  # enough rows that some products land next to a rounding tie
    qkv = (torch.randn(num_tokens, 6 + 2 * 3, 64, generator=gen) * 3).to(source)  # strided K/V views
    k, v = qkv[:, 6:9], qkv[:, 9:]
    slots = torch.randperm(200 * 32, generator=gen)[:num_tokens]
    caches = []
    for _ in range(2):
        rows = torch.zeros(2, 3, 200, 32, 64, dtype=torch.int8)
        scales = torch.full((2, 3, 200, 32), -1.0)
        caches.append(LayerKV(rows[0], rows[1], scales[0], scales[1]))
    cpp_kernel.store_kv(k, v, caches[0].k, caches[0].v, slots, caches[0].k_scale, caches[0].v_scale)
    write_kv(k, v, caches[1], slots)
    for mine, theirs in zip(vars(caches[0]).values(), vars(caches[1]).values()):
        assert torch.equal(mine, theirs)
    written = torch.zeros(200 * 32, dtype=torch.bool)
    written[slots] = True
    assert (caches[0].k_scale.view(3, -1)[:, ~written] == -1.0).all()  # other slots untouched


def test_store_kv_int8_rejects_missing_or_bad_scales(cpp_kernel):
    k = v = torch.randn(2, 3, 64)
    cache = torch.zeros(3, 4, 16, 64, dtype=torch.int8)
    scales = torch.zeros(3, 4, 16)
    slots = torch.tensor([0, 5])
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        cpp_kernel.store_kv(k, v, cache, cache.clone(), slots)
    with pytest.raises(RuntimeError, match="fp32 \\[KVH, NB, BS\\]"):
        cpp_kernel.store_kv(k, v, cache, cache.clone(), slots, scales.double(), scales.double())
    with pytest.raises(RuntimeError, match="fp32 \\[KVH, NB, BS\\]"):
        cpp_kernel.store_kv(k, v, cache, cache.clone(), slots, scales[:, :2], scales[:, :2])
    with pytest.raises(RuntimeError, match="only for an int8 KV cache"):
        cpp_kernel.store_kv(k, v, cache.float(), cache.float(), slots, scales, scales.clone())
    with pytest.raises(RuntimeError, match="out of range"):
        cpp_kernel.store_kv(k, v, cache, cache.clone(), torch.tensor([0, 64]), scales, scales.clone())


def _dense(q, cache: LayerKV, block_table, context_len, window, softcap):
    """q [H, D] over the dequantized cache, float64 -> [H, D]."""
    num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = cache.k.shape
    positions = torch.arange(max(0, context_len - window) if window else 0, context_len)
    blocks, offsets = block_table[positions // block_size], positions % block_size
    group = num_heads // num_kv_heads
    k = dequantize_rows(cache.k[:, blocks, offsets], cache.k_scale[:, blocks, offsets], torch.float64)
    v = dequantize_rows(cache.v[:, blocks, offsets], cache.v_scale[:, blocks, offsets], torch.float64)
    scores = torch.einsum("hd,hld->hl", q.double(), k.repeat_interleave(group, 0)) / math.sqrt(head_dim)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hl,hld->hd", scores.softmax(-1), v.repeat_interleave(group, 0))


def _check_decode(kernel, q_dtype, context_lens, *, head_dim=64, block_size=16, window=0, group=3, softcap=0.0):
    gen = torch.Generator().manual_seed(head_dim * 31 + block_size + len(context_lens) + window)
    num_kv_heads = 2
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = len(context_lens) * max_blocks + 5
    cache = _random_int8_cache(gen, num_kv_heads, num_blocks, block_size, head_dim)
    q = torch.randn(len(context_lens), group * num_kv_heads, head_dim, generator=gen) * (4 if softcap else 1)
    q = q.to(q_dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks].view(-1, max_blocks)
    lens = torch.tensor(context_lens, dtype=torch.long)
    scale = 1 / math.sqrt(head_dim)
    out = kernel.paged_decode(q, cache.k, cache.v, tables, lens, scale, window, softcap, cache.k_scale, cache.v_scale)
    assert out.dtype == q_dtype and out.shape == q.shape
    # fp32: the kernel rounds each query, and each 16-row tile's softmax weights, to int16 (relative 2^-15) for
    # integer dot products with the int8 rows (measured up to 7e-4 here); bf16: the output's rounding.
    tol = 2e-3 if q_dtype == F32 else 2e-2
    for i, context_len in enumerate(context_lens):
        ref = _dense(q[i], cache, tables[i], context_len, window, softcap)
        assert (out[i].double() - ref).abs().max().item() < tol, (i, context_len)


@pytest.mark.parametrize("head_dim", [16, 24, 32, 64, 128])  # 24: the portable loops; the rest intrinsics
@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
def test_decode_reads_int8_rows_with_their_scales(cpp_kernel, head_dim, block_size):
    _check_decode(cpp_kernel, F32, [1, 15, 16, 17, 40, 77, 130], head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_int8_with_bf16_queries(cpp_kernel, head_dim):
    _check_decode(cpp_kernel, BF16, [3, 16, 33, 100], head_dim=head_dim, block_size=64)


def test_decode_int8_split_k_windows_softcap_and_groups(cpp_kernel):
    _check_decode(cpp_kernel, F32, [1500, 700], block_size=64)  # few items: the context splits across threads
    _check_decode(cpp_kernel, F32, [3, 21, 50, 1000], block_size=64, window=20)  # tiles that straddle blocks
    _check_decode(cpp_kernel, F32, [3, 21, 50, 1000], block_size=5, window=600)
    _check_decode(cpp_kernel, F32, [9, 90, 300], softcap=2.0)
    _check_decode(cpp_kernel, F32, [90, 31], group=8)


def test_decode_int8_refuses_a_cache_without_scales(cpp_kernel):
    cache = torch.zeros(2, 4, 16, 64, dtype=torch.int8)
    q, tables, lens = torch.randn(1, 6, 64), torch.tensor([[0, 1]]), torch.tensor([20])
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        cpp_kernel.paged_decode(q, cache, cache, tables, lens, 0.125, 0)


@pytest.fixture(scope="module")
def prefill(cpp_kernel):
    return native_ops("bf16", "needs AMX (and a kernel that grants it) or AVX512-BF16")


@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "spans", "window", "softcap"),
    [
        ((9, 3), 64, 64, [(1, 0), (17, 0), (50, 37), (16, 16), (40, 300)], 0, 0.0),  # cached prefixes
        ((9, 3), 64, 16, [(100, 0), (33, 5)], 0, 0.0),
        ((8, 2), 128, 32, [(40, 3)], 0, 0.0),
        ((8, 4), 256, 16, [(45, 30), (64, 0)], 20, 1.5),  # Gemma 2's sliding, capped layers
        ((9, 3), 64, 64, [(50, 0), (17, 37), (5, 200)], 24, 0.0),
    ],
)
def test_prefill_reads_int8_rows_with_their_scales(prefill, heads, head_dim, block_size, spans, window, softcap):
    gen = torch.Generator().manual_seed(sum(n + c for n, c in spans) + head_dim)
    num_heads, num_kv_heads = heads
    blocks_per = [-(-(n + c) // block_size) for n, c in spans]
    num_blocks = sum(blocks_per) + 3
    perm, used = torch.randperm(num_blocks, generator=gen), 0
    tables = torch.zeros(len(spans), max(blocks_per), dtype=torch.int64)
    for i, count in enumerate(blocks_per):
        tables[i, :count], used = perm[used : used + count], used + count
    cache = _random_int8_cache(gen, num_kv_heads, num_blocks, block_size, head_dim)
    q = (torch.randn(sum(n for n, _ in spans), num_heads + 2 * num_kv_heads, head_dim, generator=gen) * 2).bfloat16()
    q = q[:, :num_heads]  # strided rows, as the model passes them
    starts = [sum(n for n, _ in spans[:i]) for i in range(len(spans))]
    rows = torch.tensor([(start, n, c, i) for i, (start, (n, c)) in enumerate(zip(starts, spans))])
    out = torch.full(q.shape, 7.0, dtype=BF16)
    scale = head_dim**-0.5
    prefill.paged_prefill(q, cache.k, cache.v, tables, rows, scale, out, window, softcap, cache.k_scale, cache.v_scale)
    k_rows, v_rows = dequantize_rows(cache.k, cache.k_scale, F32), dequantize_rows(cache.v, cache.v_scale, F32)
    expected = _reference(q, k_rows, v_rows, tables, rows, scale, window, softcap)
    error = (out.double() - expected).abs().max().item()
    # P is rounded to bf16 before P.V and the output to bf16, as for a bf16 cache (the integers are exact in
    # bf16); these V rows reach ~16, and 0.005 of that is about a bf16 step of the largest outputs.
    assert error < 5e-3 * v_rows.abs().max().item()


def test_prefill_int8_checks_its_scales(prefill):
    cache = torch.zeros(3, 4, 16, 64, dtype=torch.int8)
    q, out = torch.zeros(5, 9, 64, dtype=BF16), torch.zeros(5, 9, 64, dtype=BF16)
    tables, rows = torch.tensor([[0, 1]]), torch.tensor([[0, 5, 0, 0]])
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        prefill.paged_prefill(q, cache, cache, tables, rows, 0.125, out)
    bad = torch.zeros(3, 4, 8)
    with pytest.raises(RuntimeError, match="fp32 \\[KVH, NB, BS\\]"):
        prefill.paged_prefill(q, cache, cache, tables, rows, 0.125, out, 0, 0.0, bad, bad)
