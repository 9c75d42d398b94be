"""Batch invariance of the CPU kernels: a row's bits must not depend on the other rows of its step.

For every GEMM path this build has, a fixed set of rows is placed at random
positions of batches of random size M (1..300) and each of its output rows is
compared bit for bit (``torch.equal``) with the same row computed alone
(M = 1). The same holds the per-row ops (RMSNorm, rotary, SiLU-and-multiply,
argmax, activation and KV quantization) and, for attention, a query at
position p over keys 0..p: decode alone vs. decode in a batch, decode vs. a
row of a prefill chunk, and prefill rows at different chunk sizes.

Paths that vary today are marked ``xfail(strict=True)`` with the cause, so
they flip to failures (to be unmarked) when fixed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from executor_svc.kv.cache import LayerKV, quantize_rows
from executor_svc.quant import gguf_blocks, int8
from tests.executor.conftest import native_ops

# Batch sizes: every micro-kernel tail (6-row blocks, 16-row tiles, 32-row AMX blocks, 96-row items), the
# int8 widening threshold (128), and random ones, 1..300.
M_VALUES = sorted({1, 2, 5, 6, 7, 16, 17, 33, 64, 65, 97, 128, 129, 300, *random.Random(36).sample(range(1, 301), 6)})
NUM_PROBES = 3  # fixed rows placed in every batch
# SmolLM2-135M's matmuls (in, out), a deep one (K blocking shows past a few thousand), panel and depth tails.
SHAPES = [(576, 192), (1536, 576), (4096, 256), (200, 100)]


def _mismatches(fn: Callable[[torch.Tensor], torch.Tensor], probes: torch.Tensor, seed: int) -> list[tuple[int, int]]:
    """(M, probe) pairs where fn's row of a probe inside a batch of M rows differs from fn(probe alone)."""
    gen = torch.Generator().manual_seed(seed)
    alone = [fn(probes[i : i + 1])[0] for i in range(len(probes))]
    bad = []
    for m in M_VALUES:
        batch = (torch.randn(m, probes.shape[1], generator=gen) * 2).to(probes.dtype)
        count = min(m, len(probes))
        where = torch.randperm(m, generator=gen)[:count]
        batch[where] = probes[:count]
        out = fn(batch)
        bad += [(m, i) for i in range(count) if not torch.equal(out[where[i]], alone[i])]
    return bad


def _probes(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_PROBES, k, generator=gen) * torch.rand(NUM_PROBES, 1, generator=gen) * 4).to(dtype)


def _weight(k: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k**-0.5


# --- GEMMs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_fp32_panel_gemm_rows_do_not_depend_on_the_batch(k, n):
    """avx512-panel / avx2-panel: one fp32 FMA chain over k per output, whatever micro-kernel height (1-6),
    column slice (AVX2: 64, 32 or 16 columns by height) or 96-row item."""
    ops = native_ops("f32_panels", "the fp32 panel GEMM needs AVX-512 or AVX2 + FMA")
    w, bias = _weight(k, n, k + n), torch.randn(n)
    packed = ops.pack_f32(w)
    assert _mismatches(lambda x: ops.linear_f32(x, packed, n, bias), _probes(k, torch.float32, n), n) == []


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_bf16_panel_gemm_rows_do_not_depend_on_the_batch(k, n):
    """avx512bf16-panel (vdpbf16ps over k-pairs in order, 6 x 4 blocks) or amx-panel (tile products over
    32-k chunks in order, the 64-row decode pass and the 32-row prefill blocks alike)."""
    ops = native_ops("bf16", "the bf16 panel GEMM needs AMX or AVX512-BF16")
    w, bias = _weight(k, n, k * n).bfloat16(), torch.randn(n).bfloat16()
    packed = ops.pack_bf16(w)
    assert _mismatches(lambda x: ops.linear_bf16(x, packed, n, bias), _probes(k, torch.bfloat16, k), n) == []


def _int8_ops(vnni: bool = True):
    """The kernels' ops for the int8 path: the vector one (vnni: AVX512-VNNI, or AVX2 without it) or AMX-INT8,
    skipping where the build lacks it."""
    ops = native_ops("f32_panels", "the int8 GEMMs need AVX-512 or AVX2 + FMA")
    if vnni and not {"avx512_vnni", "avx2_int8"} & set(ops.cpu_features()):
        pytest.skip("the vector int8 path needs AVX512-VNNI or AVX2 in the kernel build")
    if not vnni and not ("amx_int8" in ops.cpu_features() and ops.amx_int8_ready()):
        pytest.skip("the AMX-INT8 path needs AMX-INT8 (CPU, kernel build and Linux permission)")
    return ops


INT8_PATHS = pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "amx"])


