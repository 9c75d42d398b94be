"""Paged attention backends against dense attention on contiguous K/V."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from executor_svc.attention import get_backend
from executor_svc.kv.cache import LayerKV, dequantize_rows, quantize_rows
from executor_svc.runner.step_batch import SequenceState, build_step_batch
from pagoda.params import SamplingParams

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def _dense(q, k, v, q_pos, window, softcap=None):
    """Reference: q [n, H, Dh] at positions q_pos over k, v [ctx, KVH, Dh]; scores soft-capped when asked."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(HEAD_DIM)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(k.shape[0])
    visible = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def _as_stored(rows, dtype, kv_dtype):
    """What a cache of ``kv_dtype`` holds for rows [n, KVH, Dh] (as fp32), for a model of ``dtype``."""
    if kv_dtype != torch.int8:
        return rows.to(dtype).to(kv_dtype).float()
    quantized, scale = quantize_rows(rows.to(dtype))
    return dequantize_rows(quantized, scale, torch.float32)


def _random_cache(gen, num_blocks, block_size, kv_dtype, device) -> LayerKV:
    """K and V [KVH, NB, BS, Dh] of random rows (int8: quantized, with their scales)."""
    rows = torch.randn(2, NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM, generator=gen)
    if kv_dtype != torch.int8:
        cache = rows.to(kv_dtype).to(device)
        return LayerKV(cache[0], cache[1])
    quantized, scale = (t.to(device) for t in quantize_rows(rows))
    return LayerKV(quantized[0], quantized[1], scale[0], scale[1])


def _store_prefix(cache: LayerKV, table, k, v, num_cached, block_size, dtype) -> None:
    """Rows [0, num_cached) of k, v [n, KVH, Dh] into their blocks, as the write path of a step before did."""
    for pos in range(num_cached):
        block, offset = table[pos // block_size], pos % block_size
        for rows, dest, dest_scale in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            if dest_scale is None:
                dest[:, block, offset] = rows[pos].to(dtype).to(dest.dtype)
            else:
                quantized, scale = quantize_rows(rows[pos].to(dtype))
                dest[:, block, offset], dest_scale[:, block, offset] = quantized, scale


def _run_case(
    backend_name, device, block_size, seqs, window, dtype=torch.float32, softcap=None, kv_dtype=None, stored=True
):
    """seqs: list of (num_cached, num_scheduled). Returns max abs error vs dense attention over what the cache
    stores (``stored``), or over the fp32 K/V themselves (an int8 cache's round trip)."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(block_size * 7 + len(seqs))
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    cache = _random_cache(gen, num_blocks, block_size, kv_dtype, device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    states, full_k, full_v = [], [], []
    for i, (cached, n) in enumerate(seqs):
        nb = -(-(cached + n) // block_size)
        table, perm = perm[:nb], perm[nb:]
        states.append((SequenceState(i, "", [0] * (cached + n), 0, SamplingParams(), table, cached), n))
        k = torch.randn(cached + n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(cached + n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        _store_prefix(cache, table, k, v, cached, block_size, dtype)  # the cached prefix already lives in its blocks
        full_k.append(k)
        full_v.append(v)
    batch = build_step_batch(states, block_size, torch.device(device), window)
    order = [s.seq_id for s, _ in _ordered(states)]
    q_rows, k_rows, v_rows, refs = [], [], [], []
    for i in order:
        cached, n = seqs[i]
        q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen) * (1 if softcap is None else 4)  # scores the cap bends
        q_rows.append(q)
        k_rows.append(full_k[i][cached:])
        v_rows.append(full_v[i][cached:])
        keys, values = (_as_stored(x, dtype, kv_dtype) if stored else x for x in (full_k[i], full_v[i]))
        refs.append(_dense(q, keys, values, torch.arange(cached, cached + n), window, softcap))
    backend = get_backend(backend_name, torch.device(device), dtype)
    state = backend.prepare(batch.attn_meta.for_layers(window, softcap))
    to = dict(device=device, dtype=dtype)
    out = backend.forward(
        torch.cat(q_rows).to(**to),
        torch.cat(k_rows).to(**to),
        torch.cat(v_rows).to(**to),
        cache,
        state,
        HEAD_DIM**-0.5,
    )
    ref = torch.cat(refs).reshape(out.shape)
    return (out.double().cpu() - ref).abs().max().item()


def _ordered(states):
    """The runner's layout: decode sequences by context length, then prefills."""
    decodes = sorted((e for e in states if e[1] == 1), key=lambda e: e[0].num_computed_tokens)
    return decodes + [e for e in states if e[1] != 1]


CASES = {
    "decode_only": [(0, 1), (9, 1), (30, 1), (4, 1)],
    "prefill_only": [(0, 13), (0, 1 + 16), (0, 5)],
    "mixed_with_cached": [(17, 1), (0, 11), (5, 9), (33, 1), (16, 3), (2, 1)],
    # Enough decodes to be split into several length groups.
    "many_decodes": [((i * 37) % 41, 1) for i in range(26)] + [(3, 6)],
}


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 4])
def test_torch_backend_matches_dense(block_size, case, window):
    assert _run_case("torch", "cpu", block_size, CASES[case], window) < 1e-5


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 4])
def test_cpp_backend_matches_dense(cpp_kernel, block_size, case, window):
    assert _run_case("cpp", "cpu", block_size, CASES[case], window) < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 4])
