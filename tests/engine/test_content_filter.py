"""The content filter on its own: patterns from a file, and the checker's hold-back over any split of the text."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.engine.content_filter import ContentFilter, ContentFilterError, FilterChecker


def released(checker: FilterChecker, pieces: list[str]) -> str:
    return "".join(checker.feed(p) for p in pieces) + checker.flush()


@pytest.mark.parametrize(
    ("lines", "pieces", "expected", "matched"),
    [
        (["bad"], ["a good", " text"], "a good text", False),
        (["bad"], ["this is b", "a", "d news"], "this is ", True),  # a match split across three deltas
        (["bad"], ["b", "a", "x"], "bax", False),  # a false start is released once it cannot match
        (["aab"], ["a", "a", "a", "b"], "a", True),  # overlapping starts: "aaab" matches from the second a
        (["abc", "bcd"], ["xab", "cd"], "x", True),  # overlapping patterns: the earliest complete match
        (["re:[0-9]{3}-[0-9]{4}"], ["call 555-", "12", "34 now"], "call ", True),
        (["re:[0-9]{3}-[0-9]{4}"], ["call 555-", "12x"], "call 555-12x", False),
        (["re:(?i)secret"], ["a SeCr", "ET"], "a ", True),
        (["a.b"], ["axb a.b"], "axb ", True),  # a literal line is literal: its dot is a dot
        (["bad"], ["ba"], "ba", False),  # ended for another reason: held text that is no match is shown
        (["re:ab+c"], ["xab", "bb"], "xabbb", False),  # a partial regex match at the end is shown once it ends
    ],
)
def test_filter_cuts_before_the_first_match(lines: list[str], pieces: list[str], expected: str, matched: bool) -> None:
    checker = ContentFilter.from_lines(lines).checker()
    assert released(checker, pieces) == expected
    assert checker.matched is matched


def test_text_that_may_become_a_match_is_held_back_not_shown() -> None:
    checker = ContentFilter.from_lines(["forbidden"]).checker()
    assert checker.feed("it is forb") == "it is "
    assert checker.feed("idd") == ""
    assert checker.feed("en fruit") == ""
    assert checker.matched


def test_a_match_that_begins_in_the_context_ends_the_output_at_its_start() -> None:
    checker = ContentFilter.from_lines(["bomb"]).checker(context="how to make a bo")
    assert checker.feed("m") == ""
    assert checker.feed("b") == ""
    assert checker.matched
    clean = ContentFilter.from_lines(["bomb"]).checker(context="a bo")
    assert released(clean, ["at"]) == "at"  # the context itself is never returned


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["re:(unclosed"], "line 1: bad regular expression"),
        (["ok", "re:a*"], "line 2: the pattern matches empty text"),
        (["", "  "], "no patterns"),
    ],
)
def test_bad_filter_files_are_refused(lines: list[str], message: str) -> None:
    with pytest.raises(ContentFilterError, match=message):
        ContentFilter.from_lines(lines)


def test_a_file_one_pattern_a_line(tmp_path: Path) -> None:
    path = tmp_path / "filter.txt"
    path.write_text("spam\r\n\nre:e+ggs\n", encoding="utf-8")
    content_filter = ContentFilter.from_file(str(path))
    assert content_filter.count == 2
    assert [content_filter.matches(t) for t in ("spam", "eeggs", "egg", "Spam")] == [True, True, False, False]
    with pytest.raises(ContentFilterError, match="cannot read it"):
        ContentFilter.from_file(str(tmp_path / "missing.txt"))


ALPHABET = "ab c"
PATTERNS = ["ab", "re:a c+", "cc a", "b b"]


@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
    context=st.text(alphabet=ALPHABET, max_size=4),
)
def test_any_split_shows_a_prefix_that_stops_exactly_where_a_match_begins(
    text: str, cuts: list[int], context: str
) -> None:
    content_filter = ContentFilter.from_lines(PATTERNS)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    checker = content_filter.checker(context)
    shown = ""
    for piece in pieces:
        shown += checker.feed(piece)
        assert not content_filter.matches(context + shown) or content_filter.matches(context)
    shown += checker.flush()
    assert text.startswith(shown)
    full, cut = context + text, len(context) + len(shown)
    if checker.matched:  # a match begins right where the output was cut, or inside the context before it
        in_context = not shown and any(content_filter.pattern.match(full, i) for i in range(len(context)))
        assert content_filter.pattern.match(full, cut) is not None or in_context
    else:
        assert shown == text and not content_filter.matches(full)
