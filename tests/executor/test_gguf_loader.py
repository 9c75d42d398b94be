"""GGUF loading: tiny synthetic files of every supported tensor type, checked
against the original weights and against transformers' own GGUF import."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from executor_svc.loading.gguf_loader import GgufError, load_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# (chat template, bos token, eos token, eos ids) of write_tiny_gguf's files.
TINY_SPECIALS = (CHAT_TEMPLATE, "<|im_start|>", "<|im_end|>", (2,))


def specials(tokenizer) -> tuple:
    """(chat template, bos token, eos token, eos ids) of tokenizer files or a GgufModel."""
    return tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_ids


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
TOKENS = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes q/k projections in (its definition)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def random_hf_weights(seed: int = 0, untied: bool = False, arch: str = "llama") -> dict[str, np.ndarray]:
    """Hugging Face named float32 weights of a tiny Llama (Qwen2: qkv bias; Qwen3: q/k norm)."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * 0.1

    weights = {"model.embed_tokens.weight": mat(VOCAB, HIDDEN), "model.norm.weight": 1 + mat(1, HIDDEN)[0]}
    if untied:
        weights["lm_head.weight"] = mat(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1 + mat(1, HIDDEN)[0],
            p + "post_attention_layernorm.weight": 1 + mat(1, HIDDEN)[0],
            p + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": mat(FFN, HIDDEN),
            p + "mlp.up_proj.weight": mat(FFN, HIDDEN),
            p + "mlp.down_proj.weight": mat(HIDDEN, FFN),
        }
        if arch == "qwen2":
            weights |= {
                p + "self_attn.q_proj.bias": mat(1, HEADS * HEAD_DIM)[0],
                p + "self_attn.k_proj.bias": mat(1, KV_HEADS * HEAD_DIM)[0],
                p + "self_attn.v_proj.bias": mat(1, KV_HEADS * HEAD_DIM)[0],
            }
        if arch == "qwen3":
            weights |= {
                p + "self_attn.q_norm.weight": 1 + mat(1, HEAD_DIM)[0],
                p + "self_attn.k_norm.weight": 1 + mat(1, HEAD_DIM)[0],
            }
    return weights


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if not hf_name.startswith("model.layers."):
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_tiny_gguf(
    path: pathlib.Path,
    weights: dict[str, np.ndarray],
    qtype: QT = QT.F32,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    raw: dict[str, tuple[np.ndarray, QT]] | None = None,
    extra_kv: Callable[[gguf.GGUFWriter], None] | None = None,
) -> pathlib.Path:
    """Writes a tiny model the way llama.cpp's converter does (q/k rows permuted)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if extra_kv is not None:
        extra_kv(writer)
    permuted = arch in ("llama", "mistral")  # llama.cpp permutes only these
    for name, weight in weights.items():
        if permuted and name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, HEADS)
        elif permuted and name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, KV_HEADS)
        if weight.ndim == 1 or qtype == QT.F32:
            writer.add_tensor(gguf_name(name), weight)
        elif qtype == QT.F16:
            writer.add_tensor(gguf_name(name), weight.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    for name, (data, data_type) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=data_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_after_roundtrip(weight: np.ndarray, qtype: QT) -> np.ndarray:
    """What storing `weight` as `qtype` gives back (1-D norms stay F32)."""
    if weight.ndim == 1 or qtype == QT.F32:
        return weight
    if qtype == QT.F16:
        return weight.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)


# Largest |error| relative to the row's max |weight|, by type (well above the
# rounding each format does, far below what a wrong layout gives).
QUANT_TOLERANCE = {
    QT.F32: 0.0,
    QT.F16: 1e-3,
    QT.BF16: 8e-3,
    QT.Q8_0: 1e-2,
    QT.Q4_0: 0.15,
    QT.Q4_1: 0.1,
    QT.Q5_0: 0.08,
    QT.Q5_1: 0.05,
}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_round_trip_per_tensor_type(tmp_path: pathlib.Path, qtype: QT) -> None:
    weights = random_hf_weights(seed=1)
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights, qtype))
    assert sorted(model.tensors) == sorted(weights)
    for name, original in weights.items():
        loaded = model.tensors[name]
        assert loaded.dtype == torch.float32 and tuple(loaded.shape) == original.shape, name
        # Exactly what the format stores, in Hugging Face row order...
        np.testing.assert_array_equal(loaded.numpy(), expected_after_roundtrip(original, qtype), err_msg=name)
        # ...and close to the original weights.
        scale = np.abs(original).max()
        assert np.abs(loaded.numpy() - original).max() <= QUANT_TOLERANCE[qtype] * scale + 1e-7, name


def test_config_and_tokenizer_metadata(tmp_path: pathlib.Path) -> None:
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", random_hf_weights()), dtype=torch.bfloat16)
    assert model.config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
    }
    assert all(t.dtype == torch.bfloat16 for t in model.tensors.values())
    assert "lm_head.weight" not in model.tensors
    assert specials(model) == TINY_SPECIALS


def test_untied_head_is_loaded(tmp_path: pathlib.Path) -> None:
    weights = random_hf_weights(untied=True)
    model = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights))
    assert model.config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(model.tensors["lm_head.weight"].numpy(), weights["lm_head.weight"])


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_1], ids=lambda q: q.name)
def test_matches_transformers_gguf_import(tmp_path: pathlib.Path, qtype: QT) -> None:
    """Same tensors as transformers' import, and the same logits from both."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    weights = random_hf_weights(seed=2, untied=True)
    write_tiny_gguf(tmp_path / "tiny.gguf", weights, qtype)
    ours = load_gguf(tmp_path / "tiny.gguf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    reference_state = reference.state_dict()
    for name, tensor in ours.tensors.items():
        torch.testing.assert_close(tensor, reference_state[name].float(), rtol=0, atol=1e-6, msg=name)

    model = LlamaForCausalLM(LlamaConfig(**ours.config)).eval()
    model.load_state_dict(ours.tensors, strict=True)
    input_ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference.eval()(input_ids).logits)


