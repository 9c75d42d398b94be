"""Loading checkpoint tensors: Hugging Face safetensors folders or GGUF files.

Every tensor the model needs is checked by name and shape before the model is
built, so a wrong or truncated checkpoint fails at start naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.registry import get_model_family


@dataclasses.dataclass
class Checkpoint:
    """A model's HF config dict and its tensors under HF names."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    name: str
    # EOS ids known beside config.json (GGUF end-of-turn ids, generation_config.json).
    extra_eos_token_ids: tuple[int, ...] = ()


def load_checkpoint(model_path: str | Path, keep_gguf: Callable[[Any], bool] | None = None) -> Checkpoint:
    """Reads config and tensors from a HF folder or a ``.gguf`` file.

    ``keep_gguf``: the GGUF block types to keep as stored (the quantization's; None: dequantize all).

    Raises:
        FileNotFoundError: no config.json / safetensors where expected.
    """
    path = Path(model_path)
    if path.suffix == ".gguf":
        from executor_svc.loading.gguf_loader import load_gguf  # only GGUF users need it

        loaded = load_gguf(path, keep=keep_gguf)
        return Checkpoint(dict(loaded.config), dict(loaded.tensors), path.stem, tuple(loaded.eos_token_ids))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    config = json.loads(config_file.read_text())
    return Checkpoint(config, _load_safetensors(path), path.name, _generation_eos_ids(path))


def _generation_eos_ids(folder: Path) -> tuple[int, ...]:
    gen_file = folder / "generation_config.json"
    if not gen_file.is_file():
        return ()
    value = json.loads(gen_file.read_text()).get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(i) for i in (value if isinstance(value, list) else [value]))


def _load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file_name in files:
        file_path = folder / file_name
        if not file_path.is_file():
            raise FileNotFoundError(f"safetensors file {file_name} named by the index is missing in {folder}")
        tensors.update(load_file(str(file_path)))
    return tensors


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model reads, with its shape (its family's registry entry says)."""
    return get_model_family(config.architecture).tensor_shapes(config)


def validate_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checks names and shapes; returns the tensors (lm_head tied when needed).

    Raises:
        ValueError: a missing tensor or one with an unexpected shape, by name.
    """
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ValueError(f"tensor {name!r} has shape {list(actual)}, expected {list(shape)}")
    if config.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return tensors
