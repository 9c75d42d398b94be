"""Tiny random checkpoints (saved with transformers) and plan-building helpers."""

from __future__ import annotations

import random
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
}


def make_tiny_checkpoint(tmp_path: Path, arch: str, **overrides) -> Path:
    """Builds a tiny random checkpoint of ``arch`` (a key of ARCHS) with transformers."""
    import transformers

    class_name, arch_overrides = ARCHS[arch]
    config = getattr(transformers, class_name)(**{**TINY, **arch_overrides, **overrides})
    torch.manual_seed(hash(arch) % 1000)
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

    def __call__(self, logits, requests, argmax=None):
        from executor_svc.sampler import sample

        for row, request in zip(logits, requests):
            self.records.append((list(request.token_ids), row.clone()))
        return sample(logits, requests, argmax)


def install_recorder(runner) -> LogitsRecorder:
    """Records the logits the runner hands to the sampler."""
    from executor_svc.sampler import SampleRequest

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
    """The kernels' ops, skipping the test unless the loaded variant has `feature` (avx512, avx512_bf16, amx)."""
    from executor_svc.native import loader

    kernels = loader.kernels()
    if kernels is None or feature not in kernels.features or (feature == "amx" and not kernels.ops.amx_ready()):
        pytest.skip(reason)
    return kernels.ops