@INT8_PATHS
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_gemm_rows_do_not_depend_on_the_batch_at_one_activation_kind(vnni, k, n, dtype):
    """int8 activations at every M (widen_above = ALWAYS): per-row quantization, exact int32 group products,
    group scales added in group order per row; threads split panels only."""
    ops = _int8_ops(vnni)
    wq, ws = int8.quantize_per_channel(_weight(k, n, 3 * n))
    packed = ops.pack_int8(wq)
    bias = torch.randn(n).to(dtype)
    gemm = lambda x: ops.linear_int8(x, packed, ws, n, bias, vnni, int8.ALWAYS)  # noqa: E731
    assert _mismatches(gemm, _probes(k, dtype, n), n) == []


@INT8_PATHS
def test_int8_fused_gate_up_rows_do_not_depend_on_the_batch(vnni):
    ops = _int8_ops(vnni)
    if "avx512_bf16" not in ops.cpu_features():
        pytest.skip("the fused gate/up kernel needs AVX512-BF16")
    wq, ws = int8.quantize_per_channel(_weight(576, 2 * 1536, 5))
    packed = ops.pack_int8(wq)
    gemm = lambda x: ops.linear_int8_silu(x, packed, ws, 2 * 1536, vnni, int8.ALWAYS)  # noqa: E731
    assert _mismatches(gemm, _probes(576, torch.bfloat16, 9), 9) == []


@INT8_PATHS
def test_int8_widening_past_128_rows_changes_a_rows_bits_on_amx_only(vnni):
    """The auto mode on AMX: int8 activations up to 128 rows, x rounded to bf16 past them (VNNI ignores the
    threshold). Batch-invariant executors therefore keep one activation kind at every M."""
    ops = _int8_ops(vnni)
    wq, ws = int8.quantize_per_channel(_weight(576, 192, 11))
    packed = ops.pack_int8(wq)
    gemm = lambda x: ops.linear_int8(x, packed, ws, 192, None, vnni, int8.WIDEN_ABOVE_ROWS)  # noqa: E731
    varying = {m for m, _ in _mismatches(gemm, _probes(576, torch.bfloat16, 11), 11)}
    assert varying == (set() if vnni else {m for m in M_VALUES if m > int8.WIDEN_ABOVE_ROWS})


@pytest.mark.parametrize("widen_above", [int8.ALWAYS, 0, gguf_blocks.WIDEN_ABOVE_ROWS])
def test_gguf_q8_0_rows_do_not_depend_on_the_batch_at_one_activation_kind(widen_above):
    """GGUF blocks on VNNI: int8 activations per 32 (ALWAYS), or bf16 dot products (0) at every M; the auto
    threshold (16 rows) switches kinds, so it changes a row's bits for M > 16."""
    ops = _int8_ops()  # the vector path's build: the GGUF block kernels too
    if widen_above != int8.ALWAYS and "avx512_bf16" not in ops.cpu_features() and not ops.amx_ready():
        pytest.skip("widened GGUF blocks need AVX512-BF16 or AMX")
    weight = gguf_blocks.quantize_blocks(_weight(576, 192, 13), gguf_blocks.Q.Q8_0)
    layer = gguf_blocks.block_linear(weight, ops, widen_above)
    bad = _mismatches(lambda x: layer(x), _probes(576, torch.bfloat16, 13), 13)
    if widen_above == gguf_blocks.WIDEN_ABOVE_ROWS:
        assert {m for m, _ in bad} == {m for m in M_VALUES if m > widen_above}
    else:
        assert bad == []


