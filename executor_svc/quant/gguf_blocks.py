"""GGUF blocks kept as stored: Q8_0, Q4_0 and Q4_1 weights served in the bytes of the file.

The loader hands the model a ``GgufWeight`` (the file's rows of blocks,
[out, K / 32 * block bytes] uint8) in place of a dense tensor. It stands in
for the weight where the model code touches one: ``.to()`` (a no-op on the
CPU), ``.shape``, ``torch.cat`` along rows (q/k/v and gate/up are fused; rows
of different block types are kept side by side) and ``F.embedding`` (the
looked-up rows are dequantized, in the model dtype). ``ops.pack`` turns it into
a ``BlockLinear``: the C++ kernels' lossless panel layout
(native/csrc/cpu_qblocks.cpp), or the file's bytes dequantized one layer per
call by the torch code here. A weight packed once holds its blocks once: a
tied embedding reads its rows from the LM head's panels.

``quantize_blocks`` makes blocks of a dense weight (``--quantization q8_0``,
``q4_0``) with gguf-py's reference quantizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from executor_svc.quant.base import QuantizedLinear

Q = gguf.GGMLQuantizationType
# The block types the kernels take as stored, and each one's bytes per 32 weights.
KEPT_TYPES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}
BLOCK = 32
# Steps of more rows than this widen the blocks to bf16 for the AMX tile products (auto): past ~16 rows the VNNI
# dot products cost more than widening (bench/bench_linear.py --quantization q4_1).
WIDEN_ABOVE_ROWS = 16


def dequantize_rows(data: torch.Tensor, qtype: Q, num_cols: int) -> torch.Tensor:
    """Rows of blocks [R, K / 32 * block bytes] uint8 -> [R, K] float32, in torch (any device)."""
    rows = data.shape[0]
    blocks = data.view(rows, num_cols // BLOCK, KEPT_TYPES[qtype])
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float()  # [R, B, 1]
    if qtype == Q.Q8_0:
        q = blocks[:, :, 2:].contiguous().view(torch.int8).float()
        return (q * d).view(rows, num_cols)
    start, m = (4, blocks[:, :, 2:4].contiguous().view(torch.float16).float()) if qtype == Q.Q4_1 else (2, -8 * d)
    nibbles = blocks[:, :, start:].int()
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2).float()  # elements 0-15 then 16-31 of each block
    return (q * d + m).view(rows, num_cols)


@dataclasses.dataclass(eq=False)
class GgufWeight:
    """A weight [out, in] as GGUF blocks (only the ops listed in the module doc take it)."""

    qtype: Q
    data: torch.Tensor | None  # [out, in / 32 * block bytes] uint8; None once packed (``packed`` holds the blocks)
    shape: tuple[int, int]
    dtype: torch.dtype = torch.float32  # what looked-up embedding rows are dequantized to
    packed: BlockLinear | None = None

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> GgufWeight:
        """The same blocks on ``device``; ``dtype`` is what embedding lookups return."""
        data = self.data if self.data is None or device is None else self.data.to(device)
        return dataclasses.replace(self, data=data, dtype=dtype or self.dtype)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the weight (all of them: tests only) as float32."""
        if self.data is None:
            assert self.packed is not None
            return self.packed.dequantize(rows)
        data = self.data if rows is None else self.data.index_select(0, rows)
        return dequantize_rows(data, self.qtype, self.shape[1])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.cat:
            return concat_rows(list(args[0]), kwargs.get("dim", args[1] if len(args) > 1 else 0))
        if func is F.embedding:
            ids, weight = args[0], args[1]
            return weight.dequantize(ids.flatten()).to(weight.dtype).view(*ids.shape, weight.shape[1])
        raise TypeError(
            f"{getattr(func, '__name__', func)} is not defined on GGUF blocks kept as stored "
            "(--quantization none loads the model dequantized)"
        )


@dataclasses.dataclass(eq=False)
class GgufRows:
    """Weights of different block types fused along rows (q/k/v of a K-quant mix): multiplied part by part."""

    parts: list[Any]  # GgufWeight or dense tensors
    shape: tuple[int, int]

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> GgufRows:
        return GgufRows([p.to(device=device, dtype=dtype) for p in self.parts], self.shape)


def concat_rows(parts: list[Any], dim: int) -> GgufWeight | GgufRows:
    """``torch.cat(parts, dim=0)`` of GGUF weights: one weight when they share a block type, else side by side."""
    if dim != 0:
        raise TypeError("GGUF blocks are fused along rows (dim 0) only")
    cols = parts[0].shape[1]
    if any(p.shape[1] != cols for p in parts):
        raise ValueError("fused weights must have the same number of columns")
    runs: list[list[Any]] = []  # consecutive parts of one block type (or dense) fused together
    for part in parts:
        kind = part.qtype if isinstance(part, GgufWeight) else None
        if runs and kind is not None and isinstance(runs[-1][0], GgufWeight) and runs[-1][0].qtype == kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    fused = [_fuse(run) for run in runs]
    if len(fused) == 1:
        return fused[0]
    return GgufRows(fused, (sum(p.shape[0] for p in fused), cols))


