"""What the parity table alone would not show for Gemma, Phi-3 and the mixtures of experts.

The parity tests (test_model_hf_parity) run every tiny checkpoint against
transformers. Here: that their prompts do exercise Gemma 2's caps and windows
and hit every expert (else those tests could pass with the feature ignored);
Phi-3's short LongRoPE factors; Gemma on every bf16 path the executor picks,
head_dim 256 included; config parsing of hub-style configs; and refusals that
name the unsupported feature.
"""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.models.registry import parse_model_config
from executor_svc.native.active import active_kernels
from executor_svc.runner.model_runner import ModelRunner
from pagoda import step as t
from tests.executor.conftest import (
    GREEDY,
    MOE_ARCHS,
    BlockAllocator,
    blocks_needed,
    install_recorder,
    load_hf,
    make_tiny_checkpoint,
)
from tests.executor.test_model_hf_parity import greedy_prompts, mixed_step_prompts

BLOCK_SIZE = 4


def _runner(folder, **kwargs) -> ModelRunner:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, kv_cache_memory_bytes=2**21)
    return ModelRunner(str(folder), **{**options, **kwargs})


def _hf_logits(hf, token_ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0, -1].float()


def _hf_variant(folder, **overrides):
    """transformers on the same weights with some config values changed."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


# -- the parity prompts exercise what they are meant to ----------------------------------------


def test_gemma2_parity_prompts_bend_under_caps_and_windows(checkpoints):
    """Without the attention cap, the final cap or the window, transformers' own logits on the parity
    prompts (longer than the 6-token window) move by far more than the 1e-4 the parity test allows."""
    folder = checkpoints["gemma2"]
    reference = [_hf_logits(load_hf(folder), p) for p in mixed_step_prompts()]
    variants = {
        "attn_logit_softcapping": dict(attn_logit_softcapping=None),
        "final_logit_softcapping": dict(final_logit_softcapping=None),
        "sliding_window": dict(layer_types=["full_attention", "full_attention"]),
    }
    for name, overrides in variants.items():
        hf = _hf_variant(folder, **overrides)
        moved = max((_hf_logits(hf, p) - ref).abs().max().item() for p, ref in zip(mixed_step_prompts(), reference))
        assert moved > 1e-2, name


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_parity_prompts_hit_every_expert(arch, checkpoints):
    """transformers' own routers, on the parity tests' prompts, pick every expert of every MoE layer."""
    hf = load_hf(checkpoints[arch])
    chosen: dict[str, set[int]] = {}
    routers = [(name, m) for name, m in hf.named_modules() if type(m).__name__.endswith("TopKRouter")]
    assert routers, "no router modules found"
    for name, module in routers:
        module.register_forward_hook(
            lambda mod, args, out, name=name: chosen.setdefault(name, set()).update(out[2].flatten().tolist())
        )
    for prompt in mixed_step_prompts() + greedy_prompts():
        _hf_logits(hf, prompt)
    num_experts = routers[0][1].num_experts
    assert {name: len(ids) for name, ids in chosen.items()} == {name: num_experts for name, _ in routers}


# -- Phi-3's short factors -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def phi3_short(tmp_path_factory):
    """Phi-3 whose original length (64) holds the whole test: transformers keeps the short factors."""
    root = tmp_path_factory.mktemp("phi3-short")
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(12)],
        "long_factor": [1.0 + 0.5 * i for i in range(12)],
        "original_max_position_embeddings": 64,
    }
    return make_tiny_checkpoint(root, "phi3", original_max_position_embeddings=64, rope_scaling=scaling)


def test_phi3_short_factors_when_serving_within_the_original_length(phi3_short):
    """max_model_len 64 = the original length: short factors, 40 greedy tokens equal to generate; served at
    256, a sequence within 64 tokens keeps the short factors (test_longrope: the long ones past them)."""
    hf = load_hf(phi3_short)
    prompt = greedy_prompts()[1]
    runner = _runner(phi3_short, max_model_len=64)
    got = _generate_one(runner, prompt, 40)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :]
    assert got == expected.tolist()
    within, served_longer = (_first_logits(_runner(phi3_short, max_model_len=n), prompt) for n in (64, 256))
    torch.testing.assert_close(within, _hf_logits(hf, prompt), atol=1e-4, rtol=0)
    torch.testing.assert_close(served_longer, within, atol=1e-5, rtol=0)


def _first_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    recorder = install_recorder(runner)
    blocks = BlockAllocator(runner.info.num_kv_blocks).take(blocks_needed(len(prompt) + 1, BLOCK_SIZE))
    new = t.NewSequence(1, "r1", tuple(prompt), len(prompt), GREEDY, blocks, 0, len(prompt))
    assert not runner.execute(t.StepPlan(1, new_seqs=(new,))).errors
    return recorder.records[0][1]


def _generate_one(runner: ModelRunner, prompt: list[int], num_new: int) -> list[int]:
    """Prefill in one step, then decode: the tokens the runner samples."""
    blocks = BlockAllocator(runner.info.num_kv_blocks).take(blocks_needed(len(prompt) + num_new, BLOCK_SIZE))
    new = t.NewSequence(1, "r1", tuple(prompt), len(prompt), GREEDY, blocks, 0, len(prompt))
    tokens = list(runner.execute(t.StepPlan(1, new_seqs=(new,))).outputs[0].token_ids)
    while len(tokens) < num_new:
        tokens += (
            runner.execute(t.StepPlan(len(tokens) + 1, scheduled_seqs=(t.ScheduledSequence(1, 1),)))
            .outputs[0]
            .token_ids
        )
    return tokens


# -- Gemma on the bf16 paths ---------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 256])
def test_gemma2_bf16_on_every_path_the_executor_picks(head_dim, tmp_path, cpp_kernel):
    """bf16 runners on the C++ backend (AMX prefill where the CPU has it, with windows and caps; the decode
    kernel) and on torch agree with transformers in fp32 to bf16 precision; the scale is
    query_pre_attn_scalar's (logits with head_dim's instead differ by far more)."""
    folder = make_tiny_checkpoint(
        tmp_path, "gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=17
    )
    hf = load_hf(folder)
    prompts = mixed_step_prompts()
    expected = [_hf_logits(hf, p) for p in prompts]
    for backend in ("cpp", "torch"):
        runner = _runner(folder, dtype="bfloat16", attention_backend=backend, layer_ops=backend, block_size=16)
        if backend == "cpp" and cpp_kernel.bf16_kernels_ready():
            assert active_kernels(runner)["prefill"] == ("amx-flash" if cpp_kernel.amx_ready() else "avx512bf16-flash")
        records = _chunked_logits(runner, prompts)
        assert sorted(token_ids for token_ids, _ in records) == sorted(prompts)
        for token_ids, logits in records:
            diff = (logits - expected[prompts.index(token_ids)]).abs().max().item()
            assert diff < 0.06, (backend, diff)
    wrong_scale = _hf_variant(folder, query_pre_attn_scalar=head_dim)
    assert max((_hf_logits(wrong_scale, p) - e).abs().max().item() for p, e in zip(prompts, expected)) > 0.1


def _chunked_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Every prompt prefilled in chunks of 9 (later chunks after a cached prefix); the logits of each prompt."""
    recorder = install_recorder(runner)
    alloc = BlockAllocator(runner.info.num_kv_blocks)
    tables = [alloc.take(blocks_needed(len(p) + 1, runner.block_size)) for p in prompts]
    computed = [0] * len(prompts)
    step_id = 0
    while any(c < len(p) for c, p in zip(computed, prompts)):
        step_id += 1
        new, scheduled = [], []
        for i, prompt in enumerate(prompts):
            n = min(9, len(prompt) - computed[i])
            if computed[i] == 0:
                new.append(t.NewSequence(i, f"r{i}", tuple(prompt), len(prompt), GREEDY, tables[i], 0, n))
            elif n:
                scheduled.append(t.ScheduledSequence(i, n))
            computed[i] += n
        assert not runner.execute(t.StepPlan(step_id, new_seqs=tuple(new), scheduled_seqs=tuple(scheduled))).errors
    return recorder.records


