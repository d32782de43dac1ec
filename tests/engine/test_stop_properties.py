"""Property tests for stop-string hold-back: for any text, any stop strings and any way the text arrives in deltas.

The reference is the definition: after each delta, if some stop string occurs in the text so far, the output is that
text cut at the earliest occurrence and nothing more ever comes; until then, everything is released except the
longest tail that could still grow into a stop string.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.stop import StopChecker

# A small alphabet makes stop strings actually occur, overlap and half-occur; one character of it is outside the BMP.
ALPHABET = st.sampled_from("ab\n \u00e9\U0001f600")
texts = st.text(ALPHABET, max_size=40)
stops = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4).map(tuple)


@st.composite
def split_text(draw: st.DrawFn) -> list[str]:
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[i:j] for i, j in itertools.pairwise(bounds)]


def reference(pieces: list[str], stop: tuple[str, ...]) -> tuple[str, bool]:
    seen = ""
    for piece in pieces:
        seen += piece
        found = [i for i in (seen.find(s) for s in stop) if i >= 0]
        if found:
            return seen[: min(found)], True
    return seen, False


def partial_tail(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=500, deadline=None)
@given(split_text(), stops)
def test_any_split_gives_the_defined_text(pieces: list[str], stop: tuple[str, ...]) -> None:
    checker = StopChecker(stop)
    out = "".join(checker.feed(p) for p in pieces) + checker.flush()
    assert (out, checker.matched is not None) == reference(pieces, stop)


@settings(max_examples=500, deadline=None)
@given(split_text(), stops)
def test_hold_back_is_minimal_and_never_takes_text_back(pieces: list[str], stop: tuple[str, ...]) -> None:
    checker = StopChecker(stop)
    released, seen = "", ""
    for piece in pieces:
        released += checker.feed(piece)
        seen += piece
        if checker.matched is not None:
            break
        assert not any(s in released for s in stop)
        assert released == seen[: len(seen) - partial_tail(seen, stop)]  # held back: only a possible stop's start
    final, _ = reference(pieces, stop)
    assert final.startswith(released)


@settings(max_examples=200, deadline=None)
@given(split_text())
def test_without_stop_strings_every_delta_passes_straight_through(pieces: list[str]) -> None:
    checker = StopChecker(())
    assert [checker.feed(p) for p in pieces] == pieces and checker.flush() == ""