def narrow_blocks(weight: GgufWeight, dim: int, start: int, end: int) -> GgufWeight:
    """Rows (dim 0) or columns (dim 1, whole blocks of 32) [start, end) of a weight, as blocks: an executor group's
    rank keeps its shard as stored (executor_svc.parallel.shard).

    Raises:
        ValueError: columns that cut a block.
    """
    assert weight.data is not None, "narrowed before packing"
    rows, cols = weight.shape
    if dim == 0:
        return dataclasses.replace(weight, data=weight.data[start:end].clone(), shape=(end - start, cols))
    if start % BLOCK or end % BLOCK:
        raise ValueError(f"columns {start}-{end} of GGUF blocks cut a block of {BLOCK}: the group cannot split it")
    size = KEPT_TYPES[weight.qtype]
    data = weight.data[:, start // BLOCK * size : end // BLOCK * size].contiguous()
    return dataclasses.replace(weight, data=data, shape=(rows, end - start))


def _fuse(run: list[Any]) -> Any:
    """One weight of a run of same-type GGUF weights (or the dense part alone)."""
    if len(run) == 1:
        return run[0]
    first = run[0]
    rows = sum(p.shape[0] for p in run)
    return dataclasses.replace(first, data=torch.cat([p.data for p in run]), shape=(rows, first.shape[1]), packed=None)


@dataclasses.dataclass(eq=False)
class BlockLinear(QuantizedLinear):
    """A linear layer on GGUF blocks: ``layer(x, bias)``. ``path`` names what runs it."""

    path: str
    qtype: Q
    out_features: int
    in_features: int
    widen_above: int
    tensors: tuple[torch.Tensor, ...]  # kernels: (quants, scales); torch: (the file's rows,)
    kernels: Any = None

    @property
    def format(self) -> str:  # type: ignore[override]
        return self.qtype.name.lower()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        if self.kernels is None:
            y = F.linear(flat, self.dequantize().to(flat.dtype), bias)  # one layer, for this call only
        else:
            native = flat if flat.dtype in (torch.float32, torch.bfloat16) else flat.float()  # fp16: in fp32
            quants, scales = self.tensors
            b = None if bias is None else bias.to(native.dtype)
            y = self.kernels.linear_qblocks(
                native, quants, scales, int(self.qtype), self.out_features, b, self.widen_above
            ).to(flat.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the weight as float32 (embedding lookups of a tied LM head; the torch path)."""
        if self.kernels is None:
            data = self.tensors[0] if rows is None else self.tensors[0].index_select(0, rows)
            return dequantize_rows(data, self.qtype, self.in_features)
        quants, scales = self.tensors
        return self.kernels.qblocks_rows(quants, scales, int(self.qtype), self.out_features, rows)


def block_linear(weight: GgufWeight, kernels: Any, widen_above: int) -> BlockLinear:
    """``weight``'s layer on the C++ kernels (``kernels``: their ops; VNNI or AVX2) or, with None, the torch code
    (weight-only: the layer dequantized per call).

    The file's rows are released: the layer holds the blocks from then on, and the weight reads through it.
    """
    assert weight.data is not None, "a GGUF weight is packed once"
    n, k = weight.shape
    name = weight.qtype.name.lower()
    if kernels is None:
        layer = BlockLinear(f"torch-{name}", weight.qtype, n, k, widen_above, (weight.data,))
    else:
        quants, scales = kernels.pack_qblocks(weight.data, int(weight.qtype), k)
        vector = "vnni" if "avx512_vnni" in kernels.cpu_features() else "avx2"  # AVX2: vpmaddubsw, no VNNI
        layer = BlockLinear(f"{vector}-{name}", weight.qtype, n, k, widen_above, (quants, scales), kernels)
    weight.data, weight.packed = None, layer
    return layer


def quantize_blocks(weight: torch.Tensor, qtype: Q) -> GgufWeight:
    """A dense weight [N, K] (K a multiple of 32) as GGUF blocks of ``qtype`` (gguf-py's quantizer).

    Raises:
        ValueError: K is not a multiple of 32.
    """
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{qtype.name.lower()} needs in_features divisible by 32, got a [{n}, {k}] weight")
    data = gguf.quants.quantize(weight.float().cpu().numpy(), qtype)
    return GgufWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)).to(weight.device), (n, k), weight.dtype)