def test_panel_and_int8_gemms_do_not_depend_on_the_thread_count():
    """Threads split output panels, never K: 1 thread and this process's count give the same bits."""
    ops = native_ops("f32_panels", "the panel GEMMs need AVX-512 or AVX2 + FMA")
    k, n = 1536, 576
    x = _probes(k, torch.float32, 43).repeat(22, 1)  # 66 rows
    w = _weight(k, n, 43)
    gemms = [lambda: ops.linear_f32(x, ops.pack_f32(w), n, None)]
    if ops.bf16_kernels_ready():
        gemms.append(lambda: ops.linear_bf16(x.bfloat16(), ops.pack_bf16(w.bfloat16()), n, None))
    if {"avx512_vnni", "avx2_int8"} & set(ops.cpu_features()):
        wq, ws = int8.quantize_per_channel(w)
        gemms.append(lambda: ops.linear_int8(x.bfloat16(), ops.pack_int8(wq), ws, n, None, True, int8.ALWAYS))
    threads = torch.get_num_threads()
    try:
        many = [gemm() for gemm in gemms]
        torch.set_num_threads(1)
        assert all(torch.equal(gemm(), out) for gemm, out in zip(gemms, many))
    finally:
        torch.set_num_threads(threads)


def _amx_cpu() -> bool:
    """Whether the CPU reports AMX-BF16 (what oneDNN's bf16 GEMM then runs on)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return "amx_bf16" in cpuinfo.read()
    except OSError:
        return False


@pytest.mark.xfail(
    condition=not _amx_cpu(),
    strict=True,
    reason="oneDNN's bf16 GEMM without AMX blocks K by M at depth 4096 (M >= 5 on Zen 4); on a Xeon with AMX it "
    "gave the same bits at every M",
)
def test_onednn_bf16_linear_rows_do_not_depend_on_the_batch():
    """The bf16 fallback of CppLayerOps on CPUs without AMX or AVX512-BF16 (mkldnn._linear_pointwise). On Zen 4
    it happens to be invariant at SmolLM2's depths (576, 1536), not at 4096. Measured behaviour, not a contract:
    batch-invariant layer ops never run it."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    w = _weight(4096, 256, 17).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    gemm = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    assert _mismatches(gemm, _probes(4096, torch.bfloat16, 17), 17) == []


@pytest.mark.xfail(strict=True, reason="MKL's sgemm changes its kernel with M (every M >= 2 at every depth)")
def test_torch_fp32_linear_rows_do_not_depend_on_the_batch():
    """F.linear in fp32: the torch layer ops, and the torch-int8 path's dequantized matmul."""
    w = _weight(576, 192, 19)
    assert _mismatches(lambda x: F.linear(x, w), _probes(576, torch.float32, 19), 19) == []


