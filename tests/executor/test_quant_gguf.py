"""GGUF blocks kept as stored (``--quantization gguf``, ``q8_0``, ``q4_0``): the kernels against a
dequantize-then-matmul reference, the lossless repack, the stand-in weight, and models served from the blocks.

The VNNI path's reference is the kernel's own int8 activations (per row and
32-element block) times gguf-py's dequantized weights in float64: each block's
dot product is exact, so only the fp32 scaling and the final rounding differ.
Larger steps widen the blocks to bf16: their reference is x and the weights
rounded to bf16, within what rounding the weights to bf16 moves a sum.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from executor_svc.native.active import active_kernels
from executor_svc.quant import gguf_blocks, int8
from executor_svc.quant.base import QuantizedLinear
from executor_svc.quant.quantized_ops import ConcatLinear
from executor_svc.runner.model_runner import ModelRunner
from tests.executor.conftest import install_recorder, native_ops
from tests.executor.test_gguf_loader import random_hf_weights, write_tiny_gguf
from tests.executor.test_model_hf_parity import _generate, greedy_prompts

TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1]
ROWS = [1, 5, 8, 16, 17, 48, 2048]
SHAPES = [(16, 64), (100, 96), (960, 576), (576, 1536)]


@pytest.fixture(scope="module")
def kernels(cpp_kernel):
    ops = native_ops("f32_panels", "the GGUF block kernels need AVX-512 or AVX2 + FMA")
    if not {"avx512_vnni", "avx2_int8"} & set(ops.cpu_features()):
        pytest.skip("the GGUF block kernels need AVX512-VNNI or AVX2 in the kernel build")
    return ops


def _blocks(qtype: QT, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's rows of blocks, gguf-py's dequantized weight [N, K] float64)."""
    weight = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    weight[1, :32] = 0.0  # an all-zero block
    data = np.ascontiguousarray(gguf.quants.quantize(weight, qtype))
    dequantized = gguf.quants.dequantize(data, qtype).reshape(out_features, in_features)
    return torch.from_numpy(data), torch.from_numpy(dequantized.astype(np.float64))


def _vector(kernels) -> str:
    """The block kernels' name prefix in this build: vnni (AVX512-VNNI), else avx2 (vpmaddubsw)."""
    return "vnni" if "avx512_vnni" in kernels.cpu_features() else "avx2"


def _widens(kernels) -> bool:
    features = kernels.cpu_features()
    return "avx512_bf16" in features or ("amx" in features and kernels.amx_ready())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_gemm_matches_dequantize_then_matmul(kernels, qtype, rows, shape):
    out_features, in_features = shape
    data, dequantized = _blocks(qtype, out_features, in_features, rows + out_features)
    widen_above = gguf_blocks.WIDEN_ABOVE_ROWS if _widens(kernels) else int8.ALWAYS
    layer = gguf_blocks.block_linear(gguf_blocks.GgufWeight(qtype, data, shape), kernels, widen_above)
    gen = torch.Generator().manual_seed(rows)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        bias = torch.randn(out_features, generator=gen).to(dtype)
        for b in (None, bias):
            out = layer(x, b)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            extra = 0.0 if b is None else b.double()
            if rows > widen_above:  # x and the weights rounded to bf16
                xb = x.to(torch.bfloat16).double()
                exact = xb @ dequantized.T + extra
                spread = ((xb[:, None, :] * dequantized[None]) ** 2).sum(-1).sqrt() if rows <= 64 else None
                limit = 2**-7 * exact.abs() + (2**-7 * spread if spread is not None else 2**-6 * exact.abs().max())
            else:
                xq, xs, _ = kernels.quantize_rows_int8(x, 32)
                blocks = in_features // 32
                xd = xq[:rows, :in_features].double().view(rows, blocks, 32) * xs[:rows, :blocks, None].double()
                exact = xd.flatten(1) @ dequantized.T + extra
                limit = (2**-7 if dtype == torch.bfloat16 else 1e-5) * exact.abs() + 1e-5 * exact.abs().max()
            assert ((out.double() - exact).abs() <= limit).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_repack_and_the_torch_code_give_the_files_weights(kernels, qtype):
    data, dequantized = _blocks(qtype, 40, 96, 3)
    torch.testing.assert_close(gguf_blocks.dequantize_rows(data, qtype, 96).double(), dequantized, rtol=1e-6, atol=0)
    quants, scales = kernels.pack_qblocks(data, int(qtype), 96)
    assert quants.shape == (3, 3, 512 if qtype == QT.Q8_0 else 256) and scales.shape == (3, 3, 2, 16)
    # Per block and output: the quants and fp16 d and m (the file keeps m only for Q4_1), 48 outputs (8 padding).
    per_block = (32 if qtype == QT.Q8_0 else 16) + 4
    assert quants.numel() + scales.numel() * 2 == 48 * 3 * per_block
    unpacked = kernels.qblocks_rows(quants, scales, int(qtype), 40, None)
    torch.testing.assert_close(unpacked.double(), dequantized, rtol=1e-6, atol=1e-7)
    some = torch.tensor([39, 0, 17, 17])
    torch.testing.assert_close(kernels.qblocks_rows(quants, scales, int(qtype), 40, some), unpacked[some])
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.qblocks_rows(quants, scales, int(qtype), 40, torch.tensor([40]))


