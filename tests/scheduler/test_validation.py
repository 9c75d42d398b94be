"""Validation from the parameter table: defaults, aliases, ranges and the rules that are not ranges."""

from __future__ import annotations

import pytest

from pagoda import params
from pagoda.params import MAX_SEED, SamplingParams, StoppingCriteria
from scheduler_svc.api.validation import Limits, sampling_params, stopping_criteria
from scheduler_svc.errors import InvalidRequest

LIMITS = Limits(max_model_len=100, vocab_size=50, max_prompt_tokens=99, max_new_tokens=60, default_max_tokens=30)


def refusal(call, *args) -> str:
    with pytest.raises(InvalidRequest) as info:
        call(*args)
    return str(info.value)


def test_unset_fields_take_the_table_defaults_and_the_seed_is_drawn():
    sampling = sampling_params({}, LIMITS)
    drawn = sampling.seed
    assert sampling == SamplingParams(temperature=0.0, seed=drawn)
    assert 0 <= drawn <= MAX_SEED
    assert len({sampling_params({}, LIMITS).seed for _ in range(8)}) > 1
    assert stopping_criteria({}, 10, LIMITS) == StoppingCriteria(max_tokens=30)


def test_every_row_is_filled_from_the_table():
    """A field the client leaves unset gets its row's unset value (nothing hand-written per field)."""
    sampling = sampling_params({"seed": 1}, LIMITS)
    for row in params.rows("sampling"):
        if row.name != "seed":
            assert getattr(sampling, row.name) == row.unset, row.name


def test_given_values_pass_through_with_aliases_applied():
    given = {"temperature": 0.7, "top_k": -1, "seed": 5, "logprobs": 20}
    assert sampling_params(given, LIMITS) == SamplingParams(temperature=0.7, top_k=0, seed=5, logprobs=20)
    stopping = stopping_criteria({"max_tokens": 60, "stop": ["a", "b"], "ignore_eos": True}, 40, LIMITS)
    assert stopping == StoppingCriteria(max_tokens=60, stop=("a", "b"), ignore_eos=True)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"temperature": -1.0}, "sampling.temperature: must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, "sampling.temperature: must be a finite number, got nan"),
        ({"top_p": 0.0}, "sampling.top_p: must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "sampling.top_k: must be >= 0 or -1, got -2"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty: must be > 0, got 0.0"),
        ({"seed": 2**63}, f"sampling.seed: must be in [0, 2^63), got {2**63}"),
        ({"logprobs": 21}, "sampling.logprobs: must be in [0, 20], got 21 (above the limit of 20)"),
        ({"no_such_param": 0.5}, "sampling.no_such_param: no such parameter"),
    ],
)
def test_sampling_refusals_name_the_field(given, message):
    assert refusal(sampling_params, given, LIMITS) == message


@pytest.mark.parametrize(
    ("given", "num_prompt_tokens", "message"),
    [
        ({"max_tokens": 0}, 10, "stopping.max_tokens: must be in [1, 60], got 0"),
        ({"max_tokens": 61}, 10, "stopping.max_tokens: must be in [1, 60], got 61 (above the limit of 60)"),
        (
            {"max_tokens": 50},
            60,
            "stopping.max_tokens: prompt (60 tokens) + max_tokens (50) exceeds the model's context of 100 tokens",
        ),
        ({"stop": ("x",) * 17}, 10, "stopping.stop: at most 16 stop strings"),
        ({"stop": ("ok", "")}, 10, "stopping.stop[1]: must have 1 to 256 characters"),
        ({"stop_token_ids": (50,)}, 10, "stopping.stop_token_ids: token id 50 is outside the vocabulary"),
        ({"stop_token_ids": tuple(range(17))}, 10, "stopping.stop_token_ids: at most 16 stop token ids"),
    ],
)
def test_stopping_refusals_name_the_field(given, num_prompt_tokens, message):
    assert refusal(stopping_criteria, given, num_prompt_tokens, LIMITS) == message


def test_unset_max_tokens_is_cut_to_the_context_left():
    assert stopping_criteria({}, 90, LIMITS).max_tokens == 10
    small_cap = Limits(100, 50, 99, max_new_tokens=20, default_max_tokens=30)
    assert stopping_criteria({}, 10, small_cap).max_tokens == 20


def test_every_named_bound_is_a_limit():
    for row in params.fields():
        for bound in (row.spec.low, row.spec.high):
            if bound is not None and bound.limit:
                assert isinstance(LIMITS.value(bound.limit), int), row.name
    with pytest.raises(KeyError, match="no_such_limit"):
        LIMITS.value("no_such_limit")
