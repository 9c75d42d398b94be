"""A LoRA adapter checked against the base model, held in host memory (``load_adapter``).

Every check happens here, before the adapter is registered: its options
(``peft_format``), each module being one of the model's LoRA targets
(``targets``), each pair's shapes being that module's, and its rank within
the executor's limit. An adapter that fails any of them is refused whole.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.lora.errors import LoraAdapterError
from executor_svc.lora.peft_format import module_scale, read_peft_files
from executor_svc.lora.targets import LoraTarget, lora_targets


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One adapted module of one layer."""

    target: LoraTarget
    a: torch.Tensor  # [r, in], as stored
    b: torch.Tensor  # [out, r], as stored
    scale: float  # the delta is scale * x a^T b^T

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: its modules by (layer index, module name inside model.layers.N.)."""

    path: str
    modules: dict[tuple[int, str], LoraModule]

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(module.rank for module in self.modules.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The module names it adapts in some layer ("self_attn.q_proj", ...), sorted."""
        return tuple(sorted({module for _, module in self.modules}))

    @property
    def num_bytes(self) -> int:
        """Bytes of its tensors as stored."""
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.a, m.b))


def load_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads a PEFT LoRA folder and checks it against the base model ``config``.

    Raises:
        LoraAdapterError: the message names the problem: a missing or unreadable file, an option that is not
            plain LoRA, a module the model has no target for, a layer out of range, a rank above ``max_rank``,
            a shape that is not the base layer's, values that are not finite.
    """
    files = read_peft_files(path)
    targets = lora_targets(config)
    modules = {}
    for (layer, module), (a, b) in sorted(files.pairs.items()):
        target = _target(targets, config, layer, module)
        name = f"model.layers.{layer}.{module}"
        _check_pair(name, a, b, target, max_rank)
        scale = module_scale(files.config, layer, module, int(a.shape[0]))
        modules[(layer, module)] = LoraModule(target, a, b, scale)
    return LoraAdapter(str(path), modules)


def _target(targets: dict[tuple[int, str], LoraTarget], config: ModelConfig, layer: int, module: str) -> LoraTarget:
    """The module's target, or an error that says why there is none."""
    if layer >= config.num_layers:
        raise LoraAdapterError(f"layer {layer} is out of range: the base model has {config.num_layers} layers")
    target = targets.get((layer, module))
    if target is not None:
        return target
    if config.layers[layer].moe and module.startswith("mlp."):
        raise LoraAdapterError(
            f"model.layers.{layer}.{module}: layer {layer} is a mixture of experts; its expert weights cannot be "
            "adapted (adapters of attention modules can)"
        )
    names = sorted(m for i, m in targets if i == layer)
    raise LoraAdapterError(
        f"unsupported target module {module!r} (model.layers.{layer}): {config.architecture} layers adapt "
        f"{', '.join(names)}"
    )


def _check_pair(name: str, a: torch.Tensor, b: torch.Tensor, target: LoraTarget, max_rank: int) -> None:
    rank = int(a.shape[0])
    if rank > max_rank:
        raise LoraAdapterError(f"{name}: rank {rank} is above the limit of {max_rank} (max_lora_rank)")
    if a.shape[1] != target.in_features or b.shape[0] != target.out_features or b.shape[1] != rank:
        raise LoraAdapterError(
            f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base model's layer, "
            f"{target.in_features} in and {target.out_features} out (lora_A [r, {target.in_features}], "
            f"lora_B [{target.out_features}, r])"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraAdapterError(f"{name}: lora_A or lora_B holds values that are not finite")
