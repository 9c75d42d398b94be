"""Config parsing and checkpoint loading: clear errors, sharded files, dtypes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from executor_svc.models.registry import parse_model_config
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import GREEDY, install_recorder, load_hf, make_tiny_checkpoint

BASE = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    vocab_size=128,
)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        parse_model_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_rope_keys_of_transformers_4_and_5():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 8192
    old = parse_model_config({**BASE, "rope_theta": 5e5, "rope_scaling": llama3})
    new = parse_model_config({**BASE, "rope_parameters": {"rope_theta": 5e5, **llama3}})
    assert old == new and new.rope_theta == 5e5 and new.rope_scaling.rope_type == "llama3"
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        parse_model_config({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_defaults_and_family_switches():
    config = parse_model_config({**BASE, "eos_token_id": [2, 7]})
    assert (config.num_kv_heads, config.head_dim, config.eos_token_ids) == (4, 16, (2, 7))
    qwen2 = parse_model_config(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False}
    )
    assert qwen2.attention_bias and qwen2.sliding_windows == (None, None) and not qwen2.qk_norm
    assert parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"]}).qk_norm
    mistral = parse_model_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 8})
    assert mistral.sliding_windows == (8, 8)


def _corrupt(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama")
    _corrupt(folder, lambda ts: ts.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        ModelRunner(str(folder), dtype="float32", device="cpu", kv_cache_memory_bytes=2**20)


def test_wrong_shape_is_named(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama")
    _corrupt(folder, lambda ts: ts.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[63\], expected \[64\]"):
        ModelRunner(str(folder), dtype="float32", device="cpu", kv_cache_memory_bytes=2**20)


def _greedy(runner, prompt, num_new):
    install_recorder(runner)
    runner.execute(
        t.StepPlan(
            1, new_seqs=(t.NewSequence(1, "r", tuple(prompt), len(prompt), GREEDY, tuple(range(8)), 0, len(prompt)),)
        )
    )
    for step in range(num_new - 1):
        runner.execute(t.StepPlan(step + 2, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
    return runner._seqs[1].token_ids[len(prompt) :]


def test_sharded_checkpoint_with_index(tmp_path, checkpoints):
    """A many-file checkpoint (model.safetensors.index.json) gives the same tokens."""
    hf = load_hf(checkpoints["qwen2"])
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    options = dict(dtype="float32", device="cpu", block_size=4, kv_cache_memory_bytes=2**20)
    one = _greedy(ModelRunner(str(checkpoints["qwen2"]), **options), [4, 8, 15, 16, 23], 8)
    many = _greedy(ModelRunner(str(sharded), **options), [4, 8, 15, 16, 23], 8)
    assert one == many and len(one) == 8


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        ("bfloat16", "auto"),
        ("float32", "bfloat16"),
        ("float16", "auto"),
        ("float32", "int8"),
        ("bfloat16", "int8"),
        ("float16", "int8"),
    ],
)
def test_reduced_precision_logits_close_to_fp32(checkpoints, dtype, kv_dtype):
    """bf16 / fp16 weights, or a bf16 or int8 KV cache, stay close to HF fp32."""
    _check_close_to_fp32(checkpoints, dtype, kv_dtype, "auto")


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_int8_kv_cache_close_to_fp32_and_a_logged_fallback_on_torch(checkpoints, backend, request):
    """The documented fallback: the torch backend dequantizes an int8 cache as it gathers it (correct, and it
    says so at start); the C++ kernels read int8 and log no fallback."""
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    with capture_logs() as logs:
        _check_close_to_fp32(checkpoints, "float32", "int8", backend)
    fallbacks = [entry for entry in logs if entry["event"] == "kv_cache_int8_fallback"]
    assert len(fallbacks) == (backend == "torch")


def _check_close_to_fp32(checkpoints, dtype: str, kv_dtype: str, backend: str) -> None:
    hf = load_hf(checkpoints["llama"])
    runner = ModelRunner(
        str(checkpoints["llama"]),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        device="cpu",
        block_size=4,
        kv_cache_memory_bytes=2**20,
        attention_backend=backend,
    )
    assert runner.backend.name == backend or backend == "auto"
    assert runner.info.kv_cache_dtype == (dtype if kv_dtype == "auto" else kv_dtype)
    recorder = install_recorder(runner)
    prompt = [4, 8, 15, 16, 23, 42, 7]
    runner.execute(t.StepPlan(1, new_seqs=(t.NewSequence(1, "r", tuple(prompt), 7, GREEDY, (3, 1), 0, 7),)))
    runner.execute(t.StepPlan(2, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
    for token_ids, logits in recorder.records:
        with torch.no_grad():
            expected = hf(torch.tensor([token_ids])).logits[0, -1]
        assert (logits - expected).abs().max() < 0.1
