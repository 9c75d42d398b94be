"""KV cache sizing and layout: the default block size, the --block-size and --kv-cache-dtype flags, the int8
cache's scales and how a block's tensors are enumerated."""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import load_config
from executor_svc.kv.cache import KVCache, KVCacheSpec, default_block_size, num_blocks_for_budget
from executor_svc.runner.device import resolve_kv_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("head_dim", "dtype", "expected"),
    [
        (64, torch.float32, 16),  # 4 KiB of K per kv head
        (64, torch.bfloat16, 32),
        (128, torch.bfloat16, 16),
        (128, torch.float32, 16),  # never below 16
        (32, torch.float32, 32),
        (8, torch.bfloat16, 128),  # capped
        (64, torch.int8, 64),
        (128, torch.int8, 32),
    ],
)
def test_cpu_blocks_hold_one_page_of_k_per_kv_head(head_dim, dtype, expected):
    assert default_block_size(CPU, head_dim, dtype) == expected


def test_cuda_blocks_stay_16_tokens():
    assert default_block_size(torch.device("cuda"), 64, torch.bfloat16) == 16


def test_block_size_flag_is_auto_by_default_and_rejects_negatives():
    assert load_config([]).block_size == 0
    assert load_config(["--block-size", "48"]).block_size == 48
    with pytest.raises((ValueError, SystemExit)):
        load_config(["--block-size", "-16"])


def test_kv_cache_dtype_names():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("int8", torch.bfloat16) == torch.int8
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    for bad in ("fp8", "int4", "float8_e4m3fn"):
        with pytest.raises(ValueError, match=f"unsupported KV cache dtype '{bad}'; use auto .* int8"):
            resolve_kv_dtype(bad, torch.bfloat16)


def test_int8_blocks_take_their_rows_and_scales_and_almost_halve():
    """SmolLM2's shape: a 64-dim row is 128 bytes in bf16 and 64 + 4 (its fp32 scale) in int8."""
    bf16, int8 = (KVCacheSpec(30, 3, 64, 32, dtype) for dtype in (torch.bfloat16, torch.int8))
    assert bf16.bytes_per_block == 2 * 30 * 3 * 32 * 128 and int8.bytes_per_block == 2 * 30 * 3 * 32 * 68
    budget = 2**30
    blocks = [num_blocks_for_budget(spec, CPU, budget, 0.85) for spec in (bf16, int8)]
    assert blocks == [budget // bf16.bytes_per_block, budget // int8.bytes_per_block]
    assert 1.88 < blocks[1] / blocks[0] < 1.89  # the same block size: 128 / 68 as many blocks
    assert not bf16.quantized and int8.quantized


def test_int8_cache_layout_and_a_block_moved_bit_for_bit():
    """What the offload tier stores of a block: every tensor at that block id, rows then scales."""
    spec = KVCacheSpec(2, 3, 16, 4, torch.int8)
    cache = KVCache(spec, 5, CPU)
    assert cache.storage.shape == (2, 2, 3, 5, 4, 16) and cache.storage.dtype == torch.int8
    assert cache.scales is not None and cache.scales.shape == (2, 2, 3, 5, 4) and cache.scales.dtype == torch.float32
    assert [(t.data_ptr(), dim) for t, dim in cache.block_tensors()] == [
        (cache.storage.data_ptr(), 3),
        (cache.scales.data_ptr(), 3),
    ]
    assert cache.block_nbytes == spec.bytes_per_block  # what the budget counts is what a block owns
    gen = torch.Generator().manual_seed(0)
    cache.storage.copy_(torch.randint(-127, 128, cache.storage.shape, generator=gen))
    cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen))
    rows = torch.empty(1, cache.block_nbytes, dtype=torch.uint8)
    cache.read_blocks([3], rows)  # out (the tier's write) ...
    cache.write_blocks(torch.tensor([1]), rows)  # ... and back in, into another block
    for layer in range(2):
        for offset in range(4):
            for a, b in zip(cache.token_kv(layer, 1 * 4 + offset), cache.token_kv(layer, 3 * 4 + offset)):
                assert torch.equal(a, b)
    layer = cache.layer(1)
    assert layer.quantized and layer.k_scale is not None and layer.k_scale.shape == (3, 5, 4)
    k, _ = cache.token_kv(1, 3 * 4 + 2)  # dequantized: the int8 row times its scale
    assert torch.equal(k, cache.storage[1, 0, :, 3, 2].float() * cache.scales[1, 0, :, 3, 2, None])


def test_plain_cache_has_one_tensor():
    spec = KVCacheSpec(2, 3, 16, 4, torch.bfloat16)
    cache = KVCache(spec, 5, CPU)
    assert cache.scales is None and len(cache.block_tensors()) == 1 and not cache.layer(0).quantized
    assert cache.block_nbytes == spec.bytes_per_block


def test_kv_cache_dtype_flag():
    assert load_config([]).kv_cache_dtype == "auto"
    assert load_config(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


def test_a_bad_kv_cache_dtype_fails_a_runner_before_the_weights_are_read(tmp_path):
    from executor_svc.runner.model_runner import ModelRunner

    with pytest.raises(ValueError, match="unsupported KV cache dtype 'fp8'"):
        ModelRunner(str(tmp_path / "no-such-model"), device="cpu", kv_cache_dtype="fp8")
