"""GGUF files of the new families, written as llama.cpp's converter writes them, against transformers.

Each tiny transformers checkpoint is written to GGUF under the names
gguf-py's own ``TensorNameMap`` gives (llama.cpp's mapping, not ours), with
llama.cpp's conventions (experts stacked [E, ...], Gemma's norms plus one,
Phi-3's LongRoPE factors as tensors, Mixtral as "llama" with permuted q/k)
and metadata keys; loaded back, the executor's logits equal transformers' on
the original checkpoint within 1e-4.
"""

from __future__ import annotations

import math
import pathlib

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from executor_svc.loading.gguf_loader import load_gguf
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import (
    GREEDY,
    BlockAllocator,
    blocks_needed,
    install_recorder,
    load_hf,
    long_rope,
    make_tiny_checkpoint,
)
from tests.executor.test_gguf_loader import SPECIALS, byte_alphabet, llama_cpp_permute
from tests.executor.test_model_hf_parity import mixed_step_prompts

# ARCHS key -> (general.architecture, gguf-py's MODEL_ARCH, checkpoint overrides llama.cpp can represent).
CASES = {
    # llama.cpp scales Gemma's queries by head_dim (query_pre_attn_scalar is not in the file).
    "gemma2": ("gemma2", gguf.MODEL_ARCH.GEMMA2, dict(query_pre_attn_scalar=24)),
    "gemma3": ("gemma3", gguf.MODEL_ARCH.GEMMA3, dict(query_pre_attn_scalar=48)),
    "phi3": ("phi3", gguf.MODEL_ARCH.PHI3, {}),
    "mixtral": ("llama", gguf.MODEL_ARCH.LLAMA, {}),
    # llama.cpp's qwen3moe has no dense layers.
    "qwen3_moe": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE, dict(mlp_only_layers=[])),
    "olmoe": ("olmoe", gguf.MODEL_ARCH.OLMOE, {}),
}


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors ``...experts.<e>.<w>.weight`` stacked into ``...experts.<w>.weight`` [E, ...]."""
    stacked: dict[str, list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            stacked.setdefault(".".join(parts[: i + 1] + parts[i + 2 :]), []).append((int(parts[i + 1]), tensor))
        else:
            out[name] = tensor
    for name, items in stacked.items():
        out[name] = torch.stack([tensor for _, tensor in sorted(items, key=lambda item: item[0])])
    return out


def _metadata(writer: gguf.GGUFWriter, hf_config, arch: str) -> None:
    """What llama.cpp's converter writes for these families."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in c.layer_types])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
        writer.add_sliding_window(0)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)


def _tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    tokens = SPECIALS + byte_alphabet()[: vocab_size - len(SPECIALS)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("olmo")  # GPT-2's regex, under the name llama.cpp gives OLMo's
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_like_llama_cpp(folder: pathlib.Path, path: pathlib.Path, arch: str, model_arch) -> pathlib.Path:
    """The checkpoint in ``folder`` as llama.cpp's converter would write it (F32)."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(folder)
    tensors = _stack_experts(load_file(str(folder / "model.safetensors")))
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, hf_config, arch)
    _tokenizer(writer, hf_config.vocab_size)
    names = gguf.TensorNameMap(model_arch, hf_config.num_hidden_layers)
    for hf_name, tensor in tensors.items():
        array = tensor.float().numpy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1  # llama.cpp's Gemma norm multiplies by the weight alone
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in hf_name else hf_config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), array)
    if arch == "phi3":
        rope = hf_config.rope_parameters
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", sorted(CASES))
def test_gguf_file_loads_as_the_checkpoint_and_matches_transformers(arch, tmp_path):
    gguf_arch, model_arch, overrides = CASES[arch]
    folder = make_tiny_checkpoint(tmp_path, arch, **overrides)
    path = write_like_llama_cpp(folder, tmp_path / f"{arch}.gguf", gguf_arch, model_arch)
    loaded = load_gguf(path)
    original = load_file(str(folder / "model.safetensors"))
    assert loaded.config["architectures"] == load_hf(folder).config.architectures
    assert sorted(loaded.tensors) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(loaded.tensors[name], tensor, atol=1e-6, rtol=0, msg=name)
    _assert_logits_match(path, folder)


def _assert_logits_match(path: pathlib.Path, folder: pathlib.Path) -> None:
    """The runner on the GGUF file, one step of the parity prompts, against transformers on the folder."""
    hf = load_hf(folder)
    runner = ModelRunner(str(path), dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**21)
    recorder = install_recorder(runner)
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    prompts = mixed_step_prompts()
    new = tuple(
        t.NewSequence(
            i, f"r{i}", tuple(p), len(p), GREEDY, alloc.take(blocks_needed(len(p) + 1, 4)), 0, len(p),
            long_rope=long_rope(runner, len(p)),
        )
        for i, p in enumerate(prompts)
    )  # fmt: skip
    assert not runner.execute(t.StepPlan(1, new_seqs=new)).errors
    assert len(recorder.records) == len(prompts)
    for token_ids, logits in recorder.records:
        with torch.no_grad():
            expected = hf(torch.tensor([token_ids])).logits[0, -1].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_gguf_config_of_gemma2_and_phi3(tmp_path):
    """Caps, windows, the scale llama.cpp implies, and LongRoPE rebuilt from its tensors."""
    gemma = make_tiny_checkpoint(tmp_path, "gemma2", query_pre_attn_scalar=24)
    config = load_gguf(write_like_llama_cpp(gemma, tmp_path / "g.gguf", "gemma2", gguf.MODEL_ARCH.GEMMA2)).config
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (1.5, 2.0)
    assert (config["sliding_window"], config["layer_types"]) == (6, ["sliding_attention", "full_attention"])
    assert (config["query_pre_attn_scalar"], config["head_dim"]) == (24, 24)
    phi3 = make_tiny_checkpoint(tmp_path, "phi3")
    config = load_gguf(write_like_llama_cpp(phi3, tmp_path / "p.gguf", "phi3", gguf.MODEL_ARCH.PHI3)).config
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4
    assert scaling["long_factor"] == pytest.approx([1.0 + 0.5 * i for i in range(12)])
    assert config["sliding_window"] is None and not math.isnan(config["rope_theta"])


def test_llama_file_without_experts_is_still_llama(tmp_path):
    """Mixtral shares general.architecture "llama": only a file with experts is Mixtral."""
    from tests.executor.test_gguf_loader import random_hf_weights, write_tiny_gguf

    plain = load_gguf(write_tiny_gguf(tmp_path / "plain.gguf", random_hf_weights()))
    assert plain.config["architectures"] == ["LlamaForCausalLM"]
    folder = make_tiny_checkpoint(tmp_path, "mixtral")
    moe = load_gguf(write_like_llama_cpp(folder, tmp_path / "moe.gguf", "llama", gguf.MODEL_ARCH.LLAMA))
    assert moe.config["architectures"] == ["MixtralForCausalLM"]
    assert (moe.config["num_local_experts"], moe.config["num_experts_per_tok"]) == (8, 2)