# --- per-row ops -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_row_ops_do_not_depend_on_the_batch(cpp_kernel, dtype):
    ops = cpp_kernel
    hidden, weight = 576, (torch.rand(576) + 0.5).to(dtype)
    probes = _probes(hidden, dtype, 23)
    assert _mismatches(lambda x: ops.rms_norm(x, weight, 1e-5), probes, 1) == []
    residual_of = lambda x: (x * 0.5 + 1).to(dtype)  # noqa: E731
    assert _mismatches(lambda x: ops.add_rms_norm(x, residual_of(x), weight, 1e-5), probes, 2) == []
    assert _mismatches(lambda x: ops.silu_and_mul(x.contiguous()), _probes(2 * 1536, dtype, 3), 3) == []
    logits = _probes(49152, dtype, 4)
    assert _mismatches(lambda x: ops.argmax_rows(x)[:, None], logits, 4) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_rows_do_not_depend_on_the_batch(cpp_kernel, dtype):
    """rotary_ on [T, 9 heads, 64]; a row's position travels with it (the probe's own position)."""
    cos = torch.rand(512, 32).to(dtype)
    sin = torch.rand(512, 32).to(dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.clone().view(x.shape[0], 9, 64)
        positions = (x[:, 0].float().abs() * 100).long() % 512  # derived from the row itself
        cpp_kernel.rotary_(heads, positions, cos, sin)
        return heads.view(x.shape[0], -1)

    assert _mismatches(rotate, _probes(9 * 64, dtype, 29), 29) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_and_kv_quantization_rows_do_not_depend_on_the_batch(cpp_kernel, dtype):
    def quantized(x: torch.Tensor) -> torch.Tensor:
        q, scale, sums = cpp_kernel.quantize_rows_int8(x, 64)
        m = x.shape[0]
        return torch.cat([q[:m].float(), scale[:m], sums[:m].float()], dim=1)

    assert _mismatches(quantized, _probes(576, dtype, 31), 31) == []

    def stored(x: torch.Tensor) -> torch.Tensor:  # store_kv into an int8 cache: rows and scales
        m = x.shape[0]
        rows = x.view(m, 3, 64)
        cache = torch.zeros(3, m, 1, 64, dtype=torch.int8)
        scales = torch.zeros(3, m, 1)
        cpp_kernel.store_kv(rows, rows, cache, cache.clone(), torch.arange(m), scales, scales.clone())
        return torch.cat([cache.permute(1, 0, 2, 3).reshape(m, -1).float(), scales.permute(1, 0, 2).reshape(m, -1)], 1)

    assert _mismatches(stored, _probes(3 * 64, dtype, 37), 37) == []


# --- attention ---------------------------------------------------------------------------------------------
# SmolLM2-135M's heads: 9 query heads over 3 KV heads of 64 dims, blocks of 16 positions. One sequence of
# CONTEXT positions in shuffled blocks; its query at position p attends to keys 0..p.
HEADS, KV_HEADS, HEAD_DIM, BLOCK, CONTEXT = 9, 3, 64, 16, 700
POSITIONS = [0, 15, 40, 299, 511, 600, 699]  # 512+: decode splits the KV axis when the batch is small


def _sequence(kv: str, seed: int = 41):
    """(q [CONTEXT, H, D] bf16, LayerKV cache, block table [1, MB]) with a bf16 or int8 cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-CONTEXT // BLOCK)
    table = torch.randperm(num_blocks + 4, generator=gen)[:num_blocks].view(1, -1)
    shape = (KV_HEADS, num_blocks + 4, BLOCK, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if kv == "int8":
        (kq, ks), (vq, vs) = quantize_rows(k), quantize_rows(v)
        cache = LayerKV(kq, vq, ks, vs)
    else:
        cache = LayerKV(k.bfloat16(), v.bfloat16())
    q = (torch.randn(CONTEXT, HEADS, HEAD_DIM, generator=gen) * 2).bfloat16()
    return q, cache, table


def _decode(ops, q, cache: LayerKV, table, positions: list[int]) -> torch.Tensor:
    """Decode rows: sequence copies (same table) at positions [B], all in one call -> [B, H, D]."""
    lens = torch.tensor([p + 1 for p in positions], dtype=torch.int64)
    tables = table.expand(len(positions), -1).contiguous()
    scales = (cache.k_scale, cache.v_scale)
    return ops.paged_decode(q[positions].contiguous(), cache.k, cache.v, tables, lens, HEAD_DIM**-0.5, 0, 0.0, *scales)


def _prefill(ops, q, cache: LayerKV, table, chunk: int) -> torch.Tensor:
    """Every position as a row of prefill chunks of ``chunk`` queries over their cached prefix -> [CONTEXT, H, D]."""
    out = torch.zeros_like(q)
    spans = [(start, min(chunk, CONTEXT - start), start, 0) for start in range(0, CONTEXT, chunk)]
    scales = (cache.k_scale, cache.v_scale)
    ops.paged_prefill(q, cache.k, cache.v, table, torch.tensor(spans), HEAD_DIM**-0.5, out, 0, 0.0, *scales)
    return out


@pytest.mark.parametrize("kv", ["bf16", "int8"])
@pytest.mark.xfail(
    strict=True,
    reason="cpu_kernel.cpp choose_splits: with fewer than 4 x threads (sequence, KV head) items and 512+ "
    "positions, decode splits the KV axis and merges the partial softmaxes, so a long sequence decoded "
    "alone rounds differently from the same sequence in a batch",
)
def test_decode_row_does_not_depend_on_the_batch(cpp_kernel, kv):
    """Every third position alone, beside one long sequence (which makes the call split), and in a batch of 32
    (which makes it not split)."""
    q, cache, table = _sequence(kv)
    bad = []
    for p in range(0, CONTEXT, 3):
        alone = _decode(cpp_kernel, q, cache, table, [p])[0]
        for others in ([CONTEXT - 1], [(p * 7 + 13 * i) % CONTEXT for i in range(31)]):
            if not torch.equal(_decode(cpp_kernel, q, cache, table, [p, *others])[0], alone):
                bad.append((p, len(others)))
    assert bad == []


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_prefill_row_does_not_depend_on_the_chunk_size(cpp_kernel, kv):
    """cpu_prefill.cpp: each query row walks the 32-key chunks from key 0 in order with its own running max
    (blocks of 16 query rows only add fully masked chunks, whose zero probabilities add nothing)."""
    ops = native_ops("bf16", "the prefill kernel needs AMX or AVX512-BF16")
    q, cache, table = _sequence(kv)
    whole = _prefill(ops, q, cache, table, CONTEXT)
    bad = [chunk for chunk in (1, 7, 16, 33, 100, 512) if not torch.equal(_prefill(ops, q, cache, table, chunk), whole)]
    assert bad == []


@pytest.mark.parametrize("kv", ["bf16", "int8"])
@pytest.mark.xfail(
    strict=True,
    reason="two algorithms: decode (cpu_kernel.cpp) keeps fp32 probabilities and V and 16-key tiles; prefill "
    "(cpu_prefill.cpp) 32-key chunks, P rounded to bf16 for P.V, a max that rescales only past kSlack",
)
def test_decode_row_equals_its_prefill_row(cpp_kernel, kv):
    ops = native_ops("bf16", "the prefill kernel needs AMX or AVX512-BF16")
    q, cache, table = _sequence(kv)
    prefill = _prefill(ops, q, cache, table, 64)
    bad = [p for p in POSITIONS if not torch.equal(_decode(cpp_kernel, q, cache, table, [p])[0], prefill[p])]
    assert bad == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.xfail(
    strict=True,
    reason="sdpa_prefill.py: torch's flash attention on the CPU blocks queries and keys by the chunk's length, "
    "and a chunk without a cached prefix attends with is_causal over its own rows, one with a prefix with a mask",
)
def test_sdpa_prefill_row_does_not_depend_on_the_chunk_size(dtype):
    """The SDPA fallback (fp32 models; bf16 where the prefill kernel cannot run)."""
    from executor_svc.attention.sdpa_prefill import _attend, _mask

    q, cache, table = _sequence("bf16")
    q = q.to(dtype)
    cache = LayerKV(cache.k.to(dtype), cache.v.to(dtype))
    keys, values = cache.rows(table[0], CONTEXT, dtype)  # [KVH, CONTEXT, D]

    def chunked(chunk: int) -> torch.Tensor:
        out = torch.zeros_like(q)
        for start in range(0, CONTEXT, chunk):
            n = min(chunk, CONTEXT - start)
            rows = slice(start, start + n)
            mask = None if start == 0 else _mask(start, n, None, q.device)
            k, v = keys[:, rows].transpose(0, 1), values[:, rows].transpose(0, 1)
            out[rows] = _attend(q[rows], k, v, cache, start + n, mask, table[0], HEAD_DIM**-0.5, None)
        return out

    whole = chunked(CONTEXT)
    assert [chunk for chunk in (16, 100, 512) if not torch.equal(chunked(chunk), whole)] == []
