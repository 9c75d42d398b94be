"""Tiny random checkpoints (saved with transformers) and plan-building helpers."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch

from pagoda.params import SamplingParams

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config class name, overrides); covers every switch of the family.
ARCHS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama_head_dim": ("LlamaConfig", dict(head_dim=24, num_key_value_heads=1)),
    "mistral_window": ("MistralConfig", dict(sliding_window=6, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    # Gemma 2: GQA 3, head_dim 24, a scale that is not head_dim's, layer 0 slides over 6 tokens, caps small
    # enough to bend the scores and logits (test_families checks they do).
    "gemma2": (
        "Gemma2Config",
        dict(
            hidden_size=72,
            num_attention_heads=6,
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=6,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=2.0,
        ),
    ),
    # Gemma 3: q/k norms, head_dim 48, GQA 4, a local RoPE on the sliding layer and a scaled global one.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_key_value_heads=1,
            head_dim=48,
            query_pre_attn_scalar=32,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            },
        ),
    ),
    # Phi-3: fused qkv and gate_up, GQA 3, head_dim 24, LongRoPE: every sequence here is past the original
    # length (4), so transformers uses the long factors, as the plans ask (``long_rope``; test_longrope: the
    # short ones and the switch).
    "phi3": (
        "Phi3Config",
        dict(
            hidden_size=144,  # transformers sizes the LongRoPE factors by hidden / heads, not head_dim
            num_attention_heads=6,
            pad_token_id=0,
            original_max_position_embeddings=4,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(12)],
                "long_factor": [1.0 + 0.5 * i for i in range(12)],
                "original_max_position_embeddings": 4,
            },
        ),
    ),
    # Mixtral: 8 experts, top-2 renormalised; GQA 3, head_dim 24.
    "mixtral": (
        "MixtralConfig",
        dict(hidden_size=72, num_attention_heads=6, head_dim=24, num_local_experts=8, num_experts_per_tok=2),
    ),
    # Qwen3-MoE: 4 experts of 40, top-2 renormalised, layer 1 dense (mlp_only_layers); q/k norms, head_dim 24.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=72,
            num_attention_heads=6,
            head_dim=24,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # OLMoE: 8 experts, top-2 not renormalised, q/k norms over all heads.
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, pad_token_id=0)),
}
# The mixture-of-experts entries.
MOE_ARCHS = ("mixtral", "qwen3_moe", "olmoe")


def make_tiny_checkpoint(tmp_path: Path, arch: str, **overrides) -> Path:
    """Builds a tiny random checkpoint of ``arch`` (a key of ARCHS) with transformers."""
    import transformers

    class_name, arch_overrides = ARCHS[arch]
    config = getattr(transformers, class_name)(**{**TINY, **arch_overrides, **overrides})
    torch.manual_seed(zlib.crc32(arch.encode()) % 1000)  # the same weights in every session
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    folder = tmp_path / arch
    model.save_pretrained(folder)
    return folder


def load_hf(folder: Path):
    """The transformers oracle for a checkpoint folder, fp32, eager attention, no EOS stop."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


class LogitsRecorder:
    """Wraps the real sampler, recording each request's tokens and logits row."""

    def __init__(self):
        self.records: list[tuple[list[int], torch.Tensor]] = []

    def __call__(self, logits, requests, argmax=None, masks=None):
        from executor_svc.sampling.sampler import sample

        for row, request in zip(logits, requests):
            self.records.append((list(request.token_ids), row.clone()))
        return sample(logits, requests, argmax, masks)


def install_recorder(runner) -> LogitsRecorder:
    """Records the logits the runner hands to the sampler."""
    from executor_svc.sampling.sampler import SampleRequest

    recorder = LogitsRecorder()
    runner._sample_fn = (recorder, SampleRequest)
    return recorder


class BlockAllocator:
    """Hands out shuffled block ids, so tables are not contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> tuple[int, ...]:
        taken, self.free = self.free[:n], self.free[n:]
        return tuple(taken)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def long_rope(runner, num_tokens: int) -> bool:
    """NewSequence.long_rope of a sequence of num_tokens known tokens, as the scheduler sets it: LongRoPE's long
    factors past the runner's switch (the tiny Phi-3's 4 tokens: every test sequence), else the short ones."""
    return 0 < runner.info.rope_switch_len < num_tokens


GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every tiny architecture, saved once per session."""
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_checkpoint(root, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def cpp_kernel():
    """``torch.ops.pagoda`` of the installed C++ kernels; skips only where there is no compiler to build them."""
    import shutil

    from executor_svc.native import loader

    kernels = loader.kernels()
    if kernels is None:
        if not shutil.which("c++"):
            pytest.skip("the C++ kernels are not installed and there is no compiler (make install builds them)")
        pytest.fail("the C++ kernels did not load although a compiler is present: see the make install output")
    return kernels.ops


def native_ops(feature: str, reason: str):
    """The kernels' ops, skipping the test unless the loaded variant has `feature` (avx512, avx512_bf16, amx; or
    bf16: the bf16 panel GEMM and prefill kernel run here, on AMX tiles or AVX512-BF16 dot products)."""
    from executor_svc.native import loader

    kernels = loader.kernels()
    if feature == "bf16":
        if kernels is None or not kernels.ops.bf16_kernels_ready():
            pytest.skip(reason)
        return kernels.ops
    if kernels is None or feature not in kernels.features or (feature == "amx" and not kernels.ops.amx_ready()):
        pytest.skip(reason)
    return kernels.ops
