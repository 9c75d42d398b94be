"""Load a GGUF file as a Hugging Face style model: config dict, named tensors, tokenizer.

Quantized tensors are dequantized at load (``gguf.quants.dequantize``), so the
rest of the executor sees ordinary dense weights under Hugging Face names,
except those of the block types the quantization keeps (``keep``): they come
as ``GgufWeight`` (the file's rows of blocks, see ``quant.gguf_blocks``). The
tokenizer is rebuilt from the GGUF metadata (see ``gguf_tokenizer``).

Which model family a file holds, how llama.cpp names its tensors and whether
it permuted them come from the family's ``GgufSpec`` in the model registry;
so do the tensors that hold every expert of a layer (split into Hugging Face's
per-expert names), the tensors that hold config values (Phi-3's LongRoPE
factors) and a family's own value convention (Gemma's norms stored plus one).
llama.cpp's converter permutes the rows of the q/k projections of Llama-style
models (it pairs rotary halves as adjacent rows); ``_unpermute_rows`` undoes it
so the weights match the Hugging Face layout, where RoPE rotates the two halves
of each head.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import structlog
import torch

from executor_svc.loading import gguf_tokenizer
from executor_svc.loading.gguf_reader import GgufError, GgufTensorInfo, read_gguf, read_metadata
from executor_svc.loading.tokenizer_files import from_gguf_metadata
from executor_svc.models.registry import GgufSpec, ModelFamily, family_for_gguf, gguf_architectures
from executor_svc.quant.gguf_blocks import KEPT_TYPES, GgufWeight
from pagoda.by_name import copy_by_name

__all__ = ["GgufError", "GgufModel", "load_gguf", "read_gguf", "read_metadata"]

_SUPPORTED_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q5_0,
        gguf.GGMLQuantizationType.Q5_1,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q5_K,
        gguf.GGMLQuantizationType.Q6_K,
    }
)

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_DENSE_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16})
log = structlog.get_logger("executor")


@dataclasses.dataclass(frozen=True)
class GgufModel:
    """A GGUF file converted to Hugging Face conventions."""

    # A config.json dict (architectures, hidden_size, ..., torch_dtype).
    config: dict[str, Any]
    # Hugging Face tensor names -> dense tensors in the requested dtype (or blocks as stored, see ``keep``).
    tensors: dict[str, torch.Tensor | GgufWeight]
    # A complete Hugging Face `tokenizers` JSON document.
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # Token ids that end generation (eos first, then end-of-turn ids if any).
    eos_token_ids: tuple[int, ...]


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, keep: Callable[[Any], bool] | None = None
) -> GgufModel:
    """Reads a GGUF file: config, dequantized tensors and tokenizer.

    Args:
        path: the .gguf file.
        dtype: dtype of the returned tensors.
        keep: which GGMLQuantizationTypes of 2-D tensors stay as stored (of those the kernels take:
            ``KEPT_TYPES``); None: every tensor is dequantized.

    Raises:
        GgufError: unsupported architecture or tensor type, or not a GGUF file.
        gguf_tokenizer.GgufTokenizerError: unsupported tokenizer model (both are ValueError).
    """
    metadata, infos = read_gguf(path)
    arch = metadata.get("general.architecture")
    family = family_for_gguf(arch, lambda key, default=None: metadata.get(f"{arch}.{key}", default))
    if family is None or family.gguf is None:
        supported = ", ".join(sorted(gguf_architectures()))
        raise GgufError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {supported})")
    rope_freqs = [info for info in infos if info.name == "rope_freqs.weight"]
    config_values = {
        family.gguf.config_tensors[info.name]: dequantize_tensor(info).tolist()
        for info in infos
        if info.name in family.gguf.config_tensors
    }
    infos = [info for info in infos if info.name != "rope_freqs.weight" and info.name not in family.gguf.config_tensors]
    tok = gguf_tokenizer.build_tokenizer(metadata)
    config = _build_config(metadata, family, family.gguf, {t.name for t in infos}, tok, dtype, config_values)
    if rope_freqs:
        head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
        factors = dequantize_tensor(rope_freqs[0])
        config["rope_scaling"] = llama3_rope_scaling(factors, config["rope_theta"], head_dim)
    tensors = _load_tensors(infos, family.gguf, config, dtype, keep or _keep_none)
    return copy_by_name(GgufModel, from_gguf_metadata(metadata, tok), config=config, tensors=tensors)


def _build_config(
    metadata: dict[str, Any],
    family: ModelFamily,
    spec: GgufSpec,
    tensor_names: set[str],
    tok: gguf_tokenizer.GgufTokenizer,
    dtype: torch.dtype,
    config_values: dict[str, Any],
) -> dict[str, Any]:
    """Maps `<arch>.*` metadata keys (and the values of config tensors) to a Hugging Face config.json dict."""

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{spec.arch}.{key}", default)

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden_size // num_heads)))
    num_tokens = len(metadata["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", num_tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if head_dim != hidden_size // num_heads:
        config["head_dim"] = head_dim
    config.update(config_values)
    if spec.config_hook is not None:
        spec.config_hook(get, config)
    rope_scaling = _rope_scaling(get)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _float32_value(value: Any) -> float:
    """The shortest decimal of a float32 (GGUF stores 1e-5 as 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(get: Any) -> dict[str, Any] | None:
    """Hugging Face `rope_scaling` from `rope.scaling.*` keys (None when absent)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise GgufError(f"unsupported rope scaling type {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_rope_factors(
    rope_theta: float,
    head_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling. Returns [head_dim // 2].

    Long wavelengths are divided by `factor`, short ones kept, and those in
    between interpolated (what rope_type "llama3" does to the inverse frequencies).
    """
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original_max_position_embeddings / high_freq_factor, 1.0, divisors)
    return np.where(wavelen > original_max_position_embeddings / low_freq_factor, factor, divisors)


def llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recovers `rope_scaling` from llama.cpp's `rope_freqs.weight` (Llama 3.1+).

    The file keeps only the per-frequency divisors; they are accepted when they
    are exactly Llama 3's scaling with its published constants and factor =
    their maximum, and refused otherwise (never a silently different RoPE).
    """
    scaling = {"rope_type": "llama3", "factor": _float32_value(factors.max()), **_LLAMA3_ROPE_DEFAULTS}
    params = {k: v for k, v in scaling.items() if k != "rope_type"}
    expected = llama3_rope_factors(rope_theta, head_dim, **params)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4, atol=0):
        raise GgufError(
            "rope_freqs.weight holds per-frequency RoPE factors that are not Llama 3 scaling "
            f"with {_LLAMA3_ROPE_DEFAULTS}; not supported"
        )
    return scaling


def _keep_none(qtype: Any) -> bool:
    return False


def _load_tensors(
    infos: list[GgufTensorInfo], spec: GgufSpec, config: dict[str, Any], dtype: torch.dtype, keep: Callable
) -> dict[str, Any]:
    """Dequantizes every tensor (but those kept as stored) and renames it to its Hugging Face name (experts:
    one tensor each)."""
    permuted = spec.permuted_qk
    num_heads = config["num_attention_heads"]
    num_kv_heads = config["num_key_value_heads"]
    tensors: dict[str, Any] = {}
    dequantized: dict[str, int] = {}  # quantized types dequantized although blocks were asked for, and how many
    for info in infos:
        if info.tensor_type in KEPT_TYPES and len(info.shape) >= 2 and keep(info.tensor_type):
            tensors.update(_kept_tensors(info, spec, num_heads if permuted else 0, num_kv_heads if permuted else 0))
            continue
        if keep is not _keep_none and info.tensor_type not in _DENSE_TYPES:
            dequantized[info.tensor_type.name] = dequantized.get(info.tensor_type.name, 0) + 1
        array = dequantize_tensor(info)
        for name, part in _hf_tensors(info.name, array, spec):
            if permuted and name.endswith("self_attn.q_proj.weight"):
                part = _unpermute_rows(part, num_heads)
            elif permuted and name.endswith("self_attn.k_proj.weight"):
                part = _unpermute_rows(part, num_kv_heads)
            if spec.tensor_hook is not None:
                part = spec.tensor_hook(name, part)
            # np.array copies: F32 tensors are read-only views of the memory-mapped file.
            tensors[name] = torch.from_numpy(np.array(part, dtype=np.float32, order="C")).to(dtype)
    if dequantized:
        log.warning("gguf_tensors_dequantized", types=dequantized, kept=[t.name for t in KEPT_TYPES])
    return tensors


def _kept_tensors(info: GgufTensorInfo, spec: GgufSpec, num_heads: int, num_kv_heads: int) -> dict[str, GgufWeight]:
    """A tensor's rows of blocks as ``GgufWeight``s under their Hugging Face names (q/k rows unpermuted, when
    ``num_heads``; experts split), copied out of the memory-mapped file."""
    rows = torch.from_numpy(np.array(info.data, order="C"))  # [out (x experts), row bytes]
    cols = info.shape[-1]
    kept = {}
    for name, part in _hf_tensors(info.name, rows.view(*info.shape[:-1], rows.shape[-1]).numpy(), spec):
        data = torch.from_numpy(np.ascontiguousarray(part))
        if num_heads and name.endswith("self_attn.q_proj.weight"):
            data = data[_unpermuted_order(data.shape[0], num_heads)]
        elif num_heads and name.endswith("self_attn.k_proj.weight"):
            data = data[_unpermuted_order(data.shape[0], num_kv_heads)]
        kept[name] = GgufWeight(info.tensor_type, data.contiguous(), (data.shape[0], cols))
    return kept


def _unpermuted_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order ``_unpermute_rows`` gives, as indices (for rows of blocks)."""
    return torch.from_numpy(_unpermute_rows(np.arange(num_rows)[:, None], num_heads)[:, 0].copy())


