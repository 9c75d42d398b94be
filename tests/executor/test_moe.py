"""The mixture-of-experts block: grouped by expert equals token by token, and reads only the experts it uses."""

from __future__ import annotations

import pytest
import torch

from executor_svc.models.activations import gated_activation
from executor_svc.models.layer_ops import get_layer_ops
from executor_svc.models.moe import MoeBlock, route


def _experts(gen, num_experts, hidden, inter, dtype):
    """Random (gate_up [2I, hidden], down [hidden, I]) per expert."""
    return [
        (
            (torch.randn(2 * inter, hidden, generator=gen) * 0.2).to(dtype),
            (torch.randn(hidden, inter, generator=gen) * 0.2).to(dtype),
        )
        for _ in range(num_experts)
    ]


def _per_token(x, router, experts, top_k, normalize):
    """Reference: each token alone, each of its experts in turn, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i, row in enumerate(x.double()):
        probs = torch.softmax(row @ router.double().T, -1)
        weights, ids = probs.topk(top_k)
        if normalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, ids.tolist()):
            gate_up, down = (w.double() for w in experts[e])
            gate, up = (gate_up @ row).chunk(2)
            out[i] += weight * (down @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize(("num_experts", "top_k", "normalize"), [(8, 2, True), (4, 2, False), (8, 1, True)])
@pytest.mark.parametrize(
    ("ops_name", "dtype", "tol"),
    [("torch", torch.float32, 1e-5), ("cpp", torch.float32, 1e-5), ("cpp", torch.bfloat16, 2e-2)],
)
def test_grouped_equals_per_token(num_experts, top_k, normalize, ops_name, dtype, tol, request):
    """37 tokens, every expert hit, through the layer ops' linear (the panel GEMM for cpp)."""
    if ops_name == "cpp":
        request.getfixturevalue("cpp_kernel")
    ops = get_layer_ops(ops_name, torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    hidden, inter = 48, 40
    x = torch.randn(37, hidden, generator=gen).to(dtype)
    router = torch.randn(num_experts, hidden, generator=gen).to(dtype)
    experts = _experts(gen, num_experts, hidden, inter, dtype)
    _, chosen = route(x.float() @ router.float().T, top_k, normalize)
    assert set(chosen.flatten().tolist()) == set(range(num_experts))
    packed = [(ops.pack(gate_up), ops.pack(down)) for gate_up, down in experts]
    block = MoeBlock(ops, ops.pack(router), packed, top_k, normalize, gated_activation("silu", ops))
    out = block(x)
    assert out.dtype == dtype and out.shape == x.shape
    expected = _per_token(x, router, experts, top_k, normalize)
    assert (out.double() - expected).abs().max().item() < tol * expected.abs().max().item()  # relative to |out|


class RecordingOps:
    """The torch layer ops, recording which weights ``linear`` reads."""

    def __init__(self):
        self.ops = get_layer_ops("torch", torch.device("cpu"))
        self.read: list[int] = []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def linear(self, x, weight, bias=None):
        self.read.append(id(weight))
        return self.ops.linear(x, weight, bias)


def test_unused_experts_are_not_read_and_used_ones_once():
    """Experts 1 and 5 score far below the others for every token: their weights are never read; the router
    and each other expert's two matrices are read exactly once for the whole step."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 32, generator=gen)
    router = torch.randn(8, 32, generator=gen)
    x[:, 0], router[:, 0] = 5.0, 0.0
    router[[1, 5], 0] = -20.0  # feature 0 is 5 in every token: -100 for these two
    experts = _experts(gen, 8, 32, 24, torch.float32)
    ops = RecordingOps()
    block = MoeBlock(ops, router, experts, 2, True, gated_activation("silu", ops))
    out = block(x)
    used = [e for e in range(8) if e not in (1, 5)]
    assert sorted(set(route(x @ router.T, 2, True)[1].flatten().tolist())) == used  # the others are all hit
    expected_reads = [id(router)] + [id(w) for e in used for w in experts[e]]
    assert ops.read == expected_reads
    torch.testing.assert_close(out.double(), _per_token(x, router, experts, 2, True), atol=1e-5, rtol=0)


def test_route_softmax_topk_and_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, normalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights, probs[:, :2])
    weights, _ = route(logits, 2, normalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(1))