@pytest.mark.parametrize(("arch", "hf_class"), [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_qwen_architectures(tmp_path: pathlib.Path, arch: str, hf_class: str) -> None:
    """Qwen rows are not permuted; Qwen2 has qkv biases, Qwen3 q/k norms and an explicit head_dim."""
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = random_hf_weights(seed=4, arch=arch)
    write_tiny_gguf(tmp_path / "tiny.gguf", weights, QT.F32, arch=arch)
    ours = load_gguf(tmp_path / "tiny.gguf")
    assert (ours.config["architectures"], ours.config["model_type"]) == ([hf_class], arch)
    assert ours.config["attention_bias"] is (arch == "qwen2")
    assert ours.config.get("head_dim") == (HEAD_DIM if arch == "qwen3" else None)
    assert sorted(ours.tensors) == sorted(weights)
    for name, original in weights.items():
        np.testing.assert_array_equal(ours.tensors[name].numpy(), original, err_msg=name)
    # transformers' class, built from our config, takes exactly our tensors.
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**ours.config))
    assert type(model).__name__ == hf_class
    missing, unexpected = model.load_state_dict(ours.tensors, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embedding
    if arch == "qwen2":  # transformers' GGUF import knows Qwen2 fully (not Qwen3's head_dim)
        reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
        input_ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(input_ids).logits, reference.eval()(input_ids).logits)


