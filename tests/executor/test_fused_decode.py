"""Decode-only steps through every layer in one C++ call (models/fused_decode.py): the Python loop's bits.

Each case prefills a few sequences of different lengths, then runs the same
decode step twice from the same KV cache, once fused and once through the
Python layer loop, and asserts the hidden states and the cache rows it wrote
are identical, bit for bit (the same kernels in the same order).
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.models.layer_ops import onednn_bf16_packs
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.runner.step_batch import build_step_batch
from executor_svc.serving.sequence_table import SequenceState
from pagoda.params import SamplingParams
from tests.executor.conftest import native_ops

PROMPTS = (5, 17, 30)  # tokens before the decode step


def _needs_fused_kernels(dtype: str, quantization: str = "none") -> None:
    """Skip unless this CPU runs the packed weights the fused call reads: the fp32 panels need AVX-512 or AVX2 +
    FMA; bf16 weights are bf16 panels on AMX or AVX512-BF16, fp32 panels where oneDNN packs no bf16 (AVX2 alone)
    and oneDNN's layout elsewhere (no fused call); int8 and GGUF blocks need VNNI or AVX2."""
    if quantization != "none":
        ops = native_ops("f32_panels", f"{quantization} weights are packed for the fused call only with our kernels")
        if not {"avx512_vnni", "avx2_int8"} & set(ops.cpu_features()):
            pytest.skip(f"{quantization} weights are packed for the fused call only with AVX512-VNNI or AVX2")
    elif dtype == "bfloat16":
        ops = native_ops("f32_panels", "bf16 weights are packed for the fused call only with our panel GEMMs")
        if not ops.bf16_kernels_ready() and onednn_bf16_packs():
            pytest.skip("bf16 weights go to oneDNN's packed layout here, which the fused call does not read")
    else:
        native_ops("f32_panels", "fp32 weights are packed for the fused call only with AVX-512 or AVX2 + FMA")


def _runner(folder, dtype: str, quantization: str = "none", kv: str = "auto") -> ModelRunner:
    _needs_fused_kernels(dtype, quantization)
    return ModelRunner(
        str(folder),
        dtype=dtype,
        device="cpu",
        kv_cache_memory_bytes=4 << 20,
        quantization=quantization,
        kv_cache_dtype=kv,
        layer_ops="cpp",
        attention_backend="cpp",
    )


