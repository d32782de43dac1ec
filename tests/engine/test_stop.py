from __future__ import annotations

import pytest

from tokenmill.engine.stop import StopChecker


def feed_all(checker: StopChecker, pieces: list[str]) -> str:
    out = "".join(checker.feed(p) for p in pieces)
    return out + checker.flush()


@pytest.mark.parametrize(
    ("stop", "pieces", "expected", "matched"),
    [
        ((), ["abc", "def"], "abcdef", False),
        (("\n",), ["hello", " world\n", "more"], "hello world", True),
        (("END",), ["abcE", "N", "Dxyz"], "abc", True),  # stop split across three deltas
        (("END",), ["abcE", "N", "x"], "abcENx", False),  # a false start is released once it cannot match
        (("ab", "b"), ["xab"], "x", True),  # the earliest match wins
        (("stop",), ["sto"], "sto", False),  # ended for another reason: held text is released
    ],
)
def test_stop_strings(stop: tuple[str, ...], pieces: list[str], expected: str, matched: bool) -> None:
    checker = StopChecker(stop)
    assert feed_all(checker, pieces) == expected
    assert (checker.matched is not None) is matched


def test_partial_stop_is_held_back_not_shown() -> None:
    checker = StopChecker(("###",))
    assert checker.feed("text#") == "text"
    assert checker.feed("#") == ""
    assert checker.feed("#tail") == ""
    assert checker.matched == "###"
