"""Loading checkpoint tensors: Hugging Face safetensors folders or GGUF files.

Every tensor the model needs is checked by name and shape before the model is
built, so a wrong or truncated checkpoint fails at start naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
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


# (config.json dict) -> what a rank of an executor group reads of each tensor (executor_svc.parallel.shard).
ShardFor = Callable[[dict[str, Any]], "TensorTaker"]


class TensorTaker(Protocol):
    def take(self, name: str, shape: tuple[int, ...]) -> Any:
        """A ``shard.Take`` (None: not this rank's)."""
        ...


def load_checkpoint(
    model_path: str | Path, keep_gguf: Callable[[Any], bool] | None = None, shard_for: ShardFor | None = None
) -> Checkpoint:
    """Reads config and tensors from a HF folder or a ``.gguf`` file.

    ``keep_gguf``: the GGUF block types to keep as stored (the quantization's; None: dequantize all).
    ``shard_for``: an executor group's rank reads only its part of each tensor, under its local name; from a
    safetensors folder only those bytes are read (a GGUF file is read whole, then cut).

    Raises:
        FileNotFoundError: no config.json / safetensors where expected.
    """
    path = Path(model_path)
    if path.suffix == ".gguf":
        from executor_svc.loading.gguf_loader import load_gguf  # only GGUF users need it

        loaded = load_gguf(path, keep=keep_gguf)
        tensors = dict(loaded.tensors)
        if shard_for is not None:
            tensors = _cut(shard_for(dict(loaded.config)), tensors)
        return Checkpoint(dict(loaded.config), tensors, path.stem, tuple(loaded.eos_token_ids))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    config = json.loads(config_file.read_text())
    taker = shard_for(config) if shard_for is not None else None
    return Checkpoint(config, _load_safetensors(path, taker), path.name, _generation_eos_ids(path))


def _cut(taker: TensorTaker, tensors: dict[str, Any]) -> dict[str, Any]:
    """The rank's parts of tensors read whole."""
    from executor_svc.parallel.shard import read

    out = {}
    for name, tensor in tensors.items():
        take = taker.take(name, tuple(tensor.shape))
        if take is not None:
            out[take.name] = read(take, tensor)
    return out


def _generation_eos_ids(folder: Path) -> tuple[int, ...]:
    gen_file = folder / "generation_config.json"
    if not gen_file.is_file():
        return ()
    value = json.loads(gen_file.read_text()).get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(i) for i in (value if isinstance(value, list) else [value]))


def _load_safetensors(folder: Path, taker: TensorTaker | None = None) -> dict[str, torch.Tensor]:
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
        tensors.update(load_file(str(file_path)) if taker is None else _read_parts(file_path, taker))
    return tensors


def _read_parts(file_path: Path, taker: TensorTaker) -> dict[str, torch.Tensor]:
    """The rank's parts of one safetensors file, reading only their rows and columns."""
    from executor_svc.parallel.shard import read

    out = {}
    with safe_open(str(file_path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
            lazy = f.get_slice(name)
            take = taker.take(name, tuple(lazy.get_shape()))
            if take is not None:
                out[take.name] = read(take, lazy)
    return out


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model reads, with its shape (its family's registry entry says)."""
    return get_model_family(config.architecture).tensor_shapes(config)


def validate_tensors(
    config: ModelConfig, tensors: dict[str, torch.Tensor], absent: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Checks names and shapes; returns the tensors (lm_head tied when needed).

    ``absent``: names this shard does not hold (a pipeline stage without the embedding or the LM head).

    Raises:
        ValueError: a missing tensor or one with an unexpected shape, by name.
    """
    for name, shape in expected_shapes(config).items():
        if name in absent:
            continue
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ValueError(f"tensor {name!r} has shape {list(actual)}, expected {list(shape)}")
    if config.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    return tensors
