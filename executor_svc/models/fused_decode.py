"""A decode-only step through every layer of a Llama-family model in one C++ call.

At decode batch sizes the layer loop of ``LlamaModel.forward`` spends as long
in Python as in its small kernels: ten dispatched ops and a dozen tensor
views a layer, 300 or more a step, while the second thread waits for the
first. ``decode_layers`` (native/csrc/cpu_layers.cpp) runs the same ops in the
same order from C++, so its outputs are the Python loop's bits.

It applies when every piece is one the C++ op chains: the C++ layer ops, the
C++ attention backend on a step with no prefill chunk, every linear weight
packed for our kernels (bf16 or fp32 panels, bf16 weights as fp32 panels, int8,
GGUF blocks), dense SiLU
feed-forward blocks, no q/k norms, one window and soft-cap for all layers,
and a bf16 or fp32 model. Anything else runs the Python loop; ``reason``
says why, once, at load.
"""

from __future__ import annotations

from typing import Any

import torch

from executor_svc.attention.cpp_backend import CppStepState
from executor_svc.models.layer_ops import WIDENED_F32_PANEL, PanelWeight
from executor_svc.models.mlp import GatedMlp
from executor_svc.native import loader
from executor_svc.quant.gguf_blocks import BlockLinear
from executor_svc.quant.int8 import VECTOR_PATHS, Int8Linear

# The weight kinds of cpu_layers.cpp.
PANEL_BF16, PANEL_F32, INT8, INT8_VNNI, PANEL_WIDENED, BLOCKS = 0, 1, 2, 3, 4, 16


class FusedDecode:
    """The flattened weights of a model for ``decode_layers``; built once at load (``prepare``)."""

    def __init__(self, model: Any, kernels: Any, linears: list[tuple[Any, ...]], widen_above: int):
        self.model = model
        self.kernels = kernels
        self.weights = [w[0] for w in linears]
        self.scales = [w[1] for w in linears]
        self.kinds = [w[2] for w in linears]
        self.out_features = [w[3] for w in linears]
        self.biases = [bias for layer in model.layers for bias in (layer.attn.qkv_bias, None, None, None)]
        self.norms = [norm for layer in model.layers for norm in (layer.input_norm, layer.post_norm)]
        self.widen_above = widen_above
        self._cache: tuple[Any, tuple[list, list, list, list]] | None = None

    def applies(self, attn_states: Any) -> bool:
        """Whether this step can run fused: the C++ backend, decode rows only, one state for all layers."""
        state = attn_states[0]
        return (
            isinstance(state, CppStepState)
            and not state.meta.prefills
            and state.meta.num_decode_seqs > 0
            and all(s is state for s in attn_states)
        )

    def run(self, hidden: torch.Tensor, normed: torch.Tensor, rotary: Any, kv_cache: Any, state: CppStepState):
        """Every layer over ``hidden`` [T, hidden] (updated in place); ``normed``: its first input norm."""
        model, config = self.model, self.model.config
        rope_rows, cos, sin = rotary  # [T] rows of the cos/sin tables (models.rope)
        k_caches, v_caches, k_scales, v_scales = self._layer_caches(kv_cache)
        meta = state.meta
        self.kernels.decode_layers(
            hidden,
            normed,
            rope_rows,
            cos,
            sin,
            self.weights,
            self.scales,
            self.biases,
            self.kinds,
            self.out_features,
            self.widen_above,
            self.norms,
            k_caches,
            v_caches,
            k_scales,
            v_scales,
            meta.slot_mapping,
            state.block_tables,
            state.context_lens,
            config.num_heads,
            config.num_kv_heads,
            model.scale,
            meta.sliding_window or 0,
            meta.logit_softcap or 0.0,
            config.rms_norm_eps,
            state.split_kv,
        )
        return hidden

    def _layer_caches(self, kv_cache: Any) -> tuple[list, list, list, list]:
        """Each layer's K, V and their scales (views of the cache, made once per cache)."""
        if self._cache is None or self._cache[0] is not kv_cache:
            layers = [kv_cache.layer(i) for i in range(len(self.model.layers))]
            lists = (
                [c.k for c in layers],
                [c.v for c in layers],
                [c.k_scale for c in layers],
                [c.v_scale for c in layers],
            )
            self._cache = (kv_cache, lists)
        return self._cache[1]


def prepare(model: Any) -> tuple[FusedDecode | None, str]:
    """The fused decode of ``model`` (a LlamaModel), or None with the reason it does not apply."""
    ops = getattr(model.ops, "base", model.ops)
    if ops.name != "cpp":
        return None, f"layer ops {ops.name}"
    if model.dtype not in (torch.bfloat16, torch.float32):
        return None, f"dtype {model.dtype}"
    kernels = loader.kernels()
    if kernels is None or not hasattr(kernels.ops, "decode_layers"):
        return None, "the installed kernels have no decode_layers (make install rebuilds them)"
    config = model.config
    if config.qk_norm or config.hidden_act not in ("silu", "swish"):
        return None, "q/k norms or a non-SiLU activation"
    linears, widen = [], set()
    for layer in model.layers:
        if not isinstance(layer.mlp, GatedMlp):
            return None, f"feed-forward block {layer.mlp.path}"
        for weight in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            entry = _linear(weight)
            if entry is None:
                return None, f"a linear weight of type {type(weight).__name__}"
            linears.append(entry[:5])
            if entry[4] is not None:
                widen.add(entry[4])
    if len(widen) > 1:
        return None, "layers widen at different batch sizes"
    return FusedDecode(model, kernels.ops, linears, widen.pop() if widen else 0), "fused"


def _linear(weight: Any) -> tuple[Any, ...] | None:
    """(tensor, scales, kind, out features, widen_above or None) of a packed weight, or None."""
    if isinstance(weight, PanelWeight):
        if weight.path == WIDENED_F32_PANEL:  # fp32 panels of a bf16 weight: bf16 rows widened, sums rounded once
            kind = PANEL_WIDENED
        else:
            kind = PANEL_BF16 if weight.panels.dtype == torch.bfloat16 else PANEL_F32
        return weight.panels, None, kind, weight.out_features, None
    if isinstance(weight, Int8Linear) and weight.path in ("amx-int8", *VECTOR_PATHS):
        kind = INT8_VNNI if weight.path in VECTOR_PATHS else INT8  # INT8_VNNI: the kernels' vector path
        return weight.packed, weight.scales, kind, weight.out_features, weight.widen_above
    if isinstance(weight, BlockLinear) and weight.kernels is not None:
        quants, scales = weight.tensors
        return quants, scales, BLOCKS + int(weight.qtype), weight.out_features, weight.widen_above
    return None