def _states(runner: ModelRunner, draft_rows: int = 0) -> list[SequenceState]:
    """Sequences with their prompts in the cache (one prefill step), ready for a decode step."""
    states, first_block = [], 0
    for i, length in enumerate(PROMPTS):
        blocks = list(range(first_block, first_block + -(-(length + 8) // runner.block_size)))
        first_block = blocks[-1] + 1
        tokens = [(7 * i + 3 * j) % 90 + 5 for j in range(length)]
        states.append(SequenceState(i, f"r{i}", tokens, length, SamplingParams(temperature=0.0), blocks, 0))
    with torch.inference_mode():
        batch = build_step_batch([(s, len(s.token_ids)) for s in states], runner.block_size, runner.device)
        runner._forward(batch)
    for state in states:
        state.num_computed_tokens = len(state.token_ids)
        state.token_ids.append(11)
        if draft_rows:
            state.draft_token_ids = [12 + j for j in range(draft_rows)]
    return states


def _both_ways(runner: ModelRunner, states: list[SequenceState]) -> None:
    """The decode step fused and through the layer loop, from the same cache: identical hidden states and KV."""
    fused = runner.model.fused_decode
    assert fused is not None, runner.model.decode_path
    batch = build_step_batch([(s, 1) for s in states], runner.block_size, runner.device)
    saved = [t.clone() for t, _ in runner.kv_cache.block_tensors()]
    outputs = []
    with torch.inference_mode():
        for model_fused in (fused, None):
            for tensor, contents in zip((t for t, _ in runner.kv_cache.block_tensors()), saved):
                tensor.copy_(contents)
            runner.model.fused_decode = model_fused
            states_now = runner._layer_states.prepare(runner.backend, batch.attn_meta)
            assert fused.applies(states_now)
            hidden = runner._forward(batch).clone()
            outputs.append((hidden, [t.clone() for t, _ in runner.kv_cache.block_tensors()]))
    runner.model.fused_decode = fused
    (fused_hidden, fused_kv), (loop_hidden, loop_kv) = outputs
    assert fused_hidden.isfinite().all()
    assert torch.equal(fused_hidden, loop_hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, loop_kv))
    assert not all(torch.equal(a, b) for a, b in zip(fused_kv, saved))  # the step wrote its K/V


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window", "llama_head_dim"])
def test_fused_decode_equals_the_layer_loop(checkpoints, cpp_kernel, arch, dtype):
    """Llama, Qwen2 (q/k/v bias), Mistral (a sliding window shorter than the contexts), odd head dims."""
    runner = _runner(checkpoints[arch], dtype)
    _both_ways(runner, _states(runner))


@pytest.mark.parametrize(
    ("quantization", "kv"), [("int8", "auto"), ("int8", "int8"), ("q8_0", "auto"), ("none", "int8")]
)
def test_fused_decode_equals_the_layer_loop_quantized(checkpoints, cpp_kernel, quantization, kv):
    """int8 weights (AMX-INT8 or VNNI), GGUF blocks, and the int8 KV cache with its scales."""
    runner = _runner(checkpoints["llama"], "bfloat16", quantization, kv)
    _both_ways(runner, _states(runner))


def test_draft_rows_run_fused(checkpoints, cpp_kernel):
    """A sequence verifying drafts is several decode rows sharing its blocks: still one fused call."""
    runner = _runner(checkpoints["llama"], "bfloat16")
    states = _states(runner, draft_rows=2)
    rows = [(s, 1) for s in states]
    batch = build_step_batch(rows, runner.block_size, runner.device)
    assert batch.num_tokens == 3 * len(states) and not batch.attn_meta.prefills
    _both_ways(runner, states)


def test_prefill_steps_and_other_paths_take_the_layer_loop(checkpoints, cpp_kernel):
    """A step with a prompt chunk is not fused; torch layer ops or a q/k-norm model never are (and say why)."""
    runner = _runner(checkpoints["llama"], "float32")
    states = _states(runner)
    decode = build_step_batch([(states[0], 1), (states[1], 1)], runner.block_size, runner.device)
    assert runner.model.fused_decode.applies(runner._layer_states.prepare(runner.backend, decode.attn_meta))
    fresh = SequenceState(9, "r9", list(range(5, 25)), 20, SamplingParams(temperature=0.0), [60, 61, 62], 0)
    mixed = build_step_batch([(states[0], 1), (fresh, 20)], runner.block_size, runner.device)
    assert not runner.model.fused_decode.applies(runner._layer_states.prepare(runner.backend, mixed.attn_meta))
    torch_ops = ModelRunner(  # not _runner: the torch ops run anywhere
        str(checkpoints["llama"]), dtype="float32", device="cpu", layer_ops="torch", kv_cache_memory_bytes=1 << 20
    )
    assert torch_ops.model.fused_decode is None and torch_ops.model.decode_path == "layer ops torch"
    qk_norm = _runner(checkpoints["qwen3"], "float32")
    assert qk_norm.model.fused_decode is None and "q/k norms" in qk_norm.model.decode_path


def test_bad_arguments_are_refused_before_any_layer_runs(checkpoints, cpp_kernel):
    """Lists of the wrong length or an unknown weight kind: a clear error, and the residual stream untouched."""
    runner = _runner(checkpoints["llama"], "float32")
    fused = runner.model.fused_decode
    hidden = torch.randn(2, runner.config.hidden_size)
    before = hidden.clone()
    lists = {
        "weights": fused.weights,
        "scales": fused.scales,
        "biases": fused.biases,
        "kinds": fused.kinds,
        "out_features": fused.out_features,
        "widen_above": 0,
        "norms": fused.norms,
    }
    positions, table, lengths = torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2)
    step = (positions, table, lengths.long(), 4, 2, 0.25, 0, 0.0, 1e-5)

    def call(**changed):
        args = {**lists, **changed}
        cpp_kernel.decode_layers(
            hidden, hidden.clone(), positions, runner.model.rope.cos, runner.model.rope.sin, *args.values(),
            *fused._layer_caches(runner.kv_cache), *step,
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="4 per layer"):
        call(**{name: value[:-1] for name, value in lists.items() if name not in ("widen_above", "norms")})
    with pytest.raises(RuntimeError, match="unknown linear kind 7"):
        call(kinds=[7] * len(fused.kinds))
    with pytest.raises(RuntimeError, match="two norms"):
        call(norms=fused.norms[:-1])
    assert torch.equal(hidden, before)