def test_rope_scaling_and_eot_ids(tmp_path: pathlib.Path) -> None:
    def extra(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_eot_token_id(0)

    model = load_gguf(write_tiny_gguf(tmp_path / "x.gguf", random_hf_weights(), extra_kv=extra))
    assert model.config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert model.eos_token_ids == (2, 0)


def llama_cpp_rope_freqs(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it for Llama 3.1 (its definition)."""
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    values = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            values.append(1.0)
        elif wavelen > old_context_len / low_freq_factor:
            values.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            values.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(values, dtype=np.float32)


def test_llama3_rope_factors_become_rope_scaling(tmp_path: pathlib.Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, factor = 500000.0, 8.0
    freqs = llama_cpp_rope_freqs(theta, HEAD_DIM, factor)
    assert 1.0 < np.median(freqs) < factor  # the test covers all three regions
    raw = {"rope_freqs.weight": (freqs, QT.F32)}
    write_tiny_gguf(
        tmp_path / "x.gguf",
        random_hf_weights(),
        raw=raw,
        extra_kv=lambda w: w.add_float32("llama.rope.freq_base", theta),
    )
    model = load_gguf(tmp_path / "x.gguf")
    assert model.config["rope_theta"] == theta
    assert model.config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in model.tensors and len(model.tensors) == len(random_hf_weights())
    # transformers' llama3 RoPE from this config divides the plain frequencies by the file's factors.
    config = LlamaConfig(**model.config)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(inv_freq.double(), plain / torch.from_numpy(freqs).double(), rtol=1e-5, atol=0)


def test_other_per_frequency_rope_factors_are_refused(tmp_path: pathlib.Path) -> None:
    raw = {"rope_freqs.weight": (np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32), QT.F32)}
    write_tiny_gguf(tmp_path / "x.gguf", random_hf_weights(), raw=raw)
    with pytest.raises(GgufError, match="rope_freqs.weight holds per-frequency RoPE factors"):
        load_gguf(tmp_path / "x.gguf")


def test_unsupported_architecture_is_named(tmp_path: pathlib.Path) -> None:
    write_tiny_gguf(tmp_path / "x.gguf", random_hf_weights(), arch="falcon")
    with pytest.raises(GgufError, match="unsupported GGUF architecture 'falcon'"):
        load_gguf(tmp_path / "x.gguf")


def test_unsupported_tokenizer_model_is_named(tmp_path: pathlib.Path) -> None:
    write_tiny_gguf(tmp_path / "x.gguf", random_hf_weights(), tokenizer_model="bert")
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'bert'"):
        load_gguf(tmp_path / "x.gguf")


def test_unsupported_tensor_type_is_named(tmp_path: pathlib.Path) -> None:
    weights = random_hf_weights()
    del weights["model.embed_tokens.weight"]
    # One IQ2_XXS tensor (66 bytes per 256 values), a type we do not dequantize.
    raw = {"token_embd.weight": (np.zeros((4, 66), dtype=np.uint8), QT.IQ2_XXS)}
    write_tiny_gguf(tmp_path / "x.gguf", weights, raw=raw)
    with pytest.raises(GgufError, match="token_embd.weight: unsupported GGUF tensor type IQ2_XXS"):
        load_gguf(tmp_path / "x.gguf")


@pytest.mark.slow
def test_smollm2_tensors_match_transformers_gguf_import() -> None:
    """The shipped Q4_1 / Q8_0 SmolLM2: same dense tensors as transformers' import."""
    from transformers import AutoModelForCausalLM

    from executor_svc.loading.model_cache import DEFAULT_GGUF_FILE, default_gguf_path

    path = default_gguf_path()
    ours = load_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=DEFAULT_GGUF_FILE, dtype=torch.float32)
    reference_state = reference.state_dict()
    assert ours.config["tie_word_embeddings"] and "lm_head.weight" not in ours.tensors
    for name in [
        "model.embed_tokens.weight",  # Q8_0
        "model.layers.0.self_attn.q_proj.weight",  # Q4_1, permuted rows
        "model.layers.0.self_attn.k_proj.weight",  # Q4_1, permuted rows, 3 kv heads
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",  # F32
    ]:
        torch.testing.assert_close(ours.tensors[name], reference_state[name].float(), rtol=0, atol=1e-6, msg=name)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "bos_token_id",
    ):
        assert ours.config[key] == getattr(reference.config, key), key


def test_header_reader_agrees_with_gguf_reader() -> None:
    """Our fast header parser reads the shipped file exactly as gguf.GGUFReader does."""
    from executor_svc.loading.gguf_loader import read_gguf
    from executor_svc.loading.model_cache import default_gguf_path

    metadata, infos = read_gguf(default_gguf_path())
    reader = gguf.GGUFReader(str(default_gguf_path()))
    assert metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert [i.name for i in infos] == [t.name for t in reader.tensors]
    for ours, theirs in zip(infos, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(reversed(theirs.shape.tolist())), ours.name
        assert ours.data.tobytes() == theirs.data.tobytes(), ours.name


def test_not_a_gguf_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GgufError, match="not a little-endian GGUF file"):
        load_gguf(tmp_path / "x.gguf")
