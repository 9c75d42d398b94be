"""Reading and checking LoRA adapters (executor_svc.lora): each refusal names its problem; scales; the device
layout's deltas against a per-module reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from executor_svc.lora.adapter import load_adapter
from executor_svc.lora.batch import LoraStepState, adapter_segments
from executor_svc.lora.errors import LoraAdapterError
from executor_svc.lora.peft_format import module_scale
from executor_svc.lora.weights import to_device
from executor_svc.models.layer_ops import TorchLayerOps
from executor_svc.models.registry import parse_model_config

# The tiny Llama's modules (conftest.TINY: hidden 64, 4 heads, 2 KV heads of 16, intermediate 96): (out, in).
LLAMA_SHAPES = {
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (32, 64),
    "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (96, 64),
    "mlp.up_proj": (96, 64),
    "mlp.down_proj": (64, 96),
}
PREFIX = "base_model.model.model.layers"


def random_pairs(modules, rank: int, layers=(0, 1), shapes=LLAMA_SHAPES, seed: int = 0) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A [r, in] / lora_B [out, r] tensors of ``modules`` in ``layers``."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for module in modules:
            out_features, in_features = shapes[module]
            tensors[f"{PREFIX}.{layer}.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.3
            tensors[f"{PREFIX}.{layer}.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.3
    return tensors


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """A PEFT adapter folder: adapter_config.json (r 4, alpha 8 unless given) and adapter_model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **config}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def model_config(checkpoint: Path):
    return parse_model_config(json.loads((checkpoint / "config.json").read_text()))


def bad_adapters(root: Path) -> dict[str, tuple[Path, str]]:
    """Kinds of bad adapter for the tiny Llama -> (folder, what the error must say)."""
    q = ["self_attn.q_proj"]
    cases: dict[str, tuple[Path, str]] = {}

    def case(kind, expected, tensors=None, **config):
        cases[kind] = (
            write_adapter(root / kind, random_pairs(q, 4) if tensors is None else tensors, **config),
            expected,
        )

    case("rank above the limit", "rank 16 is above the limit of 8", random_pairs(q, 16), r=16)
    case("unsupported target", "unsupported target module 'self_attn.qkv_proj'", _renamed(q, "qkv_proj"))
    lm_head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    case("lm head", "tensor base_model.model.lm_head.lora_A.weight", lm_head)
    case("shape", "do not fit the base model's layer, 64 in and 64 out", random_pairs(q, 4, shapes={q[0]: (64, 72)}))
    case("layer out of range", "layer 2 is out of range: the base model has 2 layers", random_pairs(q, 4, (2,)))
    case("DoRA", "use_dora is not supported", use_dora=True)
    case("expert weights", "target_parameters is not supported", target_parameters=["experts.gate_up_proj"])
    case("trained bias", "bias 'all' is not supported", bias="all")
    case("saved modules", "modules_to_save is not supported", modules_to_save=["lm_head"])
    case("not LoRA", "peft_type 'LOHA' is not supported", peft_type="LOHA")
    case("PiSSA unconverted", "init_lora_weights 'pissa'", init_lora_weights="pissa")
    case("rank not the config's", "lora_A has rank 4, but adapter_config.json says r = 2", r=2)
    case("bad pattern", "alpha_pattern key '(' is not a regular expression", alpha_pattern={"(": 3})
    half = {k: v for k, v in random_pairs(q, 4).items() if "lora_A" in k}
    case("half a pair", "model.layers.0.self_attn.q_proj: no lora_B tensor", half)
    nan = {k: v.fill_(math.nan) if "layers.1" in k else v for k, v in random_pairs(q, 4).items()}
    case("not finite", "model.layers.1.self_attn.q_proj: lora_A or lora_B holds values that are not finite", nan)
    cases["no weights"] = (_config_only(root / "bin", "adapter_model.bin"), "save it as safetensors")
    cases["not safetensors"] = (_config_only(root / "junk", "adapter_model.safetensors"), "not a safetensors file")
    cases["no config"] = (_weights_only(root / "noconfig"), "no adapter_config.json")
    cases["missing"] = (root / "missing", "not a directory")
    return cases


def _renamed(modules, name: str) -> dict[str, torch.Tensor]:
    return {k.replace(modules[0].split(".")[1], name): v for k, v in random_pairs(modules, 4).items()}


def _config_only(folder: Path, junk_file: str) -> Path:
    write_adapter(folder, random_pairs(["self_attn.q_proj"], 4))
    (folder / "adapter_model.safetensors").unlink()
    (folder / junk_file).write_bytes(b"\x80\x04 not a safetensors header")
    return folder


def _weights_only(folder: Path) -> Path:
    write_adapter(folder, random_pairs(["self_attn.q_proj"], 4))
    (folder / "adapter_config.json").unlink()
    return folder


def test_each_bad_adapter_is_refused_naming_its_problem(checkpoints, tmp_path):
    config = model_config(checkpoints["llama"])
    for kind, (folder, expected) in bad_adapters(tmp_path).items():
        with pytest.raises(LoraAdapterError) as error:
            load_adapter(folder, config, max_rank=8)
        assert expected in str(error.value), kind


