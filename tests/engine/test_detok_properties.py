"""Property tests for incremental detokenisation on the byte tokenizer, where every multi-byte character spans tokens.

For any text after any prompt, fed token by token (with special tokens anywhere between characters): the deltas
joined equal the text, and no delta ever carries half a character.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.tiny import ByteTokenizer
from tokenmill.engine.detok import IncrementalDetokenizer

TOK = ByteTokenizer()
REPLACEMENT = "\ufffd"
# Any character but U+FFFD (its presence is how half characters show) and surrogates (not encodable).
texts = st.text(st.characters(exclude_characters=REPLACEMENT, exclude_categories=("Cs",)), max_size=30)


@st.composite
def ids_with_specials(draw: st.DrawFn) -> tuple[str, list[int]]:
    """A text and its ids, with special tokens (skipped when decoding) inserted between characters."""
    text = draw(texts)
    ids: list[int] = []
    for char in text:
        ids += draw(st.lists(st.sampled_from([TOK.pad_id, TOK.eos_id, TOK.bos_id]), max_size=1))
        ids += TOK.encode(char, add_special_tokens=False)
    return text, ids


def detokenize(prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(TOK, prompt_ids)
    return [detok.add(i) for i in ids] + [detok.flush()]


@settings(max_examples=300, deadline=None)
@given(texts, ids_with_specials())
def test_deltas_join_to_the_text_and_never_split_a_character(prompt: str, case: tuple[str, list[int]]) -> None:
    text, ids = case
    deltas = detokenize(TOK.encode(prompt), ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(texts, st.data())
def test_any_split_between_prompt_and_completion_gives_the_rest_of_the_text(text: str, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(text)))  # a character boundary; the byte tokens around it are arbitrary
    prompt_ids = TOK.encode(text[:cut])
    completion = detokenize(prompt_ids, TOK.encode(text[cut:], add_special_tokens=False))
    assert "".join(completion) == text[cut:]
    assert TOK.decode(prompt_ids, skip_special_tokens=True) + "".join(completion) == text
