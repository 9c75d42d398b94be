"""Attention backends and layer ops by name: unknown names refused with the known ones listed,
auto's choice and fallback, and implementations registered by a test serving a real model."""

from __future__ import annotations

import pytest
import torch

from executor_svc.attention import BACKENDS, TorchAttentionBackend, get_backend
from executor_svc.attention import cpp_backend as cpp_attention
from executor_svc.attention.implementations import Implementation, ImplementationRegistry
from executor_svc.models import layer_ops as layer_ops_module
from executor_svc.models.layer_ops import LAYER_OPS, TorchLayerOps, get_layer_ops
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import GREEDY, install_recorder

CPU = torch.device("cpu")


def test_unknown_names_are_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; use one of auto, triton, cpp, torch$"):
        get_backend("flash", CPU, torch.float32)
    with pytest.raises(ValueError, match=r"unknown layer ops 'fast'; use one of auto, cpp, torch$"):
        get_layer_ops("fast", CPU)


def test_named_implementations_that_cannot_run_here_say_why():
    with pytest.raises(ValueError, match="attention backend 'triton' needs a CUDA device and the triton package"):
        get_backend("triton", CPU, torch.float32)
    with pytest.raises(ValueError, match="attention backend 'cpp' needs the CPU device"):
        get_backend("cpp", torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="layer ops 'cpp' needs the CPU device"):
        get_layer_ops("cpp", torch.device("meta"))


def test_unknown_names_fail_a_runner_before_the_weights_are_read(tmp_path):
    with pytest.raises(ValueError, match="unknown layer ops 'fast'"):
        ModelRunner(str(tmp_path / "no-such-model"), device="cpu", layer_ops="fast")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        ModelRunner(str(tmp_path / "no-such-model"), device="cpu", attention_backend="flash")


def test_auto_takes_the_cpp_code_only_when_the_kernels_load(cpp_kernel, monkeypatch):
    assert get_backend("auto", CPU, torch.float32).name == "cpp"
    assert get_layer_ops("auto", CPU).name == "cpp"
    from executor_svc.native import loader

    monkeypatch.setattr(loader, "kernels", lambda: None)
    assert get_backend("auto", CPU, torch.float32).name == "torch"
    assert get_layer_ops("auto", CPU).name == "torch"
    assert get_backend("auto", torch.device("meta"), torch.float32).name == "torch"


def test_auto_falls_back_when_an_implementation_fails_to_build(cpp_kernel, monkeypatch):
    def broken(dtype):
        raise RuntimeError("library is corrupt")

    monkeypatch.setattr(cpp_attention, "CppAttentionBackend", broken)
    with pytest.warns(UserWarning, match="attention backend 'cpp' unusable .library is corrupt"):
        assert get_backend("auto", CPU, torch.float32).name == "torch"
    monkeypatch.setattr(layer_ops_module, "CppLayerOps", broken)
    with pytest.warns(UserWarning, match="layer ops 'cpp' unusable"):
        assert get_layer_ops("auto", CPU).name == "torch"


def test_a_registry_refuses_duplicates_and_auto_and_says_when_nothing_can_run():
    registry: ImplementationRegistry[str] = ImplementationRegistry("widget")
    registry.register(Implementation("only", lambda device, dtype: "built", lambda d, t: "needs a GPU", 1))
    with pytest.raises(ValueError, match="widget 'only' is registered already"):
        registry.register(Implementation("only", lambda device, dtype: "again"))
    with pytest.raises(ValueError, match="widget 'auto' is registered already"):
        registry.register(Implementation("auto", lambda device, dtype: "again"))
    with pytest.raises(ValueError, match="no widget can run on cpu"):
        registry.create("auto", CPU, torch.float32)
    assert registry.names() == ("auto", "only")


# -- implementations registered by the test -----------------------------------------


class CountingAttention:
    """A backend by composition: the torch backend's work, counted."""

    name = "counting"

    def __init__(self, dtype: torch.dtype):
        self.inner = TorchAttentionBackend(dtype)
        self.num_prepares = self.num_forwards = 0

    def prepare(self, meta):
        self.num_prepares += 1
        return self.inner.prepare(meta)

    def forward(self, q, k, v, cache, state, scale):
        self.num_forwards += 1
        return self.inner.forward(q, k, v, cache, state, scale)


class CountingOps(TorchLayerOps):
    """Layer ops that count the weights they pack."""

    name = "counting"

    def __init__(self):
        self.num_packed = 0

    def pack(self, weight):
        self.num_packed += 1
        return weight


@pytest.fixture()
def counting_implementations():
    BACKENDS.register(Implementation("counting", lambda device, dtype: CountingAttention(dtype)))
    LAYER_OPS.register(Implementation("counting", lambda device, dtype: CountingOps()))
    yield
    BACKENDS.unregister("counting")
    LAYER_OPS.unregister("counting")


def _last_logits(runner: ModelRunner, prompt: list[int]) -> list[torch.Tensor]:
    recorder = install_recorder(runner)
    plan = t.NewSequence(1, "r", tuple(prompt), len(prompt), GREEDY, tuple(range(4)), 0, len(prompt))
    assert not runner.execute(t.StepPlan(1, new_seqs=(plan,))).errors
    assert not runner.execute(t.StepPlan(2, scheduled_seqs=(t.ScheduledSequence(1, 1),))).errors
    return [logits for _, logits in recorder.records]


def test_registered_implementations_serve_a_model(counting_implementations, checkpoints):
    """Named by the runner, used for every layer, and equal to the torch code they wrap."""
    assert get_backend("counting", CPU, torch.float32).name == "counting"
    assert "counting" in BACKENDS.names() and "counting" in LAYER_OPS.names()
    assert get_backend("auto", torch.device("meta"), torch.float32).name == "torch"  # named only: not auto's
    options = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**20)
    folder = str(checkpoints["qwen3"])
    runner = ModelRunner(folder, attention_backend="counting", layer_ops="counting", **options)
    assert runner.model.ops.num_packed == 1 + 4 * runner.config.num_layers  # LM head, then qkv, o, gate_up, down
    prompt = [5, 9, 17, 33, 40, 41, 77]
    counted = _last_logits(runner, prompt)
    assert (runner.backend.num_prepares, runner.backend.num_forwards) == (2, 2 * runner.config.num_layers)
    reference = _last_logits(ModelRunner(folder, attention_backend="torch", layer_ops="torch", **options), prompt)
    assert len(counted) == len(reference) == 2
    for ours, theirs in zip(counted, reference):
        assert torch.equal(ours, theirs)