def test_softcap_on_torch_and_cpp_backends(cpp_kernel, case, window):
    """Soft-capped scores (Gemma 2) on the torch decode, the capped SDPA fallback and the C++ decode kernel."""
    for backend in ("torch", "cpp"):
        assert _run_case(backend, "cpu", 5, CASES[case], window, softcap=2.0) < 1e-5, backend


# Past TOKEN_ROWS_MAX_CONTEXT: chunks of a context of 530 and 720 tokens beside short ones and decodes.
LONG_AND_SHORT = [(600, 1), (0, 530), (3, 6), (700, 20), (9, 1), (40, 12)]


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_cpp_backend_short_chunks_as_rows_long_ones_through_sdpa(cpp_kernel, kv_dtype, monkeypatch):
    """Without a prefill kernel (fp32 here): chunks of a short context run the decode kernel row by row, long ones
    SDPA, in one step; every row is dense attention's, wherever it sits in the step."""
    from executor_svc.attention import cpp_backend

    calls = []
    real_run = cpp_backend.SdpaPrefill.run
    monkeypatch.setattr(cpp_backend.SdpaPrefill, "run", lambda self, *a: calls.append(self.spans) or real_run(self, *a))
    assert _run_case("cpp", "cpu", 16, LONG_AND_SHORT, None, kv_dtype=kv_dtype) < 1e-5
    assert [[(s.num_cached_tokens, s.num_query_tokens) for s in spans] for spans in calls] == [[(0, 530), (700, 20)]]
    calls.clear()
    monkeypatch.setattr(cpp_backend, "TOKEN_ROWS_MAX_CONTEXT", 0)  # every chunk through SDPA: the same rows
    assert _run_case("cpp", "cpu", 16, LONG_AND_SHORT, None, kv_dtype=kv_dtype) < 1e-5
    assert len(calls[0]) == 4


def test_cpp_backend_bf16_close_to_dense(cpp_kernel):
    assert _run_case("cpp", "cpu", 16, CASES["many_decodes"], None, dtype=torch.bfloat16) < 5e-2


