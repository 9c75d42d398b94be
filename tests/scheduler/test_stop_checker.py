"""Stop strings over deltas: every split position, holdback, include or not."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.text.stop_checker import StopChecker


def run(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    """Emitted pieces (flush last when nothing matched) and the matched string."""
    pieces = []
    for delta in deltas:
        text, matched = checker.process(delta)
        pieces.append(text)
        if matched is not None:
            return pieces, matched
    return pieces + [checker.flush()], None


def splits(text: str, num_cuts: int):
    """Every way to cut text into num_cuts + 1 deltas (empty ones included)."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), num_cuts):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Character-by-character: stop at the first position where a stop string ends."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            matched = max(ending, key=len)
            return text[: end if include else end - len(matched)], matched
    return text, None


TEXT = "The answer is 42.\nUser: thanks 🎉 ok"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("num_cuts", [1, 2, 3])
def test_stop_string_split_at_every_position(include, num_cuts):
    stop = ["\nUser:", "never"]
    expected_text = "The answer is 42.\nUser:" if include else "The answer is 42."
    for deltas in splits(TEXT, num_cuts):
        checker = StopChecker(stop, include_stop_str_in_output=include)
        emitted = ""
        matched = None
        for delta in deltas:
            text, matched = checker.process(delta)
            emitted += text
            # Nothing that is later cut off is ever shown.
            assert expected_text.startswith(emitted), deltas
            if matched:
                break
        assert (emitted, matched) == (expected_text, "\nUser:"), deltas
        assert checker.flush() == ""


def test_no_match_flush_returns_everything():
    for deltas in splits("tail ends with Us", 2):
        checker = StopChecker(["\nUser:", "User:"])
        pieces, matched = run(checker, deltas)
        assert matched is None and "".join(pieces) == "tail ends with Us"
    checker = StopChecker(["User:"])
    assert checker.process("ends with Us") == ("ends with ", None)
    assert checker.flush() == "Us"
    assert checker.flush() == ""


def test_empty_stop_list_passes_through():
    checker = StopChecker([])
    for delta in ["a", "", "bc🎉", "\n"]:
        assert checker.process(delta) == (delta, None)
    assert checker.flush() == ""


def test_holdback_is_released_when_it_cannot_match():
    checker = StopChecker(["abc"])
    assert checker.process("xxab") == ("xx", None)
    assert checker.process("d") == ("abd", None)
    assert checker.process("a") == ("", None)
    assert checker.process("a") == ("a", None)
    assert checker.process("bc!") == ("", "abc")


def test_overlapping_partial_prefixes():
    # "aab" arrives after "aa" that itself ends with a possible start "a".
    checker = StopChecker(["aab"], include_stop_str_in_output=True)
    assert checker.process("xa") == ("x", None)
    assert checker.process("a") == ("", None)
    assert checker.process("a") == ("a", None)
    assert checker.process("b tail") == ("aab", "aab")


def test_first_complete_stop_wins_then_longest():
    # "bc" completes before "abcd", whatever the deltas.
    for deltas in splits("xabcde", 2):
        pieces, matched = run(StopChecker(["abcd", "bc"]), deltas)
        assert ("".join(pieces), matched) == ("xa", "bc"), deltas
    # Both end at the same character: the longer one is the match.
    assert StopChecker(["c", "abc"]).process("xxabc") == ("xx", "abc")
    assert StopChecker(["c", "abc"], True).process("xxabcd") == ("xxabc", "abc")


def test_after_match_nothing_more():
    checker = StopChecker(["STOP"])
    assert checker.process("go STOP and more") == ("go ", "STOP")
    assert checker.matched == "STOP"
    assert checker.process("more") == ("", None)
    assert checker.flush() == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""]])
def test_empty_stop_string_rejected(stop):
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(stop)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab🎉\n ", max_size=14),
    stop=st.lists(st.text(alphabet="ab🎉\n ", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 14), max_size=5),
    include=st.booleans(),
)
def test_matches_character_by_character_reference(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopChecker(stop, include)
    emitted, matched = "", None
    expected_text, expected_match = reference(text, stop, include)
    for delta in deltas:
        piece, matched = checker.process(delta)
        emitted += piece
        assert expected_text.startswith(emitted)
        if matched:
            break
    if matched is None:
        emitted += checker.flush()
    assert (emitted, matched) == (expected_text, expected_match)
