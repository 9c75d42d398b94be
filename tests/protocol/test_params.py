"""The parameter table: ranges, aliases and rows as every layer reads them."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda import params
from pagoda.params import SamplingParams, StoppingCriteria

LIMITS = {"max_logprobs": 20, "max_new_tokens": 4096}


def check(name: str, value: object) -> str | None:
    row = params.field(name)
    return row.spec.check(name, row.spec.resolve_alias(value), LIMITS.__getitem__)


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("temperature", 0.0, True),
        ("temperature", -0.1, False),
        ("temperature", float("nan"), False),
        ("top_p", 1.0, True),
        ("top_p", 0.0, False),  # open at 0
        ("top_k", -1, True),  # alias of 0
        ("top_k", -2, False),
        ("min_p", 1.5, False),
        ("repetition_penalty", 0.0, False),
        ("presence_penalty", 2.0, True),
        ("frequency_penalty", -2.5, False),
        ("seed", 2**63 - 1, True),
        ("seed", 2**63, False),
        ("logprobs", 20, True),
        ("logprobs", 21, False),  # a named server limit
        ("max_tokens", 0, False),
        ("max_tokens", 4096, True),
    ],
)
def test_ranges(name, value, ok):
    assert (check(name, value) is None) == ok


def test_messages_name_the_range():
    assert check("top_p", 0.0) == "must be in (0, 1], got 0.0"
    assert check("seed", 2**63) == f"must be in [0, 2^63), got {2**63}"
    # One-sided ranges read as a comparison; aliases are named as accepted values.
    assert check("temperature", -1.0) == "must be >= 0, got -1.0"
    assert check("repetition_penalty", 0.0) == "must be > 0, got 0.0"
    assert check("top_k", -2) == "must be >= 0 or -1, got -2"
    assert check("temperature", float("inf")) == "must be a finite number, got inf"


def test_a_named_server_limit_is_called_a_limit():
    """The operator sets it (--max-logprobs, --max-new-tokens): the client learns it is a limit, not a meaning."""
    assert check("logprobs", 99) == "must be in [0, 20], got 99 (above the limit of 20)"
    assert check("max_tokens", 4097) == "must be in [1, 4096], got 4097 (above the limit of 4096)"
    assert check("max_tokens", 0) == "must be in [1, 4096], got 0"


def test_rows_cover_both_dataclasses_with_unique_proto_numbers():
    for group, cls in params.PARAM_CLASSES.items():
        rows = list(params.fields(group))
        assert [r.name for r in rows] == [f.name for f in dataclasses.fields(cls)]
        numbers = [r.spec.number for r in rows]
        assert len(set(numbers)) == len(numbers), group
    assert params.names() == params.names("sampling") + params.names("stopping")


def test_dataclass_defaults_are_neutral():
    """The effective defaults disable every sampling transform (the executor's view)."""
    s = SamplingParams()
    assert (s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (1.0, 0, 0.0, 1.0)
    assert StoppingCriteria(max_tokens=5).stop == ()
    with pytest.raises(KeyError):
        params.field("no_such_param")