@pytest.mark.parametrize("block_size", [16, 32])
def test_cpp_backend_bf16_prefill_close_to_dense(cpp_kernel, block_size, monkeypatch):
    """head_dim 64: bf16 prefill chunks (with cached prefixes) take the AMX kernel where the CPU has AMX."""
    monkeypatch.setattr(sys.modules[__name__], "HEAD_DIM", 64)
    assert _run_case("cpp", "cpu", block_size, CASES["mixed_with_cached"], None, dtype=torch.bfloat16) < 5e-2


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 4])
def test_int8_cache_matches_dense_over_its_rows(request, backend, block_size, case, window):
    """An int8 cache: the step's rows quantized by the write path, every backend attending over the stored
    rows (the C++ kernels apply the scales inside; torch and SDPA dequantize what they gather)."""
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    assert _run_case(backend, "cpu", block_size, CASES[case], window, kv_dtype=torch.int8) < 1e-5
    assert _run_case(backend, "cpu", block_size, CASES[case], window, softcap=2.0, kv_dtype=torch.int8) < 1e-5


# The KV round trip: attention over an int8 cache against fp32 attention over the fp32 K/V themselves, on
# decode, prefill and cached-prefix chunks. Stated tolerance: 0.03 absolute for unit-normal K/V (outputs of
# size ~1), 0.04 for a bf16 model; a bf16 cache errs by about half as much on the same cases.
ROUND_TRIP_TOLERANCE = {torch.float32: 0.03, torch.bfloat16: 0.04}


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_cache_round_trip_against_fp32(request, backend, case):
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    for block_size in (5, 16):
        error = _run_case(backend, "cpu", block_size, CASES[case], None, kv_dtype=torch.int8, stored=False)
        assert error < ROUND_TRIP_TOLERANCE[torch.float32], (block_size, error)
        # A real round trip: quantization does change the result (the test would see the rows stored unchanged).
        assert error > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_cache_round_trip_bf16_model_amx_prefill(cpp_kernel, case, monkeypatch):
    """head_dim 64, bf16 model: decode in the C++ kernel, prefill chunks in the AMX kernel where the CPU has it."""
    monkeypatch.setattr(sys.modules[__name__], "HEAD_DIM", 64)
    common = dict(dtype=torch.bfloat16, kv_dtype=torch.int8)
    assert _run_case("cpp", "cpu", 64, CASES[case], None, **common) < 5e-2  # over the stored rows, bf16 rounding
    error = _run_case("cpp", "cpu", 64, CASES[case], None, stored=False, **common)
    assert error < ROUND_TRIP_TOLERANCE[torch.bfloat16], error


def test_torch_backend_bf16_cache_close_to_dense():
    assert _run_case("torch", "cpu", 5, CASES["mixed_with_cached"], None, dtype=torch.bfloat16) < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_triton_backend_matches_dense(block_size, case, window, softcap, kv_dtype):
    assert _run_case("triton", "cuda", block_size, CASES[case], window, softcap=softcap, kv_dtype=kv_dtype) < 1e-3


_INTERPRETED_CHECK = """
import sys, torch
sys.path.insert(0, ".")
import tests.executor.test_attention_paged as T
from executor_svc.attention.triton_backend import TritonAttentionBackend
T.get_backend = lambda name, device, dtype: TritonAttentionBackend(dtype)
for bs in (1, 5, 16):
    for case in sorted(T.CASES):
        for window in (None, 4):
            for softcap in (None, 2.0):
                error = T._run_case("triton", "cpu", bs, T.CASES[case], window, softcap=softcap)
                assert error < 1e-5, (bs, case, window, softcap)
                # An int8 cache: the kernel applies the scales as it loads the rows.
                error = T._run_case("triton", "cpu", bs, T.CASES[case], window, softcap=softcap, kv_dtype=torch.int8)
                assert error < 1e-5, ("int8", bs, case, window, softcap)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_triton_kernel_interpreted_on_cpu_matches_dense():
    """The Triton kernel's logic (bf16/fp32 and int8 caches), run by Triton's CPU interpreter (no GPU needed)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_backend_selection_errors_are_clear():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        get_backend("triton", torch.device("cpu"), torch.float32)
    assert get_backend("torch", torch.device("cpu"), torch.float32).name == "torch"
