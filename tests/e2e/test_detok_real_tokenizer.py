"""Incremental detokenisation with the real Gemma 3 tokenizer (262k pieces, byte fallback), as property tests.

Any text, cut into arbitrary pieces that are tokenized separately (so the ids are any valid tokenization, not only
the canonical one) and fed after any prompt: the deltas join to exactly the text, none carries half a character.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokenmill.engine.detok import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
# SentencePiece writes a space as "▁" (U+2581), so the tokenizer itself reads a literal "▁" as a space:
# decode(encode("a▁b")) is "a b". No detokeniser can give back what the ids no longer say, so the texts leave it out.
SPACE_MARK = "\u2581"
characters = st.characters(exclude_characters=REPLACEMENT + SPACE_MARK, exclude_categories=("Cs",))
words = st.sampled_from(
    [
        "the",
        " capital",
        " of",
        "\n\n",
        "    ",
        "def",
        "(",
        "):",
        "日本語",
        "文本",
        "🎉",
        "👩‍👩‍👧",
        "café",
        " naïve",
        "Straße",
        "\t",
        "1234",
        "<b>",
        "<eos>",
        "é",
    ]
)
texts = st.lists(st.one_of(st.text(characters, max_size=6), words), max_size=12).map("".join)


@st.composite
def pieces(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A prompt and a text cut into pieces at arbitrary character positions."""
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return draw(texts), [text[i:j] for i, j in itertools.pairwise(bounds)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=pieces())
@example(case=("\u0eba\U00010000", ["\u02f7"]))  # found by hypothesis: the window started mid-character
def test_any_tokenization_of_any_text_detokenizes_exactly(default_weights: Any, case: tuple[str, list[str]]) -> None:
    tokenizer = default_weights.tokenizer
    prompt, parts = case
    text = "".join(parts)
    ids = [i for part in parts for i in tokenizer.encode(part, add_special_tokens=False)]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens=False)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)
