"""The adapter registry: resident adapters in LRU order, never one in use; host copies; refusals change nothing."""

from __future__ import annotations

import shutil

import pytest
import torch

from executor_svc.lora.errors import LoraAdapterError, LoraRegistryError
from executor_svc.lora.registry import LoraRegistry
from executor_svc.models.layer_ops import TorchLayerOps
from tests.executor.test_lora_adapter import bad_adapters, model_config, random_pairs, write_adapter


def _registry(checkpoints, in_use: set[str], **limits) -> LoraRegistry:
    return LoraRegistry(
        model_config(checkpoints["llama"]),
        TorchLayerOps().pack,
        torch.float32,
        torch.device("cpu"),
        max_rank=8,
        in_use=lambda: in_use,
        **{"max_loras": 2, **limits},
    )


def _register(registry: LoraRegistry, root, names: str) -> None:
    for name in names:
        pairs = random_pairs(["self_attn.q_proj", "mlp.down_proj"], 4, seed=ord(name))
        registry.register(name, write_adapter(root / name, pairs))


def test_resident_adapters_are_least_recently_used_first_and_never_one_in_use(checkpoints, tmp_path):
    in_use: set[str] = set()
    registry = _registry(checkpoints, in_use)
    _register(registry, tmp_path, "abc")
    assert registry.resident_names() == ()
    assert registry.acquire("a") and registry.acquire("b")
    registry.resident("a")  # a step used a: b is the least recent now
    assert registry.resident_names() == ("b", "a")
    in_use |= {"a", "b"}
    assert not registry.acquire("c")  # every slot in use: the caller keeps c's sequence out
    assert registry.resident_names() == ("b", "a")
    in_use.discard("a")
    assert registry.acquire("c")  # b is less recent but runs: a goes
    assert registry.resident_names() == ("b", "c")
    in_use.clear()
    assert registry.acquire("a")
    assert registry.resident_names() == ("c", "a")
    assert registry.acquire("a") and registry.resident_names() == ("c", "a")  # resident: nothing loads
    assert [layer.keys() for layer in registry.resident("a").layers] == [{"qkv", "down"}] * 2


def test_refusals_change_nothing(checkpoints, tmp_path):
    in_use = {"a"}
    registry = _registry(checkpoints, in_use)
    _register(registry, tmp_path, "ab")
    registry.acquire("a")
    for kind, (folder, expected) in bad_adapters(tmp_path / "bad").items():
        with pytest.raises(LoraAdapterError) as error:
            registry.register(f"bad {kind}", folder)
        assert expected in str(error.value), kind
    with pytest.raises(LoraRegistryError, match="'a' is registered already, from"):
        registry.register("a", tmp_path / "b")
    with pytest.raises(LoraRegistryError, match=r"unknown LoRA adapter 'z' \(registered: a, b\)"):
        registry.acquire("z")
    assert [info.name for info in registry.infos()] == ["a", "b"]
    assert registry.resident_names() == ("a",)
    registry.unregister("b")
    assert "b" not in registry and registry.host_names() == ("a",)


def test_an_adapter_in_use_retires_and_goes_when_unused(checkpoints, tmp_path):
    in_use = {"a"}
    registry = _registry(checkpoints, in_use)
    _register(registry, tmp_path, "ab")
    registry.acquire("a")
    assert registry.unregister("a") is False  # a running sequence uses it: retiring
    assert [info.name for info in registry.infos()] == ["b"] and "a" in registry
    assert registry.acquire("a")  # its sequences keep it (a preempted one comes back as new)
    with pytest.raises(LoraRegistryError, match="'a' is being removed already"):
        registry.unregister("a")
    assert registry.sweep() == ()
    in_use.clear()
    assert registry.sweep() == ("a",) and "a" not in registry and registry.resident_names() == ()
    assert registry.unregister("b") is True and len(registry) == 0


def test_host_copies_are_lru_and_read_again_from_the_folder(checkpoints, tmp_path):
    registry = _registry(checkpoints, set(), max_loras=1, max_cpu_loras=1)
    _register(registry, tmp_path, "ab")
    assert registry.host_names() == ("b",)
    assert registry.acquire("a")  # read from its folder again
    assert registry.host_names() == ("a",) and registry.resident_names() == ("a",)
    write_adapter(tmp_path / "b", random_pairs(["self_attn.q_proj"], 4, seed=9), lora_alpha=16)
    with pytest.raises(LoraAdapterError, match="its files changed since 'b' was registered"):
        registry.acquire("b")
    shutil.rmtree(tmp_path / "b")
    with pytest.raises(LoraAdapterError, match="not a directory"):
        registry.acquire("b")
    assert registry.resident_names() == ("a",)  # a failed load evicts nothing
