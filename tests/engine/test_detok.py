from __future__ import annotations

import pytest

from tests.engine.tiny import ByteTokenizer
from tokenmill.engine.detok import IncrementalDetokenizer

TOK = ByteTokenizer()


@pytest.mark.parametrize(
    "text", ["plain ascii", "accents: café naïve", "CJK 漢字かな", "emoji 👍🏽 and 🇫🇷", "tabs\tand\nlines"]
)
def test_incremental_text_equals_full_decode_and_never_splits_a_character(text: str) -> None:
    prompt = TOK.encode("prompt: ")
    detok = IncrementalDetokenizer(TOK, prompt)
    deltas = [detok.add(t) for t in TOK.encode(text, add_special_tokens=False)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped_in_text() -> None:
    detok = IncrementalDetokenizer(TOK, TOK.encode("x"))
    assert detok.add(TOK.eos_id) == ""
    assert detok.add(TOK.encode("a", add_special_tokens=False)[0]) == "a"


def test_flush_releases_an_unfinished_character_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOK, [])
    first_byte = TOK.encode("é", add_special_tokens=False)[0]
    assert detok.add(first_byte) == ""
    assert detok.flush() == "\ufffd"