def test_block_kernels_reject_mismatched_inputs(kernels):
    data, _ = _blocks(QT.Q4_1, 40, 64, 4)
    with pytest.raises(RuntimeError, match="not kept as stored"):
        kernels.pack_qblocks(data, int(QT.Q5_0), 64)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.pack_qblocks(data, int(QT.Q4_0), 64)  # Q4_0 rows are shorter
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.pack_qblocks(data, int(QT.Q4_1), 48)
    quants, scales = kernels.pack_qblocks(data, int(QT.Q4_1), 64)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear_qblocks(torch.randn(3, 96), quants, scales, int(QT.Q4_1), 40, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.linear_qblocks(x, quants, scales, int(QT.Q4_1), 60, None, 16)
    with pytest.raises(RuntimeError, match="quants"):
        kernels.linear_qblocks(x, quants, scales, int(QT.Q8_0), 40, None, 16)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.linear_qblocks(x, quants, scales, int(QT.Q4_1), 40, torch.randn(40).bfloat16(), 16)


def test_a_gguf_weight_stands_in_where_the_model_touches_one(kernels):
    (q, _), (v, _) = _blocks(QT.Q4_0, 32, 64, 5), _blocks(QT.Q8_0, 16, 64, 6)
    wq, wk = gguf_blocks.GgufWeight(QT.Q4_0, q, (32, 64)), gguf_blocks.GgufWeight(QT.Q4_0, q[:16], (16, 64))
    fused = torch.cat([wq, wk])
    assert isinstance(fused, gguf_blocks.GgufWeight) and fused.shape == (48, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat([wq.dequantize(), wk.dequantize()]))
    mixed = torch.cat([wq, gguf_blocks.GgufWeight(QT.Q8_0, v, (16, 64))])
    assert isinstance(mixed, gguf_blocks.GgufRows) and mixed.shape == (48, 64)
    embed = wq.to(dtype=torch.bfloat16)
    ids = torch.tensor([[3, 0], [31, 3]])
    rows = F.embedding(ids, embed)
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 2, 64)
    torch.testing.assert_close(rows, wq.dequantize()[ids].bfloat16())
    with pytest.raises(TypeError, match="matmul is not defined on GGUF blocks"):
        torch.matmul(torch.ones(2, 64), wq)
    layer = gguf_blocks.block_linear(embed, kernels, 16)  # a tied LM head: the blocks move into its panels
    assert embed.data is None and embed.packed is layer
    torch.testing.assert_close(F.embedding(ids, embed), rows)


def _tiny_gguf(tmp_path, qtype: QT, **kwargs):
    return write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", random_hf_weights(seed=1), qtype, **kwargs)


def _runner(path, **kwargs) -> ModelRunner:
    options = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**21)
    return ModelRunner(str(path), **{**options, **kwargs})


def _logits(runner) -> dict[tuple[int, ...], torch.Tensor]:
    recorder = install_recorder(runner)
    _generate(runner, greedy_prompts(), 6, chunk=5)
    return {tuple(tokens): logits for tokens, logits in recorder.records}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_gguf_file_is_served_from_its_blocks(tmp_path, kernels, qtype):
    path = _tiny_gguf(tmp_path, qtype)
    runner = _runner(path)
    name = qtype.name.lower()
    assert runner.info.quantization == f"gguf:{name}" and active_kernels(runner)["gemm"] == f"{_vector(kernels)}-{name}"
    layers = [runner.model.lm_head, *(w for layer in runner.model.layers for w in (layer.attn.qkv, layer.mlp.down))]
    assert all(isinstance(w, QuantizedLinear) and w.format == name for w in layers)
    assert runner.model.embed.data is None  # the tied embedding reads the LM head's panels
    file_bytes = sum(len(d) for d in _block_tensor_bytes(path))
    assert runner.model.ops.quantized_bytes <= file_bytes * 1.3  # the panels pad outputs to 16
    dense = _logits(_runner(path, quantization="none"))  # the file dequantized at load
    served = _logits(runner)
    shared = dense.keys() & served.keys()
    assert len(shared) >= 6
    for tokens in shared:
        cosine = F.cosine_similarity(served[tokens], dense[tokens], dim=0).item()
        assert cosine > 0.999, (tokens, cosine)