def test_targets_follow_each_familys_tensor_names(checkpoints, tmp_path):
    """Phi-3 adapts its fused qkv_proj / gate_up_proj (as transformers names them) and refuses q_proj; a
    mixture-of-experts layer refuses MLP modules while Qwen3-MoE's dense layer 1 takes them."""
    phi3 = model_config(checkpoints["phi3"])  # hidden 144, 6 heads of 24, 2 KV heads, intermediate 96
    fused = {"self_attn.qkv_proj": (144 + 2 * 48, 144), "mlp.gate_up_proj": (192, 144)}
    adapter = load_adapter(write_adapter(tmp_path / "phi3", random_pairs(fused, 4, shapes=fused)), phi3, 8)
    assert {(m.target.linear, m.target.column_start) for m in adapter.modules.values()} == {("qkv", 0), ("gate_up", 0)}
    split = random_pairs(["self_attn.q_proj"], 4, shapes={"self_attn.q_proj": (144, 144)})
    with pytest.raises(LoraAdapterError, match="unsupported target module 'self_attn.q_proj'.*self_attn.qkv_proj"):
        load_adapter(write_adapter(tmp_path / "phi3_split", split), phi3, 8)
    qwen3_moe = model_config(checkpoints["qwen3_moe"])  # hidden 72, intermediate 96 in the dense layer 1
    mlp = {"mlp.gate_proj": (96, 72), "mlp.down_proj": (72, 96)}
    dense = load_adapter(write_adapter(tmp_path / "dense", random_pairs(mlp, 4, (1,), shapes=mlp)), qwen3_moe, 8)
    assert dense.target_modules == ("mlp.down_proj", "mlp.gate_proj")
    with pytest.raises(LoraAdapterError, match="layer 0 is a mixture of experts"):
        load_adapter(write_adapter(tmp_path / "moe", random_pairs(mlp, 4, (0,), shapes=mlp)), qwen3_moe, 8)


def test_scales_follow_peft():
    """alpha / r, alpha / sqrt(r) with rsLoRA; rank_pattern and alpha_pattern keys match at a dot, as PEFT."""
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"layers.1.self_attn.q_proj": 3}}
    assert module_scale(config, 0, "self_attn.q_proj", 4) == 2.0
    assert module_scale(config, 1, "self_attn.q_proj", 4) == 0.75
    assert module_scale(config, 0, "self_attn.v_proj", 2) == 4.0
    with pytest.raises(LoraAdapterError, match="says r = 4"):
        module_scale({**config, "rank_pattern": {"_proj": 2}}, 0, "self_attn.v_proj", 2)  # "_proj" is no full name
    assert module_scale({**config, "use_rslora": True}, 0, "self_attn.k_proj", 4) == 4.0


def test_deltas_land_in_each_modules_columns(checkpoints, tmp_path):
    """Adapter 1 adapts q and v (not k) at ranks 4 and 2 and down; adapter 2 only up. Each segment's rows get
    scale * x A^T B^T in its modules' columns of the fused layers, the other rows and columns nothing."""
    config = model_config(checkpoints["llama"])
    first = random_pairs(["self_attn.q_proj", "mlp.down_proj"], 4) | random_pairs(["self_attn.v_proj"], 2, seed=1)
    adapters = [
        load_adapter(write_adapter(tmp_path / "a", first, rank_pattern={"v_proj": 2}), config, 8),
        load_adapter(write_adapter(tmp_path / "b", random_pairs(["mlp.up_proj"], 4, seed=2), lora_alpha=2), config, 8),
    ]
    ops = TorchLayerOps()
    resident = [to_device(n, a, 2, ops.pack, torch.float32, torch.device("cpu")) for n, a in zip("ab", adapters)]
    # Rows 0-1 base, 2-4 adapter a, 5 base, 6-7 adapter b.
    deltas = LoraStepState([(resident[0], 2, 5), (resident[1], 6, 8)], ops.linear)
    a_rows, b_rows = [2, 3, 4], [6, 7]
    for linear, width, inputs, rows_moved in (
        ("qkv", 128, 64, a_rows),
        ("gate_up", 192, 64, b_rows),
        ("down", 64, 96, a_rows),
    ):
        x = torch.randn(8, inputs)
        out = torch.zeros(8, width)
        deltas.add(1, linear, x, out)
        expected = torch.zeros(8, width)
        for rows, adapter in ((slice(2, 5), adapters[0]), (slice(6, 8), adapters[1])):
            for (layer, _), module in adapter.modules.items():
                if layer == 1 and module.target.linear == linear:
                    start = module.target.column_start
                    cols = slice(start, start + module.target.out_features)
                    expected[rows, cols] += module.scale * (x[rows] @ module.a.T) @ module.b.T
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert out.any(dim=1).nonzero().flatten().tolist() == rows_moved
        if linear == "qkv":
            assert not out[:, 64:96].any()  # k: adapted by neither
    assert deltas.targets(0, "qkv") and not deltas.targets(0, "o_proj")


def test_segments_group_runs_of_one_adapter_and_skip_the_base():
    rows = [(None, 1), ("a", 1), ("a", 1), ("b", 1), (None, 2), ("a", 5), ("a", 3), (None, 4)]
    assert adapter_segments(rows) == (("a", 1, 3), ("b", 3, 4), ("a", 6, 14))
    assert adapter_segments([(None, 3)]) == ()