# -- config parsing and refusals -----------------------------------------------------------------

BASE = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=96, vocab_size=128)


def test_gemma3_hub_config_of_transformers_4():
    """rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern, as Gemma 3 checkpoints ship."""
    config = parse_model_config(
        {
            **BASE,
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 256,
            "sliding_window": 512,
            "sliding_window_pattern": 3,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 256,
        }
    )
    assert config.sliding_windows == (512, 512, None, 512, 512, None)
    local, full = config.layer_rope(0), config.layer_rope(2)
    assert (local[0], local[1].rope_type) == (10_000.0, "default")
    assert (full[0], full[1].rope_type, full[1].factor) == (1_000_000.0, "linear", 8.0)
    assert config.qk_norm and config.hidden_act == "gelu_pytorch_tanh" and config.final_logit_softcap is None


def test_gemma2_layer_types_default_and_caps():
    config = parse_model_config(
        {**BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096, "attn_logit_softcapping": 50.0}
    )
    assert config.sliding_windows == (4096, None) * 3
    assert {layer.logit_softcap for layer in config.layers} == {50.0}


def test_qwen3_moe_sparse_step_and_dense_layers():
    config = parse_model_config(
        {
            **BASE,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert [layer.moe for layer in config.layers] == [False, True, False, False, False, True]
    assert (config.num_experts, config.norm_topk_prob) == (8, False)


def test_phi3_su_is_longrope():
    factors = [1.0] * 8
    config = parse_model_config(
        {
            **BASE,
            "architectures": ["Phi3ForCausalLM"],
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "short_factor": factors, "long_factor": factors},
        }
    )
    scaling = config.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings, scaling.factor) == ("longrope", 4096, 32.0)
    assert scaling.attention_factor == pytest.approx(
        (1 + torch.log(torch.tensor(32.0)).item() / torch.log(torch.tensor(4096.0)).item()) ** 0.5
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            {"architectures": ["OlmoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0},
            "clip_qkv 8.0",
        ),
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
        ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "hidden activation 'relu'"),
        (
            {"architectures": ["Gemma2ForCausalLM"], "layer_types": ["chunked_attention"] * 6},
            "layer type 'chunked_attention'",
        ),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            "unsupported architecture 'Gemma3ForConditionalGeneration'",
        ),
        (
            {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn'",
        ),
    ],
)
def test_unsupported_features_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config({**BASE, **config})


def test_runner_refuses_an_unsupported_feature_at_start(checkpoints, tmp_path):
    """The refusal comes at start, before any weight is read, naming the feature."""
    folder = tmp_path / "olmoe"
    folder.mkdir()
    config = json.loads((checkpoints["olmoe"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    (folder / "model.safetensors").symlink_to(checkpoints["olmoe"] / "model.safetensors")
    with pytest.raises(ValueError, match="unsupported clip_qkv 8.0"):
        _runner(folder)