def _block_tensor_bytes(path) -> list[bytes]:
    from executor_svc.loading.gguf_reader import read_gguf

    return [info.data.tobytes() for info in read_gguf(path)[1] if info.tensor_type in gguf_blocks.KEPT_TYPES]


def test_blocks_of_different_types_fused_are_multiplied_part_by_part(tmp_path, kernels):
    """A K-quant style mix: q/k in Q4_0, v in Q8_0 (raw tensors), fused into one qkv of two parts."""
    weights = random_hf_weights(seed=2)
    raw = {}
    for i in range(2):
        v = weights.pop(f"model.layers.{i}.self_attn.v_proj.weight")
        raw[f"blk.{i}.attn_v.weight"] = (gguf.quants.quantize(v, QT.Q8_0), QT.Q8_0)
    path = write_tiny_gguf(tmp_path / "mixed.gguf", weights, QT.Q4_0, raw=raw)
    runner = _runner(path)
    qkv = runner.model.layers[0].attn.qkv
    assert isinstance(qkv, ConcatLinear) and [p.format for p in qkv.parts] == ["q4_0", "q8_0"]
    assert runner.info.quantization == "gguf:q4_0+q8_0"
    dense = _logits(_runner(path, quantization="none"))
    served = _logits(runner)
    for tokens in dense.keys() & served.keys():
        assert F.cosine_similarity(served[tokens], dense[tokens], dim=0).item() > 0.999


@pytest.mark.parametrize("mode", ["q8_0", "q4_0"])
def test_a_checkpoint_folder_is_quantized_into_blocks_at_load(checkpoints, kernels, mode):
    runner = _runner(checkpoints["llama"], quantization=mode)
    assert runner.info.quantization == mode and active_kernels(runner)["gemm"] == f"{_vector(kernels)}-{mode}"
    dense = _logits(_runner(checkpoints["llama"]))
    served = _logits(runner)
    bound = 0.999 if mode == "q8_0" else 0.9  # 4 bits of a tiny random model: lossy, as q4_0 is
    for tokens in dense.keys() & served.keys():
        assert F.cosine_similarity(served[tokens], dense[tokens], dim=0).item() > bound


def test_a_gguf_file_requantized_keeps_the_blocks_of_its_type(tmp_path, kernels):
    path = _tiny_gguf(tmp_path, QT.Q4_1)
    runner = _runner(path, quantization="q4_0")  # every Q4_1 tensor dequantized, then quantized to Q4_0
    assert runner.info.quantization == "q4_0"
    assert {layer.format for layer in _quantized(runner)} == {"q4_0"}


def _quantized(runner) -> list[QuantizedLinear]:
    model = runner.model
    return [model.lm_head, *(w for layer in model.layers for w in (layer.attn.qkv, layer.attn.o_proj))]


def test_the_torch_code_serves_the_blocks_without_kernels(tmp_path, cpp_kernel):
    path = _tiny_gguf(tmp_path, QT.Q4_1)
    runner = _runner(path, layer_ops="torch", attention_backend="torch")
    assert active_kernels(runner)["gemm"] == "torch-q4_1"
    dense = _logits(_runner(path, quantization="none", layer_ops="torch", attention_backend="torch"))
    served = _logits(runner)
    for tokens in dense.keys() & served.keys():  # weight-only: the dequantized model's math, one layer at a time
        torch.testing.assert_close(served[tokens], dense[tokens], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("llama", dict(quantization="gguf"), "keeps a GGUF file's blocks; .* is not a .gguf file"),
        ("gemma2", dict(quantization="q4_0"), r"q4_0 needs in_features divisible by 32, got a \[\d+, 72\] weight"),
    ],
)
def test_modes_a_model_cannot_take_are_refused(checkpoints, model, flags, message):
    with pytest.raises(ValueError, match=message):
        _runner(checkpoints[model], **flags)
