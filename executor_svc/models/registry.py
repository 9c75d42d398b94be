"""The model registry: Hugging Face architecture name -> how to read, check, load and run it.

A model family is one module (its config hook, its tensor names and shapes,
its model class, how llama.cpp names its tensors) plus one entry in
``executor_svc.models.FAMILIES``. A family whose config has fields of its own
returns a subclass of ``ModelConfig`` from its ``parse_config``; what varies
per layer (a sliding window on some layers only) goes in ``ModelConfig.layers``.

Lookups happen while a model loads, never in a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from executor_svc.loading.model_config import ModelConfig

if TYPE_CHECKING:
    from executor_svc.kv.cache import KVCache
    from executor_svc.models.layer_ops import LayerOps
    from executor_svc.models.lora_hook import LoraDeltas


class DecoderModel(Protocol):
    """What the runner needs of a loaded model."""

    # The layer ops the model was built with (the sampler uses their argmax).
    ops: LayerOps
    # What runs its feed-forward blocks ("dense", "moe-grouped"), reported with the kernel paths.
    mlp_path: str

    def forward(
        self,
        input_ids: torch.Tensor,
        rope_rows: torch.Tensor,
        kv_cache: KVCache,
        backend: Any,
        attn_states: Sequence[Any],
        lora: LoraDeltas | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's flattened tokens; attn_states[i] is layer i's backend state.

        rope_rows [T]: each token's row in the model's RoPE tables (``StepBatch.rope_rows``, models.rope).
        lora: the step's LoRA deltas (models.lora_hook); the runner passes it only to a step with adapter rows.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of the rows to sample [N, hidden]."""
        ...


# Builds a model from checked tensors (names and shapes as ``tensor_shapes`` said), e.g. a model class:
# (config, tensors by Hugging Face name, dtype, device, max_len: positions to cover, layer ops) -> the model.
ModelBuilder = Callable[
    [ModelConfig, dict[str, torch.Tensor], torch.dtype, torch.device, int, "LayerOps"], DecoderModel
]


# get(key, default) reads the GGUF metadata key "<general.architecture>.<key>".
MetadataGetter = Callable[[str, Any], Any]


@dataclasses.dataclass(frozen=True)
class GgufSpec:
    """How llama.cpp writes a family into a GGUF file."""

    arch: str  # general.architecture
    # llama.cpp's converter interleaves the rotary halves of each q/k head's rows.
    permuted_qk: bool
    # GGUF tensor name inside blk.N -> Hugging Face name inside model.layers.N.
    block_tensors: Mapping[str, str]
    # GGUF name -> Hugging Face name of the tensors outside the blocks.
    global_tensors: Mapping[str, str]
    # Adds the family's own config.json keys from "<arch>.*" metadata, in place.
    config_hook: Callable[[MetadataGetter, dict[str, Any]], None] | None = None
    # Whether a file of this general.architecture holds this family (several share "llama": Mixtral is
    # "llama" with experts); None: any. Families with a test are tried before those without.
    accepts: Callable[[MetadataGetter], bool] | None = None
    # GGUF tensor name inside blk.N holding every expert [E, ...] -> per-expert Hugging Face name, {} = expert.
    expert_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # GGUF tensors outside the blocks that hold config values, not weights (Phi-3's LongRoPE factors):
    # name -> config.json key that gets their values as a list, before config_hook runs.
    config_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (Hugging Face name, float32 array) -> the array as Hugging Face stores it (Gemma: norms minus 1).
    tensor_hook: Callable[[str, Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One architecture: its config parsing, tensor names and shapes, model, GGUF naming."""

    architecture: str  # the class name in config.json "architectures", e.g. "LlamaForCausalLM"
    model_type: str  # config.json "model_type", for configs that name no architecture
    # (config.json dict, architecture) -> ModelConfig (or the family's subclass of it).
    parse_config: Callable[[dict[str, Any], str], ModelConfig]
    # Every tensor the model reads, by Hugging Face name, with its shape.
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    build: ModelBuilder
    gguf: GgufSpec | None = None  # None: not loaded from GGUF under a name of its own


_FAMILIES: dict[str, ModelFamily] = {}


def register_model(family: ModelFamily) -> None:
    """Adds a family.

    Raises:
        ValueError: the architecture is registered already.
    """
    if family.architecture in _FAMILIES:
        raise ValueError(f"architecture {family.architecture!r} is registered already")
    _FAMILIES[family.architecture] = family


def unregister_model(architecture: str) -> None:
    """Removes a family (tests that register their own)."""
    _FAMILIES.pop(architecture, None)


def supported_architectures() -> tuple[str, ...]:
    """The registered architectures, in registration order."""
    return tuple(_FAMILIES)


def get_model_family(architecture: str) -> ModelFamily:
    """The family registered for an architecture.

    Raises:
        ValueError: not registered (the message lists what is).
    """
    family = _FAMILIES.get(architecture)
    if family is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_FAMILIES)}")
    return family


def family_for_config(config: dict[str, Any]) -> ModelFamily:
    """The family of a config.json dict: its first registered architecture, else its model_type's.

    Raises:
        ValueError: no architecture named, or none registered.
    """
    names = list(config.get("architectures") or [])
    if not names:
        names = [f.architecture for f in _FAMILIES.values() if f.model_type == config.get("model_type")][:1]
    if not names:
        raise ValueError("config.json names no architecture (no 'architectures' or known 'model_type')")
    for name in names:
        if name in _FAMILIES:
            return _FAMILIES[name]
    return get_model_family(names[0])  # raises, naming it


def family_for_gguf(arch: str, get: MetadataGetter | None = None) -> ModelFamily | None:
    """The family llama.cpp writes with general.architecture = arch (and whose test accepts the file's
    metadata, ``get``), or None."""
    specs = [(f, f.gguf) for f in _FAMILIES.values() if f.gguf is not None and f.gguf.arch == arch]
    for family, spec in specs:
        if spec.accepts is not None and get is not None and spec.accepts(get):
            return family
    return next((family for family, spec in specs if spec.accepts is None), None)


def gguf_architectures() -> tuple[str, ...]:
    """Every general.architecture some family loads from (once each)."""
    return tuple(dict.fromkeys(f.gguf.arch for f in _FAMILIES.values() if f.gguf is not None))


def parse_model_config(config: dict[str, Any]) -> ModelConfig:
    """Parses a config.json dict with its family's hook.

    Raises:
        ValueError: unsupported architecture, or a value its family refuses.
    """
    family = family_for_config(config)
    return family.parse_config(config, family.architecture)
