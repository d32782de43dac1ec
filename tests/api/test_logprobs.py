from __future__ import annotations

import math

import pytest

from tokenmill.api.logprobs import MIN_LOGPROB, LogprobsBuilder, finite, top_logprobs
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
    builder = LogprobsBuilder(top_k=0)
    prompt = builder.prompt(
        [TokenLogprob(1, "<bos>", None), TokenLogprob(5, "ab", -1.0), TokenLogprob(6, "c", -2.0)], "abc"
    )
    assert prompt["text_offset"] == [0, 0, 2]
    assert prompt["token_logprobs"] == [None, -1.0, -2.0]
    first = builder.generated([TokenLogprob(7, "d", -0.1), TokenLogprob(8, "", -0.2)])
    second = builder.generated([TokenLogprob(9, "ef", -0.3)])
    assert first["text_offset"] + second["text_offset"] == [3, 4, 4]
    assert second["tokens"] == ["ef"] and second["top_logprobs"] == [{"ef": -0.3}]
