"""Batch-invariant layer ops for CUDA: a row's bits do not depend on the other rows of the step.

cuBLAS picks its kernel, tile and split of K by the matrix shapes, so a token's
linear layers round differently as the batch beside it changes, and torch's
row reductions choose their launch by the number of rows. Here the linear
layers and the RMSNorms are Triton kernels with one fixed configuration:

- ``linear``: each program computes a BLOCK_M x BLOCK_N tile of the output over
  all of K, BLOCK_K at a time from k = 0, accumulating in fp32 (no split of K,
  no choice by M), so an output row is the same sum in the same order at any
  M. fp32 inputs multiply in IEEE fp32 (not TF32).
- ``rms_norm`` / ``add_rms_norm``: one program per row, the whole row in one
  block, reduced in one fixed order; computed as transformers does (fp32,
  normalised, rounded to the model dtype, then times the weight).

The rest (SiLU-and-multiply, rotary, argmax) is elementwise or exact in torch.
Attention is the Triton backend's, invariant as written. The fixed tiles cost
speed on large steps next to cuBLAS; this is the price of the guarantee, not
a tuned path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K: tl.constexpr,  # a few values per model: one compile each, and a loop count the compiler knows
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + ks
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0
        )
        b = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0
        )
        # fp32 (or, interpreted, bf16 widened: exact products) as IEEE fp32, not TF32; a constexpr branch
        if IEEE:  # noqa: SIM108
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, N, eps, stride, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
    if ADD:  # residual += x in the model dtype (as torch's add_ would round it), then the norm of that
        summed = tl.load(residual_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)
        x = summed.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / N
    normed = (h * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * stride + cols,
        (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


class TritonLayerOps:
    """The linear layers and RMSNorms as fixed-configuration Triton kernels (CUDA); the rest is ``base``'s, the torch
    ops (models/layer_ops.py passes them: this module imports nothing of it)."""

    name = "triton"
    batch_invariant = True

    def __init__(self, base: Any) -> None:
        self.base = base

    def pack(self, weight: torch.Tensor, dense: bool = False) -> torch.Tensor:
        return weight

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.base.silu_and_mul(gate_up)

    def rotary_for(self, rope: Any, rope_rows: torch.Tensor) -> Any:
        return self.base.rotary_for(rope, rope_rows)

    def rotate(self, x: torch.Tensor, rotary: Any) -> torch.Tensor:
        return self.base.rotate(x, rotary)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.base.argmax(logits)

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        m, k = flat.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](
            flat,
            weight,
            bias if bias is not None else weight,
            out,
            m,
            n,
            k,
            flat.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            # Triton's CPU interpreter multiplies bf16 tiles wrongly (3.6): widen them there.
            IEEE=x.dtype == torch.float32 or _INTERPRETED,
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
        )
        return out.view(*x.shape[:-1], n)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, residual, weight, eps)

    @staticmethod
    def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if residual is not None:
            assert residual.is_contiguous() and residual.shape == x.shape, "add_rms_norm updates residual in place"
        out = torch.empty_like(flat)
        n = flat.shape[1]
        _rms_norm_kernel[(flat.shape[0],)](
            flat,
            residual if residual is not None else flat,
            weight,
            out,
            n,
            eps,
            flat.stride(0),
            ADD=residual is not None,
            BLOCK=triton.next_power_of_2(n),
        )
        return out.view(x.shape)
