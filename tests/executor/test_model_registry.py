"""The model registry: every registered architecture loads, unknown ones are refused by name,
and a family registered by a test (per-layer sliding windows, its own GGUF name) works end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from executor_svc.loading.gguf_loader import GgufError, load_gguf
from executor_svc.loading.model_config import LayerConfig, ModelConfig
from executor_svc.models import llama, registry
from executor_svc.models.registry import GgufSpec, ModelFamily, parse_model_config
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import GREEDY, BlockAllocator, blocks_needed, install_recorder, load_hf
from tests.executor.test_gguf_loader import random_hf_weights, write_tiny_gguf

BLOCK_SIZE = 4
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128)
BUILT_IN = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
GGUF_BUILT_IN = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "olmoe")


def _architecture(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["architectures"][0]


def _runner(folder: Path, **kwargs) -> ModelRunner:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**20)
    return ModelRunner(str(folder), **{**options, **kwargs})


def test_built_in_families_are_registered_in_order():
    assert registry.supported_architectures() == BUILT_IN
    assert registry.gguf_architectures() == GGUF_BUILT_IN


def test_every_registered_architecture_has_a_parity_checkpoint(checkpoints):
    """The transformers-parity tests run every tiny checkpoint; together they cover every registered family."""
    assert {_architecture(folder) for folder in checkpoints.values()} == set(registry.supported_architectures())


@pytest.mark.parametrize("architecture", BUILT_IN)
def test_registered_architecture_reads_exactly_the_checkpoint_tensors(architecture, checkpoints):
    """Config parse + tensor names: the family reads every tensor transformers saved, and no other."""
    folders = [f for f in checkpoints.values() if _architecture(f) == architecture]
    assert folders, f"no tiny checkpoint of {architecture}"
    for folder in folders:
        config = parse_model_config(json.loads((folder / "config.json").read_text()))
        family = registry.get_model_family(config.architecture)
        assert family.architecture == architecture
        with safe_open(str(folder / "model.safetensors"), "pt") as saved:
            names = set(saved.keys())
            assert set(family.tensor_shapes(config)) == names, folder.name
            for name, shape in family.tensor_shapes(config).items():
                assert tuple(saved.get_slice(name).get_shape()) == shape, name


def test_unknown_architecture_is_refused_naming_it_and_the_supported_ones(tmp_path, checkpoints):
    supported = ", ".join(BUILT_IN)
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; supported: {supported}$"):
        parse_model_config({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'"):
        registry.get_model_family("FalconForCausalLM")
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    (folder / "model.safetensors").write_bytes((checkpoints["llama"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; supported: {supported}"):
        _runner(folder)


def test_first_registered_architecture_wins_and_model_type_is_a_fallback():
    both = parse_model_config({**BASE, "architectures": ["GPT2LMHeadModel", "Qwen3ForCausalLM"]})
    assert both.architecture == "Qwen3ForCausalLM"
    assert parse_model_config({**BASE, "model_type": "mistral"}).architecture == "MistralForCausalLM"
    with pytest.raises(ValueError, match="names no architecture"):
        parse_model_config({**BASE, "model_type": "gpt2"})


def test_an_architecture_registers_once():
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is registered already"):
        registry.register_model(llama.LLAMA)


def test_unknown_gguf_architecture_lists_the_supported_ones(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", random_hf_weights(), arch="falcon")
    supported = ", ".join(sorted(GGUF_BUILT_IN))
    with pytest.raises(GgufError, match=rf"unsupported GGUF architecture 'falcon' \(supported: {supported}\)"):
        load_gguf(tmp_path / "x.gguf")


# -- a family registered by the test -------------------------------------------------

TOY = "PagodaToyWindowsForCausalLM"


def parse_toy(config: dict, architecture: str) -> ModelConfig:
    """Qwen2 whose layers from max_window_layers on slide (the built-in Qwen2 entry refuses this)."""
    base = llama.parse_qwen2({**config, "use_sliding_window": False}, architecture)
    first_sliding = int(config["max_window_layers"])
    window = int(config["sliding_window"])
    layers = tuple(LayerConfig(sliding_window=window if i >= first_sliding else None) for i in range(base.num_layers))
    return dataclasses.replace(base, layers=layers)


def _toy_gguf_config(get, config: dict) -> None:
    config["toy_context_length"] = int(get("context_length", 0))


@pytest.fixture()
def toy_family():
    family = ModelFamily(
        TOY,
        "pagoda_toy",
        parse_toy,
        llama.tensor_shapes,
        llama.LlamaModel,
        GgufSpec("pagoda_toy", False, llama.GGUF_BLOCK_TENSORS, llama.GGUF_GLOBAL_TENSORS, _toy_gguf_config),
    )
    registry.register_model(family)
    yield family
    registry.unregister_model(TOY)


@pytest.fixture(scope="module")
def alternating_window_checkpoint(tmp_path_factory) -> Path:
    """A transformers Qwen2 whose layer 0 attends to everything and layer 1 to the last 6 tokens."""
    from tests.executor.conftest import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("toy")
    return make_tiny_checkpoint(root, "qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)


def test_built_in_qwen2_still_refuses_per_layer_windows(alternating_window_checkpoint):
    with pytest.raises(ValueError, match="per-layer sliding windows"):
        _runner(alternating_window_checkpoint)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_toy_family_with_per_layer_windows_matches_transformers(
    backend, toy_family, alternating_window_checkpoint, tmp_path, request
):
    """Registered by the test: its config hook, per-layer windows through the runner and backends, its builder."""
    if backend == "cpp":
        request.getfixturevalue("cpp_kernel")
    hf = load_hf(alternating_window_checkpoint)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    folder = tmp_path / "toy"
    folder.mkdir()
    config = json.loads((alternating_window_checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [TOY]}))
    (folder / "model.safetensors").symlink_to(alternating_window_checkpoint / "model.safetensors")
    runner = _runner(folder, attention_backend=backend, layer_ops=backend)
    assert runner.info.architecture == TOY and runner.config.sliding_windows == (None, 6)
    recorder = install_recorder(runner)
    _chunked_prefill_then_decode(runner, prompt_lens=(11, 17), chunk=5, num_new=4)
    assert len(recorder.records) == 2 * 4
    for token_ids, logits in recorder.records:
        with torch.no_grad():
            expected = hf(torch.tensor([token_ids])).logits[0, -1].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def _chunked_prefill_then_decode(runner: ModelRunner, prompt_lens, chunk: int, num_new: int) -> None:
    """Every prompt prefilled `chunk` tokens a step (later chunks after a cached prefix), then `num_new` decodes."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in prompt_lens]
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    tables = [alloc.take(blocks_needed(len(p) + num_new, BLOCK_SIZE)) for p in prompts]
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    step_id = 0
    while any(len(tokens[i]) - len(prompts[i]) < num_new for i in range(len(prompts))):
        step_id += 1
        new, scheduled = [], []
        for i, prompt in enumerate(prompts):
            if len(tokens[i]) - len(prompt) >= num_new:
                continue
            n = min(chunk, len(tokens[i]) - computed[i])
            if computed[i] == 0:
                new.append(t.NewSequence(i, f"r{i}", tuple(prompt), len(prompt), GREEDY, tables[i], 0, n))
            else:
                scheduled.append(t.ScheduledSequence(i, n))
            computed[i] += n
        out = runner.execute(t.StepPlan(step_id, new_seqs=tuple(new), scheduled_seqs=tuple(scheduled)))
        assert not out.errors, out.errors
        for output in out.outputs:
            tokens[output.seq_id].extend(output.token_ids)


def test_toy_family_loads_from_gguf_under_its_own_name(toy_family, tmp_path):
    """The GGUF side of an entry: its general.architecture, tensor-name maps and config hook."""
    weights = random_hf_weights(seed=5, arch="qwen2")
    model = load_gguf(write_tiny_gguf(tmp_path / "toy.gguf", weights, arch="pagoda_toy"))
    assert (model.config["architectures"], model.config["model_type"]) == ([TOY], "pagoda_toy")
    assert model.config["toy_context_length"] == 256 and model.config["attention_bias"] is True
    assert sorted(model.tensors) == sorted(weights)
    for name, original in weights.items():  # not permuted: the entry says llama.cpp left the rows alone
        np.testing.assert_array_equal(model.tensors[name].numpy(), original, err_msg=name)
