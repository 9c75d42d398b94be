"""Workload generation: the W-mixed rule, prefix sharing, ShareGPT, arrivals."""

from __future__ import annotations

import json
import math
import random

import pytest

from pagoda_bench.workload import (
    arrival_times,
    parse_range,
    random_workload,
    sharegpt_workload,
)


def test_w_mixed_lengths_for_seed_0():
    requests = random_workload(64, (16, 512), (16, 256), seed=0, vocab_size=49152, excluded_ids=(2,))
    pairs = [(r.prompt_len, r.output_len) for r in requests]
    # random.Random(0): prompt length then output length, per request.
    assert pairs[:6] == [(448, 114), (404, 243), (231, 26), (148, 146), (264, 119), (486, 216)]
    assert sum(p for p, _ in pairs) == 18336
    assert sum(o for _, o in pairs) == 9588
    assert [r.index for r in requests] == list(range(64))


def test_random_token_ids_follow_the_lengths_from_the_same_rng():
    requests = random_workload(3, (4, 8), (1, 3), seed=5, vocab_size=50, excluded_ids=(0, 1))
    rng = random.Random(5)
    lengths = [(rng.randint(4, 8), rng.randint(1, 3)) for _ in range(3)]
    allowed = list(range(2, 50))
    for request, (prompt_len, output_len) in zip(requests, lengths):
        assert request.output_len == output_len
        assert request.prompt_token_ids == tuple(allowed[rng.randrange(48)] for _ in range(prompt_len))
    assert all(0 not in r.prompt_token_ids and 1 not in r.prompt_token_ids for r in requests)


def test_random_workload_is_deterministic_and_seed_dependent():
    a = random_workload(8, (16, 64), (16, 32), 0, 1000)
    assert a == random_workload(8, (16, 64), (16, 32), 0, 1000)
    assert a != random_workload(8, (16, 64), (16, 32), 1, 1000)


def test_salted_ids_keep_the_lengths_and_change_every_prompt():
    plain = random_workload(16, (16, 64), (16, 32), 0, 1000)
    salted = random_workload(16, (16, 64), (16, 32), 0, 1000, ids_salt=7)
    assert salted == random_workload(16, (16, 64), (16, 32), 0, 1000, ids_salt=7)
    assert [(r.prompt_len, r.output_len) for r in salted] == [(r.prompt_len, r.output_len) for r in plain]
    others = random_workload(16, (16, 64), (16, 32), 0, 1000, ids_salt=8)
    for a, b, c in zip(plain, salted, others):
        assert a.prompt_token_ids[:16] != b.prompt_token_ids[:16] != c.prompt_token_ids[:16]
    rng = random.Random("0:7")  # the rule: ids from Random(f"{seed}:{salt}") after the lengths from Random(seed)
    assert salted[0].prompt_token_ids == tuple(rng.randrange(1000) for _ in range(salted[0].prompt_len))


def test_prefix_workload_shares_exactly_the_prefix():
    requests = random_workload(5, (4, 6), (8, 8), seed=0, vocab_size=300, prefix_len=32)
    prefix = requests[0].prompt_token_ids[:32]
    for request in requests:
        assert request.prompt_token_ids[:32] == prefix
        assert 36 <= request.prompt_len <= 38
        assert request.output_len == 8
    assert len({r.prompt_token_ids[32:] for r in requests}) == 5


def test_sharegpt_workload(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "a b c d e"}, {"from": "gpt", "value": "w x y z v"}]},
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "p q r s"}, {"from": "gpt", "value": "1 2 3 4 5 6"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    vocab: dict[str, int] = {}

    def tokenize(text: str) -> list[int]:
        return [vocab.setdefault(word, len(vocab)) for word in text.split()]

    requests = sharegpt_workload(path, 10, seed=0, tokenize=tokenize)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(4, 6), (5, 5)]
    fixed = sharegpt_workload(path, 10, seed=0, tokenize=tokenize, fixed_output_len=7)
    assert sorted((r.prompt_len, r.output_len) for r in fixed) == [(2, 7), (4, 7), (5, 7)]


def test_arrivals():
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, 1.0, seed=0)
    assert times == sorted(times)
    assert times[-1] / 2000 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    rng = random.Random(0)
    expected_first = rng.gammavariate(4.0, 1.0 / (10.0 * 4.0))
    assert arrival_times(1, 10.0, 4.0, seed=0) == [expected_first]


@pytest.mark.parametrize("spec,expected", [("16:512", (16, 512)), ("32", (32, 32))])
def test_parse_range(spec, expected):
    assert parse_range(spec) == expected


@pytest.mark.parametrize("spec", ["0:4", "8:4", "a:b", ""])
def test_parse_range_rejects(spec):
    with pytest.raises(ValueError):
        parse_range(spec)
