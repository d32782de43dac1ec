from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.api.fake_engine import CharTokenizer
from tests.engine.tiny import ByteTokenizer
from tokenmill.api.logprobs import MIN_LOGPROB, InContext, LogprobsBuilder, TokenView, finite, fit, top_logprobs
from tokenmill.engine.outputs import TokenLogprob


@pytest.mark.parametrize(
    ("value", "expected"), [(-1.5, -1.5), (0.0, 0.0), (-math.inf, MIN_LOGPROB), (math.nan, MIN_LOGPROB)]
)
def test_finite(value: float, expected: float) -> None:
    assert finite(value) == expected


TOP_CASES: list[tuple[TokenLogprob, int, dict[str, float] | None]] = [
    (TokenLogprob(1, "a", None), 3, None),
    (TokenLogprob(1, "a", -1.0, [(2, "b", -0.5)]), 0, {"a": -1.0}),
    (TokenLogprob(1, "a", -1.0, [(1, "a", -1.0), (2, "b", -2.0)]), 1, {"a": -1.0}),
    (TokenLogprob(1, "a", -1.0, [(2, "b", -0.5), (3, "c", -2.0)]), 2, {"b": -0.5, "a": -1.0, "c": -2.0}),
    (TokenLogprob(1, "a", -3.0, [(2, "x", -0.5), (3, "x", -0.7)]), 2, {"x": -0.5, "a": -3.0}),
    (TokenLogprob(1, "a", -1.0, [(2, "b", -math.inf)]), 1, {"a": -1.0, "b": MIN_LOGPROB}),
]


@pytest.mark.parametrize(("entry", "k", "expected"), TOP_CASES)
def test_top_logprobs_holds_k_alternatives_plus_the_chosen_token(
    entry: TokenLogprob, k: int, expected: dict[str, float] | None
) -> None:
    top = top_logprobs(entry, k)
    assert top == expected
    if top is not None:
        assert len(top) <= k + 1 and list(top.values()) == sorted(top.values(), reverse=True)


def test_offsets_run_across_prompt_and_fragments() -> None:
    tok = CharTokenizer()
    bos, a, b, d, e, f = tok.encode("abdef")
    builder = LogprobsBuilder(0, TokenView(tok), [bos, a, b])
    prompt = builder.prompt(
        [TokenLogprob(bos, "<bos>", None), TokenLogprob(a, "a", -1.0), TokenLogprob(b, "b", -2.0)], "ab"
    )
    assert prompt["tokens"] == ["", "a", "b"]  # the BOS the text leaves out takes no room
    assert prompt["text_offset"] == [0, 0, 1]
    assert prompt["token_logprobs"] == [None, -1.0, -2.0]
    first = builder.generated([TokenLogprob(d, "d", -0.1), TokenLogprob(e, "e", -0.2)], "de")
    second = builder.generated([TokenLogprob(f, "f", -0.3)], "f", final=True)
    assert first["text_offset"] + second["text_offset"] == [2, 3, 4]
    assert first["tokens"] == ["d", "e"]
    assert second["tokens"] == ["f"] and second["top_logprobs"] == [{"f": -0.3}]


FIT_CASES: list[tuple[list[str], str, list[str]]] = [
    (["<bos>", "H", "i"], "Hi", ["", "H", "i"]),  # a token the text leaves out
    (["Hel", "lo"], "He", ["He", ""]),  # the text ends inside a token (a stop string cut it)
    (["a", "<eos>"], "a", ["a", ""]),
    (["a", " b", "c"], "a\u2581bc", ["a", "\u2581b", "c"]),  # spelled differently, position by position
    (["ab"], "abc", ["abc"]),  # what no token covers goes to the last one
    (["", "x"], "x", ["", "x"]),
    ([], "", []),
]


@pytest.mark.parametrize(("texts", "text", "expected"), FIT_CASES)
def test_fit_follows_the_tokens_where_they_agree_with_the_text(
    texts: list[str], text: str, expected: list[str]
) -> None:
    assert fit(texts, text) == expected


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(max_size=4), min_size=1, max_size=8), text=st.text(max_size=20))
def test_fit_always_joins_to_the_text(texts: list[str], text: str) -> None:
    strings = fit(texts, text)
    assert len(strings) == len(texts) and "".join(strings) == text


def test_in_context_gives_a_character_to_the_token_that_finishes_it() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("x\uffffy\U00020000", add_special_tokens=False)
    reader = InContext(tok, [tok.bos_id], skip_special_tokens=True)
    assert reader.peek(ids[0]) == "x"
    strings = [reader.add(i) for i in ids]
    assert strings == ["x", "", "", "\uffff", "y", "", "", "", "\U00020000"]
    reader.add(ids[1])  # half a character ...
    assert reader.peek(ids[2]) == "" and reader.peek(tok.encode("a", add_special_tokens=False)[0]) == "\ufffda"
    assert reader.flush() == "\ufffd"  # ... that never finished
