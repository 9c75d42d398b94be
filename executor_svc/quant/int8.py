"""int8 weights, one scale per output channel, quantized at load from any checkpoint.

The math every path computes (the C++ kernels in native/csrc/cpu_quant.cpp, and
the torch code here that runs where they do not and that the tests hold them
to):

- weights: ``ws[c] = max|w[c]| / 127``, ``wq = round(w / ws)`` in [-127, 127];
- activations, in steps of at most ``widen_above`` rows: int8 with one scale
  per row and per 64 input features (``quantize_activations``), so each
  group's dot product is an exact integer; ``y = sum_g xs[r, g] * (xq . wq)_g
  * ws[c] (+ bias)``, rounded once to x's dtype;
- larger steps (prefill): x rounded to bf16 times the integer weights (exact in
  bf16), ``* ws`` (+ bias). The kernels widen the weights a panel group at a
  time for this; a dequantized copy of a whole weight never exists.

One scale per row alone costs SmolLM2-135M +3.7% perplexity; per 64 features
(one AMX-INT8 tile's depth) +1.2%, most of it the weights' own (+0.6%
weight-only): docs/quantization.md has the table.
"""

from __future__ import annotations

import dataclasses

import torch

from executor_svc.native import loader
from executor_svc.quant.base import QuantizedLinear

# Input features per activation scale: one AMX-INT8 tile product (K is padded to it).
GROUP = 64
# Steps of more rows than this take bf16 activations (auto): the int8 products' per-group scaling costs more
# than bf16 tile products there (bench/bench_linear.py --quantization int8).
WIDEN_ABOVE_ROWS = 128
ALWAYS = 1 << 62  # a widen_above that no step reaches
# The kernels' vector paths (the op's vnni=True): int8 activations at every step size, no bf16 widening.
# AVX512-VNNI, or AVX2's vpmaddubsw where the build has no VNNI (cpu_quant_avx2.h).
VECTOR_PATHS = ("vnni-int8", "avx2-int8")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (wq [N, K] int8, ws [N] float32); an all-zero row gets scale 1."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_activations(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, Kp] int8, xs [M, Kp / group] float32), K zero-padded to a multiple of 64.

    ``xs = max|x| / 127`` per row and group, ``xq = round(x * (127 / max|x|))``
    (nearest even), as the kernels' quantize_rows_int8 computes it.
    """
    m, k = x.shape
    kp = -(-k // 64) * 64
    padded = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, kp // group, group)
    amax = groups.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return xq.view(m, kp), amax / 127


def int8_matmul(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None, widen_above: int):
    """x [M, K] @ (wq * ws).T (+ bias) in the module's math (see above), in torch: [M, N] in x's dtype."""
    k = x.shape[1]
    weight = wq.float()  # [N, K]: one layer dequantized at a time, for this call only
    if x.shape[0] > widen_above:
        acc = x.to(torch.bfloat16).float() @ weight.T
    else:
        xq, xs = quantize_activations(x)
        dequantized = (xq.float().view(x.shape[0], xs.shape[1], GROUP) * xs[:, :, None]).flatten(1)[:, :k]
        acc = dequantized @ weight.T
    acc = acc * ws
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


@dataclasses.dataclass(eq=False)
class Int8Linear(QuantizedLinear):
    """A linear layer with int8 weights: ``layer(x, bias)`` -> [..., out_features].

    ``path`` says what runs it: ``amx-int8`` / ``vnni-int8`` / ``avx2-int8`` (the
    C++ kernels; ``packed`` is their panel layout) or
    ``torch-int8`` (``packed`` is wq [N, K], dequantized per call).
    """

    path: str
    packed: torch.Tensor
    scales: torch.Tensor  # [N] float32
    out_features: int
    in_features: int
    widen_above: int
    kernels: object = None  # the ops of the loaded kernel library (C++ paths)
    # Whether silu_and_mul runs (a C++ path of a build with the fused gate/up kernel, whole panels).
    fused_silu: bool = False

    @property
    def format(self) -> str:  # type: ignore[override]
        return "int8"

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        if self.path == "torch-int8" or flat.dtype not in (torch.float32, torch.bfloat16):
            y = int8_matmul(flat, self._wq(), self.scales, bias, self.widen_above)
        else:
            y = self.kernels.linear_int8(  # type: ignore[attr-defined]
                flat, self.packed, self.scales, self.out_features, bias, self.path in VECTOR_PATHS, self.widen_above
            )
        return y.view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up [..., out_features / 2] of this fused gate/up layer in one kernel pass, the same bits
        as silu_and_mul of its output; None where that kernel does not run it (then the caller runs both)."""
        if not self.fused_silu or x.dtype != torch.bfloat16:
            return None
        flat = x.reshape(-1, x.shape[-1])
        y = self.kernels.linear_int8_silu(  # type: ignore[attr-defined]
            flat, self.packed, self.scales, self.out_features, self.path in VECTOR_PATHS, self.widen_above
        )
        return y.view(*x.shape[:-1], self.out_features // 2)

    def _wq(self) -> torch.Tensor:
        """wq [N, K] int8 (unpacked from the panels when a C++ path holds it)."""
        if self.path == "torch-int8":
            return self.packed
        panels = self.packed.permute(0, 2, 1, 3).reshape(-1, self.packed.shape[1] * 4)  # [P * 16, Kp]
        return panels[: self.out_features, : self.in_features]


def int8_path(kernels, device: torch.device) -> str:
    """What runs int8 layers here: the AMX-INT8, VNNI or AVX2 kernels on a CPU whose build has them, else torch."""
    if kernels is None or device.type != "cpu":
        return "torch-int8"
    if "amx_int8" in kernels.features and kernels.ops.amx_int8_ready():
        return "amx-int8"
    if "avx512_vnni" in kernels.features:
        return "vnni-int8"
    if "avx2_int8" in kernels.features:
        return "avx2-int8"
    return "torch-int8"


def int8_linear(weight: torch.Tensor, path: str, kernels, widen_above: int) -> Int8Linear:
    """``weight`` [N, K] (any float dtype, on its device) quantized and packed for ``path``.

    Args:
        kernels: the loaded kernels' ops (``loader.kernels().ops``) for the C++ paths.
        widen_above: steps of more rows take bf16 activations (``WIDEN_ABOVE_ROWS``, ``ALWAYS``, 0).
    """
    wq, ws = quantize_per_channel(weight)
    n, k = wq.shape
    if path == "torch-int8":
        return Int8Linear(path, wq, ws, n, k, widen_above)
    packed = kernels.pack_int8(wq)
    fused_silu = n % 32 == 0 and _has_fused_silu(path)
    return Int8Linear(path, packed, ws, n, k, widen_above, kernels, fused_silu)


# What the fused gate/up kernel needs in the kernel build, per C++ int8 path.
_FUSED_SILU_NEEDS = {"amx-int8": {"amx_int8", "amx", "avx512_bf16"}, "vnni-int8": {"avx512_vnni", "avx512_bf16"}}


def _has_fused_silu(path: str) -> bool:
    """Whether the loaded kernels have the fused gate/up kernel for ``path``."""
    loaded = loader.kernels()
    needs = _FUSED_SILU_NEEDS.get(path)
    return loaded is not None and needs is not None and needs <= loaded.features
