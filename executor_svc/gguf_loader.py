"""Load a GGUF file as a Hugging Face style model: config dict, named tensors, tokenizer.

Quantized tensors are dequantized at load (``gguf.quants.dequantize``), so the
rest of the executor sees ordinary dense weights under Hugging Face names. The
tokenizer is rebuilt from the GGUF metadata (see ``gguf_tokenizer``).

llama.cpp's converter permutes the rows of the q/k projections of Llama-style
models (it pairs rotary halves as adjacent rows); ``_unpermute_rows`` undoes it
so the weights match the Hugging Face layout, where RoPE rotates the two halves
of each head.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from typing import Any

import numpy as np
import torch

import gguf

from executor_svc import gguf_tokenizer

# GGUF architecture -> (Hugging Face class, model_type, q/k rows permuted by llama.cpp).
# llama.cpp writes Llama 2/3 and Mistral 7B alike as "llama".
_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

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

# GGUF tensor name inside a block -> Hugging Face name inside model.layers.N.
_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GgufError(ValueError):
    """A GGUF file this loader cannot turn into a model (named in the message)."""


@dataclasses.dataclass(frozen=True)
class GgufModel:
    """A GGUF file converted to Hugging Face conventions."""

    # A config.json dict (architectures, hidden_size, ..., torch_dtype).
    config: dict[str, Any]
    # Hugging Face tensor names -> dense tensors in the requested dtype.
    tensors: dict[str, torch.Tensor]
    # A complete Hugging Face `tokenizers` JSON document.
    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # Token ids that end generation (eos first, then end-of-turn ids if any).
    eos_token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GgufTensorInfo:
    """One tensor of a GGUF file: its raw bytes, type and PyTorch-order shape."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # rows first, e.g. [out_features, in_features]
    data: np.ndarray  # uint8 [rows, bytes per row], a view of the memory-mapped file


# GGUF value type -> struct format (little-endian); 8 is string, 9 array.
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reads over the file's bytes."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.pos = 0

    def scalar(self, value_type: int) -> Any:
        fmt = _SCALAR_FORMATS[value_type]
        (value,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (size,) = struct.unpack_from("<Q", self.view, self.pos)
        start = self.pos + 8
        self.pos = start + size
        return str(self.view[start : self.pos], "utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            return self.scalar(value_type)
        item_type, count = self.scalar(4), self.scalar(10)
        if item_type == _STRING:
            return [self.string() for _ in range(count)]
        if item_type == _ARRAY:
            return [self.value(_ARRAY) for _ in range(count)]
        dtype = np.dtype(_SCALAR_FORMATS[item_type])  # numeric arrays in one read
        items = np.frombuffer(self.buffer, dtype, count=count, offset=self.pos)
        self.pos += dtype.itemsize * count
        return items.tolist()


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[GgufTensorInfo]]:
    """Reads a GGUF file's metadata and tensor table; tensor data stays memory-mapped.

    (gguf.GGUFReader parses the same, but element by element: ~10x slower on
    a 50k-token vocabulary.)

    Raises:
        GgufError: not a little-endian GGUF file of version 2 or 3.
    """
    buffer = np.memmap(os.fspath(path), dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    if buffer[:4].tobytes() != b"GGUF" or cursor.scalar(4) != 0x46554747 or cursor.scalar(4) not in (2, 3):
        raise GgufError(f"{path}: not a little-endian GGUF file of version 2 or 3")
    num_tensors, num_kv = cursor.scalar(10), cursor.scalar(10)
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar(4))
    table = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.scalar(10) for _ in range(cursor.scalar(4))]
        table.append((name, dims, gguf.GGMLQuantizationType(cursor.scalar(4)), cursor.scalar(10)))
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    return metadata, [_tensor_info(buffer, data_start, *row) for row in table]


def _tensor_info(
    buffer: np.ndarray, data_start: int, name: str, dims: list[int], qtype: Any, offset: int
) -> GgufTensorInfo:
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = dims[0] // block_size * block_bytes  # dims[0] is the fastest-varying dimension
    num_rows = int(np.prod(dims[1:], dtype=np.int64))
    start = data_start + offset
    data = buffer[start : start + num_rows * row_bytes].view(np.ndarray).reshape(num_rows, row_bytes)
    return GgufTensorInfo(name=name, tensor_type=qtype, shape=tuple(reversed(dims)), data=data)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Returns every metadata field of a GGUF file as plain Python values."""
    return read_gguf(path)[0]


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> GgufModel:
    """Reads a GGUF file: config, dequantized tensors and tokenizer.

    Args:
        path: the .gguf file.
        dtype: dtype of the returned tensors.

    Raises:
        GgufError: unsupported architecture or tensor type, or not a GGUF file.
        gguf_tokenizer.GgufTokenizerError: unsupported tokenizer model (both are ValueError).
    """
    metadata, infos = read_gguf(path)
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise GgufError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    tensor_names = {t.name for t in infos}
    if "rope_freqs.weight" in tensor_names:
        raise GgufError(f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported")
    tok = gguf_tokenizer.build_tokenizer(metadata)
    config = _build_config(metadata, arch, tensor_names, tok, dtype)
    tensors = _load_tensors(infos, arch, config, dtype)
    return GgufModel(
        config=config,
        tensors=tensors,
        tokenizer_json=tok.tokenizer_json,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        eos_token_ids=tok.eos_token_ids,
    )


def _build_config(
    metadata: dict[str, Any],
    arch: str,
    tensor_names: set[str],
    tok: gguf_tokenizer.GgufTokenizer,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Maps `<arch>.*` metadata keys to a Hugging Face config.json dict."""

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hf_class, model_type, _ = _ARCHITECTURES[arch]
    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden_size // num_heads)))
    num_tokens = len(metadata["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
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
    if head_dim != hidden_size // num_heads or model_type == "qwen3":
        config["head_dim"] = head_dim
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


def _load_tensors(
    infos: list[GgufTensorInfo], arch: str, config: dict[str, Any], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Dequantizes every tensor and renames it to its Hugging Face name."""
    permuted = _ARCHITECTURES[arch][2]
    num_heads = config["num_attention_heads"]
    num_kv_heads = config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for info in infos:
        name = hf_tensor_name(info.name)
        array = dequantize_tensor(info)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            array = _unpermute_rows(array, num_heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            array = _unpermute_rows(array, num_kv_heads)
        # np.array copies: F32 tensors are read-only views of the memory-mapped file.
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)
    return tensors


def hf_tensor_name(gguf_name: str) -> str:
    """Maps a GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}"
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


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (the inverse of `_unpermute_rows`); for writing GGUF."""
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)
