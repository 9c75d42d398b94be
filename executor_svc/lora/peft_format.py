"""PEFT's LoRA format: a folder with adapter_config.json and adapter_model.safetensors.

PEFT saves a layer's pair as
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` [r, in]
and ``...lora_B.weight`` [out, r]; the delta is ``scale * x A^T B^T`` with
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``),
``r`` and ``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern``
where a key matches, as PEFT matches them. Every option that would make an
adapter compute something else is refused by name; options of training only
(dropout, initialisation of a plain LoRA) are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from executor_svc.lora.errors import LoraAdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight")

# PEFT options that change what an adapter computes when set: option -> what it is.
REFUSED_OPTIONS = {
    "use_dora": "DoRA (a learned magnitude rescales each adapted weight)",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "whole modules saved with the adapter",
    "trainable_token_indices": "trained token embeddings",
    "layer_replication": "replicated layers",
    "target_parameters": "adapted parameters (mixture-of-experts expert weights)",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA",
    "monteclora_config": "Monte Carlo LoRA",
    "megatron_config": "Megatron parallel layers",
}
# init_lora_weights values whose adapters expect a base model changed at initialisation (unless saved converted).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclasses.dataclass(frozen=True)
class PeftFiles:
    """An adapter folder as read: its config and each module's pair of tensors, not yet checked against a model."""

    config: dict[str, Any]
    # (layer index, module name inside model.layers.N.) -> (lora_A [r, in], lora_B [out, r]).
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_peft_files(path: str | Path) -> PeftFiles:
    """Reads and checks an adapter folder's config and tensor names.

    Raises:
        LoraAdapterError: a missing or unreadable file, a refused option, a tensor PEFT's LoRA does not name so.
    """
    folder = Path(path)
    config = _read_config(folder)
    check_options(config)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = (
            " (adapter_model.bin is not read: save it as safetensors)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise LoraAdapterError(f"{folder}: no {WEIGHTS_FILE}{other}")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise LoraAdapterError(f"{weights}: not a safetensors file ({exc})") from exc
    return PeftFiles(config, _pairs(tensors))


def module_scale(config: dict[str, Any], layer: int, module: str, rank: int) -> float:
    """The scale of one module's delta, after checking its tensors' rank against the config's.

    Raises:
        LoraAdapterError: the rank is not the config's for that module, or a pattern is not a regular expression.
    """
    key = f"model.layers.{layer}.{module}"
    expected = _pattern_value(config.get("rank_pattern") or {}, key, config["r"], "rank_pattern")
    if rank != int(expected):
        raise LoraAdapterError(f"{key}: lora_A has rank {rank}, but adapter_config.json says r = {expected}")
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"], "alpha_pattern"))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def check_options(config: dict[str, Any]) -> None:
    """Refuses a config that is not a plain LoRA.

    Raises:
        LoraAdapterError: naming the option.
    """
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoraAdapterError(f"peft_type {peft_type!r} is not supported (only LORA)")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise LoraAdapterError(f"adapter_config.json: {key} must be a positive number, got {config.get(key)!r}")
    for option, what in REFUSED_OPTIONS.items():
        if config.get(option):
            raise LoraAdapterError(f"{option} is not supported: {what}")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"bias {config['bias']!r} is not supported (only 'none': biases trained with LoRA)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.startswith(_BASE_CHANGING_INITS):
        raise LoraAdapterError(
            f"init_lora_weights {init!r} expects a base model changed at initialisation; save the adapter converted "
            "(PEFT's path_initial_model_for_weight_conversion)"
        )


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoraAdapterError(f"{folder}: not a directory (a PEFT adapter is a folder)")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraAdapterError(f"{folder}: no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{path}: not a JSON object")
    return config


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each module's (lora_A, lora_B), from PEFT's tensor names."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise LoraAdapterError(
                f"tensor {name}: not the lora_A/lora_B weight of a decoder layer's module (embeddings, the LM head, "
                "biases and DoRA magnitudes are not supported)"
            )
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise LoraAdapterError(f"tensor {name}: a {tensor.dim()}-D {tensor.dtype} tensor, not a 2-D float matrix")
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    if not halves:
        raise LoraAdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    pairs = {}
    for (layer, module), pair in halves.items():
        missing = {"A", "B"} - pair.keys()
        if missing:
            raise LoraAdapterError(f"model.layers.{layer}.{module}: no lora_{missing.pop()} tensor")
        pairs[(layer, module)] = (pair["A"], pair["B"])
    return pairs


def _pattern_value(patterns: dict[str, Any], key: str, default: Any, option: str) -> Any:
    """The value of the first pattern that matches the end of ``key`` at a dot, as PEFT's get_pattern_key."""
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return value
        except re.error as exc:
            raise LoraAdapterError(f"{option} key {pattern!r} is not a regular expression ({exc})") from exc
    return default
