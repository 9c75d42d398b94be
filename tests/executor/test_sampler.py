"""Sampler: exact filter sets, penalties against oracles, seeded streams, statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sampling import ops as sampling_ops
from executor_svc.sampling.sampler import (
    SampleOutput,
    SampleRequest,
    sample,
    validate_sampling_params,
)
from pagoda.params import SamplingParams

MASK64 = (1 << 64) - 1


def _request(token_ids=(1, 2, 3), num_prompt_tokens=2, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), tuple(token_ids), num_prompt_tokens)


def _tokens(outputs: list[SampleOutput]) -> list[int]:
    return [o.token_id for o in outputs]


def _reference_uniform(key: int, v: int) -> float:
    """Python-int splitmix64 of key + (v + 1) * golden, top 23 bits, mid-point."""
    z = sampling_ops.splitmix64((key & MASK64) + v * 0x9E3779B97F4A7C15)
    return ((z >> 41) + 0.5) / (1 << 23)


# --- random stream ---------------------------------------------------------------


def test_hash_uniforms_match_unsigned_python_reference():
    keys = [sampling_ops.stream_key(s, p) for s, p in [(0, 0), (7, 5), (-3, 1), (2**70, 9)]]
    assert any(k < 0 for k in keys)  # the high bit is exercised
    uniforms = sampling_ops.hash_uniforms(torch.tensor(keys), torch.arange(300))
    expected = [[_reference_uniform(k, v) for v in range(300)] for k in keys]
    assert uniforms.dtype == torch.float32
    assert uniforms.tolist() == expected


def test_stream_key_depends_on_seed_and_position():
    keys = {sampling_ops.stream_key(s, p) for s in range(20) for p in range(20)}
    assert len(keys) == 400
    assert sampling_ops.stream_key(5, 3) == sampling_ops.stream_key(5, 3)


def test_same_seed_same_tokens_alone_and_in_mixed_batch():
    torch.manual_seed(0)
    vocab_size = 3000  # above the 1024 default candidates, which top_k=2000 raises
    target_params = dict(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    others = [
        dict(temperature=0.0),
        dict(temperature=1.3, seed=9),
        dict(temperature=0.7, top_k=5, seed=1234),
        dict(temperature=1.0, top_p=0.5, min_p=0.05, seed=3, logprobs=4),
        dict(temperature=0.0, repetition_penalty=1.5, logprobs=0),
        dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, seed=77),
        dict(temperature=1.1, top_k=2000, top_p=0.99, seed=1234),
    ]
    for position in range(5, 12):
        logits = torch.randn(17, vocab_size) * 3
        target = _request(token_ids=range(position), num_prompt_tokens=3, **target_params)
        alone = sample(logits[8:9].clone(), [target])
        batch = [_request(token_ids=range(i + 2), num_prompt_tokens=1, **others[i % len(others)]) for i in range(17)]
        batch[8] = target
        together = sample(logits, batch)
        assert together[8] == alone[0]


def test_position_and_seed_change_the_token():
    logits = torch.zeros(1, 1000)  # uniform distribution: tokens are the noise argmax

    def token(num_tokens: int, seed: int) -> int:
        return _tokens(sample(logits, [_request(range(num_tokens), 1, seed=seed)]))[0]

    by_position = {token(n, 1) for n in range(1, 30)}
    by_seed = {token(4, s) for s in range(30)}
    assert len(by_position) > 20 and len(by_seed) > 20


def _empirical(logits_row: torch.Tensor, num_draws: int, **params) -> np.ndarray:
    """Token frequencies over seeds 0..num_draws-1, all in one batch."""
    logits = logits_row.expand(num_draws, -1)
    requests = [_request(seed=seed, **params) for seed in range(num_draws)]
    counts = np.bincount(_tokens(sample(logits, requests)), minlength=logits.shape[-1])
    return counts / num_draws


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    freqs = _empirical(logits, 20000, temperature=0.7)
    probs = torch.softmax(logits / 0.7, dim=-1).numpy()
    total_variation = 0.5 * np.abs(freqs - probs).sum()
    assert total_variation < 0.015
    chi2 = 20000 * ((freqs - probs) ** 2 / probs).sum()
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001


def test_empirical_distribution_with_top_p_is_renormalised():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    freqs = _empirical(probs.log(), 20000, top_p=0.8)
    expected = np.array([4 / 9, 3 / 9, 2 / 9, 0.0])
    assert freqs[3] == 0.0
    assert 0.5 * np.abs(freqs - expected).sum() < 0.015


# --- greedy, top-k, top-p, min-p -------------------------------------------------


def test_temperature_zero_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(32, 1000)
    expected = logits.argmax(dim=-1).tolist()
    assert _tokens(sample(logits, [_request(temperature=0.0)] * 32)) == expected
    mixed = [_request(temperature=0.0, seed=i, top_k=3, logprobs=1) for i in range(32)]
    assert _tokens(sample(logits, mixed)) == expected


def test_top_k_never_leaves_the_top_k():
    torch.manual_seed(2)
    logits = torch.randn(1, 200)
    allowed = set(torch.topk(logits[0], 7).indices.tolist())
    freqs = _empirical(logits[0], 3000, temperature=2.0, top_k=7)
    assert set(np.flatnonzero(freqs).tolist()) == allowed


def test_top_k_mask_breaks_ties_towards_lower_ids():
    scaled = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 5.0], [1.0, 3.0, 3.0, 3.0, 0.0, 5.0]])
    keep = sampling_ops.top_k_mask(scaled, torch.tensor([3, 6]))
    assert keep.tolist() == [
        [False, True, True, False, False, True],
        [True, True, True, True, True, True],
    ]


def test_top_k_top_p_mask_keeps_exact_sets():
    probs = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])
    scaled = probs.log().expand(5, -1)
    top_k = torch.tensor([5, 5, 5, 2, 5])
    top_p = torch.tensor([0.75, 0.76, 1e-6, 0.6, 1.0])
    keep = sampling_ops.top_k_top_p_mask(scaled, top_k, top_p)
    assert keep.tolist() == [
        [False, True, False, True, False],  # 0.5 + 0.25 reaches 0.75
        [True, True, False, True, False],  # one more needed
        [False, True, False, False, False],  # always at least one
        [False, True, False, False, False],  # top-2 renormalised: 2/3 >= 0.6
        [True, True, True, True, True],
    ]


def test_top_p_mask_breaks_ties_towards_lower_ids():
    scaled = torch.zeros(1, 4)  # four tokens of 0.25
    keep = sampling_ops.top_k_top_p_mask(scaled, torch.tensor([4]), torch.tensor([0.5]))
    assert keep.tolist() == [[True, True, False, False]]


def test_min_p_mask_keeps_tokens_above_fraction_of_max():
    probs = torch.tensor([0.2, 0.4, 0.1, 0.2, 0.1])
    scaled = probs.log().expand(3, -1)
    keep = sampling_ops.min_p_mask(scaled, torch.tensor([0.4, 0.6, 0.0]))
    assert keep.tolist() == [
        [True, True, False, True, False],
        [False, True, False, False, False],
        [True, True, True, True, True],
    ]


def test_min_p_in_sample_never_emits_filtered_tokens():
    probs = torch.tensor([0.2, 0.4, 0.1, 0.2, 0.1])
    freqs = _empirical(probs.log(), 2000, min_p=0.4)
    assert freqs[2] == 0.0 and freqs[4] == 0.0 and freqs[[0, 1, 3]].min() > 0.15


@pytest.mark.parametrize("num_candidates, big_k", [(8, 30), (64, 30), (1024, 2500)])
def test_candidate_sampling_equals_dense_mask_sampling(num_candidates, big_k):
    torch.manual_seed(8)
    num_rows, vocab_size = 48, 3000
    # bf16-rounded logits: many exact ties; some rows flat, some with -inf (min-p).
    scaled = (torch.randn(num_rows, vocab_size) * torch.rand(num_rows, 1) * 6).bfloat16().float()
    scaled[::7] = torch.randint(0, 3, (vocab_size,)).float()
    scaled[3::5, ::3] = float("-inf")
    k_choices = [5, 40, big_k, vocab_size, vocab_size, 1]
    top_k = torch.tensor([k_choices[i % 6] for i in range(num_rows)])
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.999, 0.95, 1e-6][i % 5] for i in range(num_rows)])
    keys = torch.tensor([sampling_ops.stream_key(i, 17) for i in range(num_rows)])
    dense_mask = sampling_ops.top_k_top_p_mask(scaled, top_k, top_p)
    dense = sampling_ops.gumbel_argmax(scaled.masked_fill(~dense_mask, float("-inf")), keys)
    ours = sampling_ops.filtered_gumbel_argmax(scaled, keys, top_k, top_p, num_candidates)
    assert ours.tolist() == dense.tolist()
    assert dense_mask.gather(1, ours[:, None]).all()


def test_top_k_top_p_mask_counts_match_a_python_reference():
    torch.manual_seed(9)
    scaled = torch.randn(6, 50).bfloat16().float()  # with ties
    top_k = torch.tensor([50, 10, 3, 50, 25, 1])
    top_p = torch.tensor([0.3, 0.8, 1.0, 0.95, 0.5, 0.9])
    keep = sampling_ops.top_k_top_p_mask(scaled, top_k, top_p)
    for row in range(6):
        values = scaled[row].double().tolist()
        ranking = sorted(range(50), key=lambda v: (-values[v], v))[: int(top_k[row])]
        weights = [math.exp(values[v]) for v in ranking]
        kept, mass = [], 0.0
        for v, w in zip(ranking, weights):
            if kept and mass >= float(top_p[row]):
                break
            kept.append(v)
            mass += w / sum(weights)
        assert sorted(torch.nonzero(keep[row])[:, 0].tolist()) == sorted(kept)


_ROW_PARAMS = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        "top_k": st.integers(-1, 70),
        "top_p": st.sampled_from([1.0, 0.95, 0.6, 0.2]),
        "min_p": st.sampled_from([0.0, 0.05, 0.3]),
        "repetition_penalty": st.sampled_from([1.0, 1.3]),
        "seed": st.integers(0, 2**64),
    }
)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(_ROW_PARAMS, min_size=1, max_size=6), data_seed=st.integers(0, 1000))
def test_property_token_in_kept_set_and_same_alone(rows, data_seed):
    generator = torch.Generator().manual_seed(data_seed)
    vocab_size = 64
    logits = (torch.randn(len(rows), vocab_size, generator=generator) * 3).bfloat16().float()
    requests = [_request((1, 5, 9), 1, **params) for params in rows]
    together = _tokens(sample(logits, requests))
    for row, (params, request) in enumerate(zip(rows, requests)):
        assert together[row] == _tokens(sample(logits[row : row + 1], [request]))[0]
        scores = logits[row].clone()
        seen = torch.tensor([1, 5, 9])
        rep = params["repetition_penalty"]
        scores[seen] = torch.where(scores[seen] > 0, scores[seen] / rep, scores[seen] * rep)
        if params["temperature"] == 0.0:
            assert together[row] == int(scores.argmax())
            continue
        scaled = (scores / params["temperature"])[None]
        keep = sampling_ops.min_p_mask(scaled, torch.tensor([params["min_p"]]))
        scaled = scaled.masked_fill(~keep, float("-inf"))
        top_k = params["top_k"] if 0 < params["top_k"] < vocab_size else vocab_size
        keep = sampling_ops.top_k_top_p_mask(scaled, torch.tensor([top_k]), torch.tensor([params["top_p"]]))
        assert keep[0, together[row]] and scaled[0, together[row]] > float("-inf")


# --- penalties ---------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(3)
    vocab_size, penalty = 64, 1.7
    logits = torch.randn(4, vocab_size) * 4
    input_ids = torch.randint(0, vocab_size, (4, 12))
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    rows = torch.arange(4).repeat_interleave(12)
    empty = torch.zeros(0, dtype=torch.int64)
    ours = sampling_ops.apply_penalties(
        logits, rows, input_ids.flatten(), empty, empty,
        torch.full((4,), penalty), torch.zeros(4), torch.zeros(4),
    )  # fmt: skip
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def _numpy_penalties(logits, token_ids, num_prompt, rep, presence, frequency):
    out = logits.astype(np.float32).copy()
    for t in set(token_ids):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    counts = np.bincount(token_ids[num_prompt:], minlength=len(out)).astype(np.float32)
    return out - np.float32(presence) * (counts > 0) - np.float32(frequency) * counts


def test_apply_penalties_matches_numpy_formula():
    rng = np.random.default_rng(10)
    vocab_size, num_prompt = 30, 6
    logits = rng.normal(size=(2, vocab_size)).astype(np.float32) * 3
    token_ids = rng.integers(0, vocab_size, size=(2, 25))
    settings = np.array([[1.4, 0.6, 0.3], [1.0, 0.0, 1.2]], dtype=np.float32)
    rows = torch.arange(2).repeat_interleave(25)
    output_rows = torch.arange(2).repeat_interleave(25 - num_prompt)
    ours = sampling_ops.apply_penalties(
        torch.from_numpy(logits), rows, torch.from_numpy(token_ids).flatten(),
        output_rows, torch.from_numpy(token_ids[:, num_prompt:]).flatten(),
        *torch.from_numpy(settings.T.copy()),
    )  # fmt: skip
    for row in range(2):
        want = _numpy_penalties(logits[row], token_ids[row], num_prompt, *settings[row])
        np.testing.assert_allclose(ours[row].numpy(), want, rtol=1e-6, atol=1e-6)


def test_presence_frequency_and_repetition_via_sample_logprobs():
    rng = np.random.default_rng(4)
    vocab_size = 40
    logits = rng.normal(size=(3, vocab_size)).astype(np.float32) * 3
    settings = [(1.3, 0.5, 0.25), (1.0, 0.0, 0.7), (0.8, 1.1, 0.0)]
    requests, expected = [], []
    for row, (rep, presence, frequency) in enumerate(settings):
        token_ids = rng.integers(0, vocab_size, size=20)
        params = dict(
            temperature=0.0, repetition_penalty=rep, presence_penalty=presence,
            frequency_penalty=frequency, logprobs=vocab_size,
        )  # fmt: skip
        requests.append(_request(token_ids.tolist(), 8, **params))
        penalised = _numpy_penalties(logits[row], token_ids, 8, rep, presence, frequency)
        expected.append(torch.log_softmax(torch.from_numpy(penalised), dim=-1))
    outputs = sample(torch.from_numpy(logits), requests)
    for output, want in zip(outputs, expected):
        assert output.token_id == int(want.argmax())
        got = torch.zeros(vocab_size)
        for entry in output.logprob.top:
            got[entry.token_id] = entry.logprob
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# --- logprobs, dtypes, validation ---------------------------------------------------


def test_logprobs_are_log_softmax_of_logits():
    torch.manual_seed(5)
    logits = torch.randn(3, 100)
    requests = [
        _request(temperature=0.0, logprobs=0),
        _request(temperature=0.8, top_k=10, seed=2, logprobs=3),
        _request(temperature=1.0, seed=2),
    ]
    outputs = sample(logits, requests)
    log_probs = torch.log_softmax(logits, dim=-1)
    assert outputs[2].logprob is None
    assert outputs[0].logprob.top == ()
    for row in (0, 1):
        sampled = outputs[row].logprob.sampled
        assert sampled.token_id == outputs[row].token_id
        assert math.isclose(sampled.logprob, log_probs[row, sampled.token_id], abs_tol=1e-6)
    top = outputs[1].logprob.top
    values, ids = torch.topk(log_probs[1], 3)
    assert [t.token_id for t in top] == ids.tolist()
    np.testing.assert_allclose([t.logprob for t in top], values.tolist(), atol=1e-6)


def test_bfloat16_logits_sample_like_their_float32_values():
    torch.manual_seed(6)
    logits = (torch.randn(8, 300) * 2).to(torch.bfloat16)
    requests = [_request(temperature=0.9, top_p=0.9, seed=i, logprobs=2) for i in range(8)]
    assert sample(logits, requests) == sample(logits.float(), requests)
    assert _tokens(sample(logits, [_request(temperature=0.0)] * 8)) == (logits.float().argmax(dim=-1).tolist())


def test_sample_leaves_the_logits_untouched():
    logits = torch.randn(2, 50)
    before = logits.clone()
    sample(logits, [_request(repetition_penalty=2.0, top_k=3), _request(min_p=0.2)])
    assert torch.equal(logits, before)


def test_validate_sampling_params_rejects_bad_values():
    validate_sampling_params(SamplingParams(temperature=0.0, top_p=1.0, logprobs=5))
    for bad in [
        dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
        dict(min_p=-0.1), dict(repetition_penalty=0.0), dict(logprobs=-1),
    ]:  # fmt: skip
        with pytest.raises(ValueError):
            validate_sampling_params(SamplingParams(**bad))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_same_tokens_as_cpu():
    torch.manual_seed(7)
    logits = torch.randn(64, 4096) * 2
    requests = [_request(range(i + 3), 2, temperature=0.8, top_k=i % 7 * 10, top_p=0.95, seed=i) for i in range(64)]
    keys = torch.tensor([sampling_ops.stream_key(s, 11) for s in range(64)])
    assert torch.equal(
        sampling_ops.hash_uniforms(keys, torch.arange(4096)),
        sampling_ops.hash_uniforms(keys.cuda(), torch.arange(4096).cuda()).cpu(),
    )
    assert _tokens(sample(logits, requests)) == _tokens(sample(logits.cuda(), requests))
