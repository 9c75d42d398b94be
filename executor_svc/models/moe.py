"""Mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, OLMoE): top-k routing, experts grouped.

One step's tokens are routed together: the router scores the flattened batch
[T, E], each token keeps its top k experts, and the (token, expert) pairs are
sorted by expert, so each expert that any token chose runs once, on all of its
rows, through the layer ops' ``linear`` (on the CPU the panel GEMM, reading
that expert's weights once per step); an expert no token chose is not read.
The weighted outputs are summed back per token in expert order, as
transformers sums them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.activations import GatedActivation, gated_activation
from executor_svc.models.attention_layer import TensorGetter, TensorTest
from executor_svc.models.layer_ops import LayerOps
from executor_svc.models.mlp import FeedForward, FeedForwardLoader, load_gated_mlp


@dataclasses.dataclass(frozen=True)
class MoeModelConfig(ModelConfig):
    """A decoder whose MoE layers (``LayerConfig.moe``) route each token to ``num_experts_per_tok`` experts."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE and OLMoE as configured).
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 0  # each expert's intermediate size


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """Where a family keeps one layer's router and experts: names inside model.layers.N., {} = expert index."""

    router: str  # [E, hidden]
    gate: str  # [I, hidden]
    up: str  # [I, hidden]
    down: str  # [hidden, I]


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts: softmax over all of them in fp32, the top k, optionally renormalised.

    Args:
        logits: router scores [T, E].

    Returns:
        Weights [T, k] float32 and expert ids [T, k] int64.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoeBlock:
    """A layer's experts and router; ``block(x)`` computes the step's tokens grouped by expert."""

    path = "moe-grouped"

    def __init__(
        self,
        ops: LayerOps,
        router: Any,
        experts: list[tuple[Any, Any]],
        top_k: int,
        normalize: bool,
        act: GatedActivation,
    ):
        self.linear = ops.linear
        self.router = router  # [E, hidden], maybe packed
        self.experts = experts  # per expert: gate_up [2I, hidden] and down [hidden, I], maybe packed
        self.top_k = top_k
        self.normalize = normalize
        self.act = act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the weighted sum of each token's experts [T, hidden]."""
        weights, experts = route(self.linear(x, self.router), self.top_k, self.normalize)  # [T, k] each
        flat = experts.flatten()  # [T * k], token-major
        order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # rows per expert (one host sync)
        token_of = order // self.top_k  # [T * k], the token of each grouped row
        rows = x.index_select(0, token_of)  # [T * k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for (gate_up, down), count in zip(self.experts, counts):
            if count:  # an expert no token chose is not read
                group = slice(start, start + count)
                out[group] = self.linear(self.act(self.linear(rows[group], gate_up)), down)
                start += count
        out *= weights.flatten()[order].to(out.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token_of, out)  # per token, in expert order


def moe_shapes(config: MoeModelConfig, prefix: str, names: ExpertNames) -> dict[str, tuple[int, ...]]:
    """One MoE layer's router and expert tensors (names under ``prefix``), with their shapes."""
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shapes = {prefix + names.router: (config.num_experts, hidden)}
    for e in range(config.num_experts):
        shapes[prefix + names.gate.format(e)] = (inter, hidden)
        shapes[prefix + names.up.format(e)] = (inter, hidden)
        shapes[prefix + names.down.format(e)] = (hidden, inter)
    return shapes


def moe_loader(names: ExpertNames) -> FeedForwardLoader:
    """A feed-forward loader for a family naming its experts ``names``: MoE layers get a ``MoeBlock``, the
    others (Qwen3-MoE's ``mlp_only_layers``) the dense block."""

    def load(config: ModelConfig, index: int, get: TensorGetter, has: TensorTest, ops: LayerOps) -> FeedForward:
        if not config.layers[index].moe:
            return load_gated_mlp(config, index, get, has, ops)
        assert isinstance(config, MoeModelConfig)
        experts = [
            (
                ops.pack(torch.cat([get(names.gate.format(e)), get(names.up.format(e))])),
                ops.pack(get(names.down.format(e))),
            )
            for e in range(config.num_experts)
        ]
        act = gated_activation(config.hidden_act, ops)
        return MoeBlock(
            ops,
            ops.pack(get(names.router), dense=True),
            experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            act,
        )

    return load
