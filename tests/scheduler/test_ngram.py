"""Prompt-lookup drafts: the longest matching suffix, its latest earlier occurrence, incremental indexing."""

import pytest

from scheduler_svc.spec.ngram import NgramProposer


def test_proposes_what_followed_the_suffix_earlier():
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose([5, 6, 7, 8, 9, 1, 5, 6], 3) == (7, 8, 9)


def test_no_match_proposes_nothing():
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5], 4) == ()
    # A single repeated token is below min_n.
    assert NgramProposer(2, 4).propose([1, 9, 1], 4) == ()


def test_longest_suffix_wins_over_a_later_shorter_match():
    # (2, 3) occurs twice: after 1 (followed by 4) and after 7 (followed by 5); the suffix is (1, 2, 3).
    tokens = [1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3]
    assert NgramProposer(2, 4).propose(tokens, 1) == (4,)
    assert NgramProposer(2, 2).propose(tokens, 1) == (5,)


def test_latest_occurrence_wins():
    assert NgramProposer(2, 2).propose([1, 2, 8, 1, 2, 9, 1, 2], 1) == (9,)


def test_proposal_stops_at_the_known_tokens():
    # The suffix (1, 2) last occurred just before the final 1, 2: only one token follows it.
    assert NgramProposer(2, 2).propose([1, 2, 1, 2], 4) == (1, 2)


def test_incremental_index_equals_a_fresh_one():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0]
    growing = NgramProposer(1, 3)
    for n in range(2, len(tokens) + 1):
        assert growing.propose(tokens[:n], 3) == NgramProposer(1, 3).propose(tokens[:n], 3)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)