def _hf_tensors(gguf_name: str, array: np.ndarray, spec: GgufSpec) -> list[tuple[str, np.ndarray]]:
    """(Hugging Face name, array) of one GGUF tensor: itself renamed, or one per expert of a stacked
    [E, rows, cols] expert tensor."""
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in spec.expert_tensors:
        template = f"model.layers.{match.group(1)}.{spec.expert_tensors[match.group(2)]}"
        if array.ndim != 3:
            raise GgufError(
                f"expert tensor {gguf_name!r} has shape {list(array.shape)}, expected [experts, rows, cols]"
            )
        return [(template.format(e), array[e]) for e in range(array.shape[0])]
    return [(hf_tensor_name(gguf_name, spec), array)]


def hf_tensor_name(gguf_name: str, spec: GgufSpec) -> str:
    """Maps a GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name, by the family's maps."""
    if gguf_name in spec.global_tensors:
        return spec.global_tensors[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in spec.block_tensors:
        return f"model.layers.{match.group(1)}.{spec.block_tensors[match.group(2)]}"
    raise GgufError(f"unknown GGUF tensor {gguf_name!r}")


def dequantize_tensor(info: GgufTensorInfo) -> np.ndarray:
    """Returns a GGUF tensor as float32 numpy, shaped like PyTorch (rows first).

    GGUF lists dimensions fastest-first (`[in_features, out_features]`); the
    returned array is `[out_features, in_features]`.
    """
    if info.tensor_type not in _SUPPORTED_TYPES:
        raise GgufError(f"tensor {info.name}: unsupported GGUF tensor type {info.tensor_type.name}")
    array = gguf.quants.dequantize(info.data, info.tensor_type)
    return np.asarray(array, dtype=np.float32).reshape(info.shape)


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverts llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows as interleaved pairs (row 2i, 2i+1 rotate
    together); Hugging Face stores the first half then the second half.
    weight: [num_heads * head_dim, in_features].
    """
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)
